"""Installing held tensors in a model built on the meta device (the ``vllm`` recipe's
engine side, ``weightcache.integrations.vllm.install``), and the recipe's identity: torch
only, no vLLM (``tests/vllm/`` runs them through vLLM)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from weightcache.core.errors import RecipeError
from weightcache.core.plugins import PluginStep
from weightcache.core.recipe import Placement, Recipe
from weightcache.integrations.vllm.install import InstallError, install, materialize_meta
from weightcache.integrations.vllm.recipe import VllmRecipe, canonical_dtype


class Tagged(nn.Parameter):
    """A parameter class with attributes, as vLLM's ``BasevLLMParameter`` subclasses."""


class Rope(nn.Module):
    """A module with a buffer, shared by two others (as vLLM's rotary embeddings)."""

    cache: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(3))


class Holder(nn.Module):
    def __init__(self, rope: Rope) -> None:
        super().__init__()
        self.rope = rope


class Tiny(nn.Module):
    """An embedding tied to its head, a norm, a buffer shared by two submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.Module()
        self.norm.weight = Tagged(torch.ones(4), requires_grad=False)
        self.norm.weight.output_dim = 0  # type: ignore[attr-defined]
        rope = Rope()
        self.a, self.b = Holder(rope), Holder(rope)


def on_meta() -> Tiny:
    with torch.device("meta"):
        return Tiny()


def held() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.arange(32, dtype=torch.float32).reshape(8, 4),
        "norm.weight": torch.full((4,), 2.0),
        "a.rope.cache": torch.tensor([1.0, 2.0, 3.0]),
    }


def test_every_name_takes_the_held_tensor_itself_and_ties_stay_ties() -> None:
    model, tensors = on_meta(), held()
    done = install(model, tensors)

    assert (done.tensors, done.names, done.left_on_meta) == (3, 5, [])
    assert model.embed.weight.data_ptr() == tensors["embed.weight"].data_ptr()
    assert model.head.weight is model.embed.weight
    assert model.b.rope.cache is model.a.rope.cache
    assert model.a.rope.cache.data_ptr() == tensors["a.rope.cache"].data_ptr()
    assert type(model.norm.weight) is Tagged
    assert model.norm.weight.output_dim == 0  # type: ignore[attr-defined]
    assert not model.norm.weight.requires_grad
    logits = model.head(model.embed(torch.tensor([1])))
    assert torch.equal(logits[0], tensors["embed.weight"] @ tensors["embed.weight"][1])


def test_a_name_the_model_lacks_installs_nothing() -> None:
    model = on_meta()
    tensors = held() | {"lm_head.weight": torch.zeros(8, 4)}
    with pytest.raises(InstallError, match=r"'lm_head\.weight' is not a parameter or buffer"):
        install(model, tensors)
    assert model.embed.weight.is_meta and model.norm.weight.is_meta


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.zeros(8, 5), r"'embed.weight' is \(8, 5\) torch.float32; the model has \(8, 4\)"),
        (
            torch.zeros(8, 4, dtype=torch.bfloat16),
            r"torch.bfloat16; the model has \(8, 4\) torch.float32",
        ),
    ],
)
def test_another_shape_or_dtype_installs_nothing(tensor: torch.Tensor, message: str) -> None:
    model = on_meta()
    with pytest.raises(InstallError, match=message):
        install(model, held() | {"embed.weight": tensor})
    assert model.embed.weight.is_meta


def test_what_the_daemon_did_not_hold_is_materialized_and_named() -> None:
    model, tensors = on_meta(), held()
    del tensors["a.rope.cache"]
    done = install(model, tensors)
    assert done.left_on_meta == ["a.rope.cache", "b.rope.cache"]

    assert materialize_meta(model, torch.device("cpu")) == ["a.rope.cache", "b.rope.cache"]
    assert model.a.rope.cache.device.type == "cpu" and model.b.rope.cache is model.a.rope.cache


def write_config(folder: Path, **fields: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16", **fields}
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def test_the_recipe_resolves_its_parameters_from_the_folder(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "m", quantization_config={"quant_method": "awq"})
    params = dict(VllmRecipe().resolve(folder, Placement(), {}))

    assert params == {
        "architecture": "LlamaForCausalLM",
        "config_sha256": params["config_sha256"],
        "dtype": "bfloat16",
        "quantization": "awq",
        "tp_rank": "0",
        "tp_size": "1",
    }
    assert len(params["config_sha256"]) == 64
    given = dict(
        VllmRecipe().resolve(folder, Placement(), {"dtype": "half", "quantization": "none"})
    )
    assert (given["dtype"], given["quantization"]) == ("float16", "none")


@pytest.mark.parametrize(
    ("params", "placement", "message"),
    [
        ({"dtpye": "bf16"}, Placement(), "unknown parameter"),
        ({"dtype": "int8"}, Placement(), "dtype 'int8' is not one of"),
        ({}, Placement(1, 2), "tp_size 2: tensor parallelism is not built"),
    ],
)
def test_the_recipe_refuses_what_it_cannot_build(
    tmp_path: Path, params: dict[str, str], placement: Placement, message: str
) -> None:
    with pytest.raises(RecipeError, match=message):
        VllmRecipe().resolve(write_config(tmp_path / "m"), placement, params)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_the_recipe_says_where_to_find_it(tmp_path: Path) -> None:
    recipe = Recipe(plugins=(PluginStep("vllm"),))
    with pytest.raises(RecipeError, match=r"vLLM is not installed for .*WEIGHTCACHE_VLLM_PYTHON"):
        recipe.identity(write_config(tmp_path / "m"), Placement())


def test_vllms_dtype_names() -> None:
    assert [canonical_dtype(d) for d in ("bf16", torch.float16, "FLOAT")] == [
        "bfloat16",
        "float16",
        "float32",
    ]
