"""What the ``vllm`` recipe's identity covers, and what an engine does with a held model
that is not the one it would build (issue 36).

- An engine's ``hf_overrides`` (here ``rope_scaling``, which decides the rotary
  ``cos_sin_cache`` the daemon holds) are part of the identity: an engine whose overrides
  differ from the daemon's export gets ``FINGERPRINT_MISMATCH`` naming the override and
  serves the default loader's tokens; the same overrides on both sides attach.
- A held model that lacks a parameter or buffer of the engine's model is never completed
  with uninitialized memory: the engine falls back (tokens equal the default loader's), or
  with ``"fallback": false`` fails naming the tensors.

Real daemons (each runs vLLM's export at preload), each engine in a process of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import weightcache
from tests.vllm.support import (
    EngineRun,
    export_dropping,
    installed,
    recording_python,
    run_engine,
    run_engine_failing,
    skipped_reasons,
)
from weightcache.core.errors import FingerprintMismatchError
from weightcache.core.plugins import PluginStep
from weightcache.core.recipe import Recipe
from weightcache.testing import Daemon, DaemonPool
from weightcache.testing.daemon import list_models

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

WEIGHTCACHE = "weightcache"
#: The export runs vLLM at preload: its imports alone take tens of seconds on a busy CPU.
EXPORT_READY = 900.0
#: An override that keeps every shape (the rotary cache stays max_position_embeddings long)
#: and changes the rotary cache's values and the tiny Llama's tokens: Llama 3's frequency
#: scaling. (A top-level ``rope_theta`` changes neither with transformers 5, which reads
#: ``rope_parameters``; it is a mismatch all the same.)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
ROPE = {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 16}}
ROPE_TEXT = (
    '{"rope_scaling":{"factor":8.0,"high_freq_factor":4.0,"low_freq_factor":1.0,'
    '"original_max_position_embeddings":16,"rope_type":"llama3"}}'
)
CACHE = "model.layers.0.self_attn.rotary_emb.cos_sin_cache"
#: What the daemon drops from its export: a parameter, and the rotary buffer (one tensor
#: shared by every layer's attention, exported under its first name).
DROPPED = ["model.norm.weight", "model.layers.0.self_attn.rotary_emb.cos_sin_cache"]


def vllm_step(overrides: dict[str, Any] | None = None) -> list[str]:
    """``--recipe`` for float32 engines, with ``hf_overrides`` as an operator writes them."""
    step = "vllm:dtype=float32"
    if overrides:
        step += f",hf_overrides={json.dumps(overrides)}"
    return ["--recipe", step]


@pytest.fixture(scope="module")
def plain(module_daemons: DaemonPool, llama: Path) -> Daemon:
    """A daemon holding the tiny Llama as vLLM builds it from its config.json alone."""
    daemon = module_daemons.start([llama], args=vllm_step(), wait=False)
    daemon.wait_ready(EXPORT_READY, models=1)
    return daemon


@pytest.fixture(scope="module")
def llama_rope_default(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineRun:
    """The tiny Llama's greedy tokens from vLLM's default loader, with :data:`ROPE`."""
    out = tmp_path_factory.mktemp("rope-default") / "out.pt"
    return run_engine(llama, "generate", "auto", out, hf_overrides=ROPE)


def test_an_engines_override_is_a_mismatch_naming_it_and_it_serves_the_default_loaders_tokens(
    plain: Daemon,
    llama: Path,
    llama_default: EngineRun,
    llama_rope_default: EngineRun,
    tmp_path: Path,
) -> None:
    run = run_engine(
        llama,
        "generate",
        WEIGHTCACHE,
        tmp_path / "out.pt",
        {"socket": plain.socket},
        hf_overrides=ROPE,
    )

    assert skipped_reasons(run) == ["FINGERPRINT_MISMATCH"], run.log[-4000:]
    assert "the daemon's vllm step differs in hf_overrides.rope_scaling" in run.log
    assert not installed(run)
    assert run.result["token_ids"] == llama_rope_default.result["token_ids"]
    # The override changes the tokens: the held rotary cache would have served others.
    assert llama_rope_default.result["token_ids"] != llama_default.result["token_ids"]


def test_a_mismatch_is_found_without_running_the_export(
    plain: Daemon, llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python, runs = recording_python(tmp_path / "python")
    monkeypatch.setenv("WEIGHTCACHE_VLLM_PYTHON", str(python))
    step = PluginStep("vllm", (("dtype", "float32"), ("hf_overrides", ROPE_TEXT)))
    with pytest.raises(FingerprintMismatchError) as caught:
        weightcache.load(llama, socket=plain.socket, recipe=Recipe(plugins=(step,)), fallback=False)

    assert caught.value.components == ["recipe"]
    # vLLM's Python was asked for its versions (the identity), and never ran the export.
    ran = [json.loads(line) for line in runs.read_text(encoding="utf-8").splitlines()]
    assert [args[0] for args in ran] == ["-c"]


def test_the_same_overrides_on_both_sides_attach(
    module_daemons: DaemonPool,
    plain: Daemon,
    llama: Path,
    llama_rope_default: EngineRun,
    tmp_path: Path,
) -> None:
    daemon = module_daemons.start([llama], args=vllm_step(ROPE), wait=False)
    daemon.wait_ready(EXPORT_READY, models=1)
    (model,) = list_models(daemon.socket)
    assert dict(model.recipe.plugins[0].params)["hf_overrides"] == ROPE_TEXT
    # The held rotary caches differ: the identity keeps one from serving the other.
    caches = []
    for socket, params in ((plain.socket, {}), (daemon.socket, {"hf_overrides": ROPE_TEXT})):
        step = PluginStep("vllm", tuple(sorted({"dtype": "float32", **params}.items())))
        with weightcache.load(llama, socket=socket, recipe=Recipe(plugins=(step,))) as weights:
            assert weights.source == "cache"
            caches.append(weights.tensors[CACHE].clone())
    assert caches[0].shape == caches[1].shape and not torch.equal(caches[0], caches[1])

    extra = {"socket": daemon.socket}
    run = run_engine(llama, "generate", WEIGHTCACHE, tmp_path / "out.pt", extra, hf_overrides=ROPE)

    assert installed(run), run.log[-4000:]
    assert skipped_reasons(run) == []
    assert run.result["token_ids"] == llama_rope_default.result["token_ids"]


@pytest.fixture(scope="module")
def lacking(
    module_daemons: DaemonPool, llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Daemon:
    """A daemon whose vLLM-named Llama lacks :data:`DROPPED`."""
    python = export_dropping(tmp_path_factory.mktemp("export-dropping"), DROPPED)
    env = {"WEIGHTCACHE_VLLM_PYTHON": str(python)}
    daemon = module_daemons.start([llama], args=vllm_step(), wait=False, env=env)
    daemon.wait_ready(EXPORT_READY, models=1)
    return daemon


def test_a_held_model_lacking_tensors_falls_back_to_the_default_loaders_tokens(
    lacking: Daemon, llama: Path, llama_default: EngineRun, tmp_path: Path
) -> None:
    run = run_engine(
        llama, "generate", WEIGHTCACHE, tmp_path / "out.pt", {"socket": lacking.socket}
    )

    assert skipped_reasons(run) == ["INSTALL_FAILED"], run.log[-4000:]
    (line,) = [line for line in run.log.splitlines() if "reason=INSTALL_FAILED" in line]
    assert "the daemon holds no tensor for" in line
    assert all(name in line for name in DROPPED), line
    assert "uninitialized" not in run.log
    assert not installed(run)
    # The checkpoint-tensor path finds no such model in the daemon (it holds vLLM's
    # names), so vLLM's default loader reads the files.
    assert run.fallback_reasons() == ["FINGERPRINT_MISMATCH"]
    assert run.result["token_ids"] == llama_default.result["token_ids"]


def test_without_fallback_a_held_model_lacking_tensors_fails_naming_them(
    lacking: Daemon, llama: Path, tmp_path: Path
) -> None:
    extra = {"socket": lacking.socket, "fallback": False}
    code, log = run_engine_failing(llama, "generate", WEIGHTCACHE, tmp_path / "out.pt", extra)

    assert code != 0
    assert "InstallError" in log and "model.norm.weight" in log, log[-4000:]
    assert "model.layers.0.self_attn.rotary_emb.cos_sin_cache" in log
