"""A vLLM engine in a process of its own: load a model, embed or generate, save the result.

The vLLM integration's tests and ``make demo-vllm`` run it in the venv that has vLLM
(``make setup-vllm``), once per engine, so that engines never share a process::

    python -m weightcache.testing.vllm_engine MODEL_DIR --task embed|generate \\
        --load-format weightcache|auto [--extra JSON] [--hf-overrides JSON] --out FILE

vLLM runs in this one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager (no
``torch.compile``: minutes on a small CPU), in float32 (``--dtype``), offline. ``--out`` receives a
``torch.save`` dict:

- ``embed``: ``embeddings``, float32 (len(:data:`SENTENCES`), hidden size);
- ``generate``: ``token_ids``, a list per prompt of :data:`MAX_TOKENS` greedy token ids;
- both: ``load_model_s`` (seconds the engine's model loader spent in ``load_model``: the
  model's build, its weights (attach or disk read, vLLM's weight loaders) and processing),
  ``engine_s`` (seconds to build the whole engine) and ``placement`` (:func:`placement`:
  where the model's tensors lie, after processing).

The loader's log lines (``weightcache: ...``) go to stderr, as vLLM logs.
"""

from __future__ import annotations

import os

# Before vLLM is imported: it reads them at import.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import torch

#: Where the daemon's segments are mapped from (``weightcache.core.sockets.SHM_DIR``).
SEGMENT_DIR = "/dev/shm/weightcache-"
SENTENCES = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "A cheetah is running behind its prey.",
    "Shared memory lets a restarted worker skip reading its weights from disk.",
)
PROMPTS = ("the quick brown fox", "weights in shared memory")
MAX_TOKENS = 12
#: vLLM sizes its KV cache from this share of memory; small, for a shared machine.
MEMORY_UTILIZATION = 0.1
MAX_MODEL_LEN = 128


def _timed_load_model(record: dict[str, float]) -> None:
    """Time ``load_model`` of whichever loader vLLM picks (the outermost call: the
    weightcache loader's fallback calls the default loader's inside its own)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    def wrap(method: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> None:
            if "load_model_s" in record or record.get("depth"):
                return method(*args, **kwargs)
            record["depth"] = 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                record["load_model_s"] = time.perf_counter() - start
                record["depth"] = 0

        return timed

    BaseModelLoader.load_model = wrap(BaseModelLoader.load_model)
    for cls in BaseModelLoader.__subclasses__():
        if "load_model" in vars(cls):
            cls.load_model = wrap(cls.load_model)


def _segments() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of daemon segments (/proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps", encoding="ascii") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith(SEGMENT_DIR):
                begin, end = (int(part, 16) for part in fields[0].split("-"))
                ranges.append((begin, end))
    return ranges


def placement(model: Any) -> dict[str, Any]:
    """Where ``model``'s parameters and buffers lie: ``in_segment`` (names whose bytes are
    inside a mapping of a daemon segment, ``/dev/shm/weightcache-*``), ``elsewhere`` (the
    other names) and the bytes of each, every tensor counted once."""
    ranges = _segments()
    seen: set[int] = set()
    found: dict[str, Any] = {
        "in_segment": [],
        "elsewhere": [],
        "segment_bytes": 0,
        "other_bytes": 0,
    }
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in named:
        if id(tensor) in seen or tensor.numel() == 0:
            continue
        seen.add(id(tensor))
        inside = any(b <= tensor.data_ptr() < e for b, e in ranges)
        found["in_segment" if inside else "elsewhere"].append(name)
        found["segment_bytes" if inside else "other_bytes"] += tensor.nbytes
    return found


def run(
    model: str,
    task: str,
    load_format: str,
    extra: dict[str, Any],
    dtype: str = "float32",
    *,
    hf_overrides: dict[str, Any] | None = None,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """Build the engine (``hf_overrides`` as vLLM's ``--hf-overrides``;
    ``tensor_parallel_size`` ranks, each a worker process), run the task; the dict
    ``--out`` receives (``placement``: rank 0's)."""
    import vllm
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # registers "weightcache" before the loaders are wrapped
    timing: dict[str, float] = {}
    _timed_load_model(timing)
    start = time.perf_counter()
    llm = vllm.LLM(
        model=model,
        runner="pooling" if task == "embed" else "generate",
        load_format=load_format,
        model_loader_extra_config=extra,
        dtype=dtype,
        enforce_eager=True,
        gpu_memory_utilization=MEMORY_UTILIZATION,
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        hf_overrides=hf_overrides or {},
        tensor_parallel_size=tensor_parallel_size,
    )
    result: dict[str, Any] = {"engine_s": time.perf_counter() - start}
    if "load_model_s" in timing:  # not with tensor_parallel_size > 1: ranks are processes
        result["load_model_s"] = timing["load_model_s"]
    result["placement"] = llm.apply_model(placement)[0]
    if task == "embed":
        outputs = llm.embed(list(SENTENCES), use_tqdm=False)
        result["embeddings"] = torch.tensor([o.outputs.embedding for o in outputs])
    else:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(list(PROMPTS), params, use_tqdm=False)
        result["token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
    return result


def main() -> None:
    """Parse the arguments, run, save to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--task", choices=("embed", "generate"), required=True)
    parser.add_argument("--load-format", required=True)
    parser.add_argument("--extra", default="{}", help="model_loader_extra_config, JSON")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hf-overrides", default="{}", help="vLLM's hf_overrides, JSON")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    extra, overrides = json.loads(args.extra), json.loads(args.hf_overrides)
    result = run(
        args.model,
        args.task,
        args.load_format,
        extra,
        args.dtype,
        hf_overrides=overrides,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    torch.save(result, args.out)


if __name__ == "__main__":
    main()
