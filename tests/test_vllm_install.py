"""Installing held tensors in a model built on the meta device (the ``vllm`` recipe's
engine side, ``weightcache.integrations.vllm.install``), and the recipe's identity: torch
only, no vLLM (``tests/vllm/`` runs them through vLLM)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from weightcache.core.errors import RecipeError
from weightcache.core.plugins import PluginStep
from weightcache.core.recipe import Placement, Recipe
from weightcache.integrations.vllm.install import InstallError, install
from weightcache.integrations.vllm.recipe import (
    VllmRecipe,
    canonical_dtype,
    canonical_overrides,
    differing_fields,
    transformers_version,
)


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

    assert (done.tensors, done.names) == (3, 5)
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


@pytest.mark.parametrize(
    ("left_out", "named"),
    [
        ("a.rope.cache", "2 parameter(s) or buffer(s) of the model: a.rope.cache, b.rope.cache"),
        ("norm.weight", "1 parameter(s) or buffer(s) of the model: norm.weight"),
    ],
)
def test_a_tensor_the_daemon_did_not_hold_installs_nothing_and_is_named(
    left_out: str, named: str
) -> None:
    model, tensors = on_meta(), held()
    del tensors[left_out]
    with pytest.raises(InstallError, match=re.escape(named) + "$") as caught:
        install(model, tensors)

    assert caught.value.reason == "INSTALL_FAILED"
    # Nothing installed, and nothing given memory without a value.
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_what_the_constructor_made_off_meta_keeps_vllms_value() -> None:
    model, tensors = on_meta(), held()
    del tensors["a.rope.cache"]
    computed = torch.tensor([4.0, 5.0, 6.0])
    model.a.rope.cache = computed  # as a constructor that names its device makes it
    install(model, tensors)
    # One module shared by a and b: both names keep the constructor's tensor.
    assert model.a.rope.cache is computed and model.b.rope.cache is computed
    norm = dict(model.named_parameters())["norm.weight"]
    assert norm.data_ptr() == tensors["norm.weight"].data_ptr()


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
        "hf_overrides": "{}",
        "quantization": "awq",
        "tp_rank": "0",
        "tp_size": "1",
        "transformers": transformers_version(),
    }
    assert len(params["config_sha256"]) == 64
    given = dict(
        VllmRecipe().resolve(folder, Placement(), {"dtype": "half", "quantization": "none"})
    )
    assert (given["dtype"], given["quantization"]) == ("float16", "none")


def test_the_overrides_enter_the_identity_as_one_canonical_json_object(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "m")
    given = '{"rope_scaling":{"type":"linear","factor":2.0}, "rope_theta": 1000000.0}'
    params = dict(VllmRecipe().resolve(folder, Placement(), {"hf_overrides": given}))

    expected = '{"rope_scaling":{"factor":2.0,"type":"linear"},"rope_theta":1000000.0}'
    assert params["hf_overrides"] == expected
    # What an engine's ModelConfig.hf_overrides holds gives the same text.
    engine = {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert canonical_overrides(engine) == expected
    assert canonical_overrides({}) == canonical_overrides(None) == "{}"
    # An int is not the float it equals: vLLM's config would hold either as given.
    assert canonical_overrides('{"rope_theta": 1000000}') != canonical_overrides(engine)


LONGROPE = {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}


@pytest.mark.parametrize(
    ("fields", "params", "long_rope"),
    [
        # Another rope: vLLM derives no held tensor from max_model_len; it is dropped.
        ({}, {"max_model_len": "8192"}, None),
        ({"rope_scaling": LONGROPE}, {}, "false"),
        ({"rope_scaling": LONGROPE}, {"max_model_len": "4096"}, "false"),
        ({"rope_scaling": LONGROPE}, {"max_model_len": "4097"}, "true"),
        # The rope type from the engine's overrides, over config.json's.
        (
            {},
            {"hf_overrides": json.dumps({"rope_scaling": LONGROPE}), "max_model_len": "9000"},
            "true",
        ),
        (
            {"rope_scaling": LONGROPE},
            {"hf_overrides": '{"rope_scaling": {"type": "default"}}', "max_model_len": "9000"},
            None,
        ),
    ],
)
def test_max_model_len_enters_the_identity_only_where_a_buffer_depends_on_it(
    tmp_path: Path, fields: dict[str, object], params: dict[str, str], long_rope: str | None
) -> None:
    limits = {"original_max_position_embeddings": 4096, "max_position_embeddings": 131072}
    folder = write_config(tmp_path / "m", **limits, **fields)
    resolved = dict(VllmRecipe().resolve(folder, Placement(), params))

    assert "max_model_len" not in resolved
    assert resolved.get("long_rope") == long_rope


@pytest.mark.parametrize(
    ("fields", "params", "message"),
    [
        ({"rope_scaling": LONGROPE}, {"max_model_len": "x"}, "max_model_len 'x' is not an integer"),
        ({"rope_scaling": {"rope_type": "longrope"}}, {}, "without an integer original_max"),
    ],
)
def test_a_longrope_identity_needs_its_lengths(
    tmp_path: Path, fields: dict[str, object], params: dict[str, str], message: str
) -> None:
    extra = {} if "original" in message else {"original_max_position_embeddings": 4096}
    folder = write_config(tmp_path / "m", **extra, **fields)
    with pytest.raises(RecipeError, match=message):
        VllmRecipe().resolve(folder, Placement(), params)


@pytest.mark.parametrize("value", ["[1, 2]", "rope_theta=5", '{"a": NaN}'])
def test_overrides_that_are_not_a_json_object_are_refused(value: str) -> None:
    with pytest.raises(RecipeError, match=r"hf_overrides .* is not a JSON object"):
        canonical_overrides(value)


def test_a_function_as_overrides_has_no_identity() -> None:
    with pytest.raises(RecipeError, match="is not a JSON object"):
        canonical_overrides(lambda config: config)


def test_the_differing_fields_name_each_override_by_key() -> None:
    held = {"dtype": "float32", "hf_overrides": '{"rope_theta":20000.0,"x":1}', "tp_size": "1"}
    asked = {"dtype": "bfloat16", "hf_overrides": '{"rope_scaling":{},"x":1}', "tp_size": "1"}

    assert differing_fields(asked, held, "2+vllm-0.32.0", "2+vllm-0.32.0") == [
        "dtype",
        "hf_overrides.rope_scaling",
        "hf_overrides.rope_theta",
    ]
    assert differing_fields(held, held, "2+vllm-0.32.0", "2+vllm-0.31.0") == ["version"]
    # A daemon's value that is no JSON object is named whole.
    odd = held | {"hf_overrides": "[1]"}
    assert differing_fields(asked, odd, "2", "2") == ["dtype", "hf_overrides"]


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
