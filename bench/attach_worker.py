"""One timed load in a fresh process, for ``attach_vs_disk.py``.

Usage::

    python bench/attach_worker.py {attach,copy,disk,fingerprint} MODEL_DIR --socket S --out F

Writes ``{"seconds", "source", "tensors", "touched"}`` as JSON to ``--out``. What is timed
starts after the imports: the load call, then reading the first byte of every tensor (so a
zero-copy attach pays for one page fault per tensor, not for every byte). For
``fingerprint`` it is ``open_checkpoint`` plus the sampled ``compute_fingerprint``.
Releasing the lease (``close()``) is not timed.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

import weightcache
from weightcache import Placement, Recipe

MODES = ("attach", "copy", "disk", "fingerprint")


def touch(tensors: dict[str, torch.Tensor]) -> int:
    """Sum of the first byte of every tensor: makes each tensor's first page resident."""
    firsts = (t.reshape(-1)[:1].view(torch.uint8) for t in tensors.values() if t.numel())
    return sum(int(first[0]) for first in firsts)


def load_and_touch(mode: str, model_dir: str, socket: str) -> dict[str, object]:
    """Load in ``mode`` and touch; returns the result fields, ``seconds`` included."""
    loaders: dict[str, Callable[[], weightcache.LoadedWeights]] = {
        "attach": lambda: weightcache.load(model_dir, socket=socket, fallback=False),
        "copy": lambda: weightcache.load(model_dir, socket=socket, mode="copy", fallback=False),
        "disk": lambda: weightcache.load_from_disk(model_dir),
    }
    start = time.perf_counter()
    weights = loaders[mode]()
    tensors = weights.tensors
    touched = touch(tensors)
    seconds = time.perf_counter() - start
    weights.close()
    return {
        "seconds": seconds,
        "source": weights.source,
        "tensors": len(tensors),
        "touched": touched,
    }


def fingerprint_only(model_dir: str) -> dict[str, object]:
    """Time ``open_checkpoint`` plus the sampled fingerprint; returns the result fields."""
    start = time.perf_counter()
    checkpoint = weightcache.open_checkpoint(model_dir)
    fp = weightcache.compute_fingerprint(checkpoint, Recipe(), Placement(), "sampled")
    seconds = time.perf_counter() - start
    tensors = len(checkpoint.tensors)
    return {"seconds": seconds, "source": "-", "tensors": tensors, "touched": fp.digest[:12]}


def main() -> None:
    """Parse the arguments, run one timed load, write the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("model_dir")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.mode == "fingerprint":
        result = fingerprint_only(args.model_dir)
    else:
        result = load_and_touch(args.mode, args.model_dir, args.socket)
    with open(args.out, "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
