"""A vLLM engine in a process of its own: load a model, embed or generate, save the result.

The vLLM integration's tests and ``make demo-vllm`` run it in the venv that has vLLM
(``make setup-vllm``), once per engine, so that engines never share a process::

    python -m weightcache.testing.vllm_engine MODEL_DIR --task embed|generate \\
        --load-format weightcache|auto [--extra JSON] --out FILE

vLLM runs in this one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager (no
``torch.compile``: minutes on a small CPU), in float32, offline. ``--out`` receives a
``torch.save`` dict:

- ``embed``: ``embeddings``, float32 (len(:data:`SENTENCES`), hidden size);
- ``generate``: ``token_ids``, a list per prompt of :data:`MAX_TOKENS` greedy token ids;
- both: ``load_weights_s`` (seconds the engine's model loader spent in ``load_weights``:
  attach or disk read, plus vLLM's weight loaders; not the model build or processing) and
  ``engine_s`` (seconds to build the whole engine).

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


def _timed_load_weights(record: dict[str, float]) -> None:
    """Time ``load_weights`` of whichever loader vLLM picks (the outermost call: the
    weightcache loader's fallback calls the default loader's inside its own)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    def wrap(method: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> None:
            if "load_weights_s" in record or record.get("depth"):
                return method(*args, **kwargs)
            record["depth"] = 1
            start = time.perf_counter()
            try:
                method(*args, **kwargs)
            finally:
                record["load_weights_s"] = time.perf_counter() - start
                record["depth"] = 0

        return timed

    for cls in BaseModelLoader.__subclasses__():
        cls.load_weights = wrap(cls.load_weights)


def run(model: str, task: str, load_format: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Build the engine, run the task; the dict ``--out`` receives."""
    import vllm
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # registers "weightcache" before the loaders are wrapped
    timing: dict[str, float] = {}
    _timed_load_weights(timing)
    start = time.perf_counter()
    llm = vllm.LLM(
        model=model,
        runner="pooling" if task == "embed" else "generate",
        load_format=load_format,
        model_loader_extra_config=extra,
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=MEMORY_UTILIZATION,
        max_model_len=MAX_MODEL_LEN,
        seed=0,
    )
    result: dict[str, Any] = {"engine_s": time.perf_counter() - start}
    result["load_weights_s"] = timing["load_weights_s"]
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
    args = parser.parse_args()
    result = run(args.model, args.task, args.load_format, json.loads(args.extra))
    torch.save(result, args.out)


if __name__ == "__main__":
    main()
