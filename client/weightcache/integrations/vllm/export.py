"""The export the ``vllm`` recipe runs: a model as vLLM's worker loads it, by vLLM name.

Run by the daemon (:mod:`.recipe`) in vLLM's environment, one process per model::

    python -m weightcache.integrations.vllm.export MODEL_DIR --out FILE \\
        --dtype bfloat16 --quantization none [--hf-overrides JSON]

It builds the engine's configuration with vLLM's ``EngineArgs`` (``load_format="auto"``,
eager, the step's ``hf_overrides`` applied over ``config.json`` as an engine's
``--hf-overrides`` are), starts a one-process distributed group (gloo on loopback, as
vLLM's CPU worker),
builds the model on the CPU with vLLM's ``DefaultModelLoader.create_model``, runs its
``load_weights`` (vLLM's weight loaders: q/k/v and gate/up fused, tied weights tied) and
writes :func:`named_tensors` to ``FILE`` as safetensors, loaded but not processed
(``process_weights_after_loading`` runs in each engine: on CPU it repacks into engine
private oneDNN handles for some dtypes, and it is safe for every quantization method).
It prints one JSON line: ``{"tensors": N, "bytes": B, "aliases": {...}}``.

vLLM's own weight-cache daemon exports the same names
(``vllm/model_executor/model_loader/weight_cache/daemon.py``, ``export_entries``).
"""

from __future__ import annotations

import os

# Before vLLM is imported: it reads them at import.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def named_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every parameter and buffer of ``model`` by name, each tensor once.

    ``named_parameters(remove_duplicate=False)`` then ``named_buffers(...)``: buffers
    include the non-persistent ones a ``state_dict`` omits (rotary caches). A tensor
    reachable under several names (tied weights) is kept under its first name; the others
    are returned as aliases (alias -> first name). An engine finds the same ties in its
    own model, built the same way, so the aliases are informative.

    Returns:
        (name -> contiguous tensor, alias -> name).
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if name in tensors or name in aliases:
            continue
        seen = first.get(id(tensor))
        if seen is not None:
            aliases[name] = seen
            continue
        first[id(tensor)] = name
        tensors[name] = tensor.detach().contiguous()
    return tensors, aliases


def engine_config(
    model: str,
    dtype: str,
    quantization: str,
    load_format: str = "auto",
    extra: dict[str, Any] | None = None,
    *,
    hf_overrides: dict[str, Any] | None = None,
    max_model_len: int | None = None,
) -> VllmConfig:
    """The configuration vLLM's ``EngineArgs`` make for ``model`` (eager), with this
    process's one-process distributed group started (gloo on loopback, as vLLM's CPU
    worker): what loading a model as a worker does needs both."""
    from vllm.distributed import init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.network_utils import get_distributed_init_method, get_open_port

    args = EngineArgs(
        model=model,
        dtype=dtype,
        quantization=None if quantization == "none" else quantization,
        load_format=load_format,
        model_loader_extra_config=extra or {},
        hf_overrides=hf_overrides or {},
        max_model_len=max_model_len,  # None: vLLM's, derived from the config
        enforce_eager=True,
        seed=0,
    )
    config = args.create_engine_config()
    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=get_distributed_init_method("127.0.0.1", get_open_port()),
        local_rank=0,
        backend="gloo",
    )
    return config


def load_model(
    model: str,
    dtype: str,
    quantization: str,
    hf_overrides: dict[str, Any] | None = None,
    max_model_len: int | None = None,
) -> nn.Module:
    """The model as vLLM's worker builds and loads it, before processing."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config = engine_config(
        model, dtype, quantization, hf_overrides=hf_overrides, max_model_len=max_model_len
    )
    model_config = vllm_config.model_config
    with set_current_vllm_config(vllm_config):
        ensure_model_parallel_initialized(1, 1)
        loader = DefaultModelLoader(vllm_config.load_config)
        with set_default_torch_dtype(model_config.dtype):
            with torch.device("cpu"):
                built = loader.create_model(vllm_config, model_config)
            loader.load_weights(built, model_config)
    return cast(nn.Module, built)


def export(
    model: str,
    out: str,
    dtype: str,
    quantization: str,
    *,
    hf_overrides: dict[str, Any] | None = None,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """Load ``model`` as vLLM does (``hf_overrides`` over its ``config.json``;
    ``max_model_len``: vLLM's default when None) and write its tensors to ``out``; the
    summary printed."""
    from safetensors.torch import save_file

    built = load_model(model, dtype, quantization, hf_overrides, max_model_len)
    tensors, aliases = named_tensors(built)
    save_file(tensors, out, metadata={"format": "pt", "vllm_aliases": json.dumps(aliases)})
    return {
        "tensors": len(tensors),
        "bytes": sum(t.nbytes for t in tensors.values()),
        "aliases": aliases,
    }


def main() -> None:
    """Parse the arguments, export, print the summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--hf-overrides", default="{}", help="a JSON object, as vLLM's")
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args()
    overrides = json.loads(args.hf_overrides)
    summary = export(
        args.model,
        args.out,
        args.dtype,
        args.quantization,
        hf_overrides=overrides,
        max_model_len=args.max_model_len,
    )
    print(json.dumps(summary), file=sys.stdout, flush=True)


if __name__ == "__main__":
    main()
