"""The vLLM loader's options (``model_loader_extra_config``): parsed without vLLM, so they
are checked in every venv; each bad value is a ``ValueError`` naming its key."""

from __future__ import annotations

from typing import Any

import pytest

from weightcache import LoadOptions
from weightcache.core.plugins import PluginStep
from weightcache.core.recipe import Recipe
from weightcache.integrations.vllm.config import KEYS, WAIT_WITHOUT_FALLBACK, VllmLoaderConfig


def test_no_extra_config_is_the_defaults() -> None:
    empty: dict[str, Any] = {}
    for extra in (None, empty):
        config = VllmLoaderConfig.parse(extra)
        assert config == VllmLoaderConfig(
            socket=None, dtype=None, fingerprint_level="full", fallback=True, wait_timeout=0.0
        )


def test_every_key_is_read() -> None:
    extra = {
        "socket": "/run/weightcache/cpu.sock",
        "dtype": "bfloat16",
        "fingerprint_level": "sampled",
        "fallback": False,
        "wait_timeout": 5,
        "recipe": "checkpoint",
        "cpu_gemm": "repacked",
    }
    assert set(extra) == set(KEYS)
    config = VllmLoaderConfig.parse(extra)
    assert config == VllmLoaderConfig(
        socket="/run/weightcache/cpu.sock",
        dtype="BF16",
        fingerprint_level="sampled",
        fallback=False,
        wait_timeout=5.0,
        recipe="checkpoint",
        cpu_gemm="repacked",
    )


def test_without_fallback_the_engine_waits_for_its_daemon_as_vllms_ipc_cache() -> None:
    assert VllmLoaderConfig.parse({"fallback": False}).wait_timeout == WAIT_WITHOUT_FALLBACK == 300
    assert VllmLoaderConfig.parse({"fallback": True}).wait_timeout == 0.0
    assert VllmLoaderConfig.parse({"fallback": False, "wait_timeout": 0}).wait_timeout == 0.0


def test_the_vllm_named_options_ask_for_this_ranks_recipe() -> None:
    recipe = Recipe(plugins=(PluginStep("vllm", (("dtype", "bfloat16"),)),))
    config = VllmLoaderConfig.parse({"socket": "/s/d.sock", "fingerprint_level": "sampled"})
    assert config.vllm_options(recipe, 1, 2) == LoadOptions(
        socket="/s/d.sock",
        recipe=recipe,
        fingerprint_level="sampled",
        fallback=False,
        tp_rank=1,
        tp_size=2,
        wait_timeout=0.0,
    )


def test_the_load_options_never_fall_back_inside_weightcache() -> None:
    # A refusal must reach the loader as an exception: vLLM's default loader reads the disk.
    config = VllmLoaderConfig.parse({"socket": "/s/d.sock", "dtype": "F16", "wait_timeout": 2})
    assert config.load_options() == LoadOptions(
        socket="/s/d.sock", dtype="F16", fallback=False, wait_timeout=2.0
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"recipe": "raw"},
            "model_loader_extra_config['recipe'] must be one of ('vllm', 'checkpoint')",
        ),
        (
            {"cpu_gemm": "onednn"},
            "model_loader_extra_config['cpu_gemm'] must be one of ('auto', 'shared', 'repacked'), "
            "not 'onednn'",
        ),
        (
            {"sock": "/x"},
            "unknown model_loader_extra_config key(s) for load format weightcache: 'sock'",
        ),
        ({"socket": ""}, "model_loader_extra_config['socket'] must be a non-empty string"),
        ({"socket": 3}, "model_loader_extra_config['socket'] must be a non-empty string"),
        ({"dtype": "int8"}, "model_loader_extra_config['dtype']: unsupported recipe dtype 'int8'"),
        (
            {"fingerprint_level": "fast"},
            "model_loader_extra_config['fingerprint_level'] must be one of",
        ),
        ({"fallback": "yes"}, "model_loader_extra_config['fallback'] must be true or false"),
        (
            {"wait_timeout": -1},
            "model_loader_extra_config['wait_timeout'] must be a number of seconds >= 0",
        ),
        ({"wait_timeout": True}, "model_loader_extra_config['wait_timeout'] must be a number"),
        (
            {"wait_timeout": float("nan")},
            "model_loader_extra_config['wait_timeout'] must be a number",
        ),
    ],
)
def test_a_bad_value_names_its_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        VllmLoaderConfig.parse(extra)
    assert str(info.value).startswith(message)


def test_a_config_that_is_not_a_dict_is_refused() -> None:
    with pytest.raises(ValueError) as info:
        VllmLoaderConfig.parse(["socket"])  # type: ignore[arg-type]
    assert str(info.value) == (
        "model_loader_extra_config must be a dict for load format weightcache, not list"
    )


def test_the_entry_point_names_the_register_function() -> None:
    from importlib import metadata

    points = [
        p for p in metadata.entry_points(group="vllm.general_plugins") if p.name == "weightcache"
    ]
    assert [p.value for p in points] == ["weightcache.integrations.vllm:register"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_cpu_gemm_auto_is_vllms_repacked_choice_for_every_dtype(dtype: str) -> None:
    """The measured default (``cpu_gemm``'s docstring): oneDNN's packed copies decode
    faster; ``"shared"`` is asked for by name."""
    import torch

    from weightcache.integrations.vllm import cpu_gemm

    assert cpu_gemm.resolve("auto", getattr(torch, dtype)) == "repacked"
    assert cpu_gemm.resolve("shared", getattr(torch, dtype)) == "shared"
    with pytest.raises(ValueError, match="cpu_gemm must be one of"):
        cpu_gemm.resolve("onednn", getattr(torch, dtype))
