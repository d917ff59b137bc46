"""Benchmark: the time to compute a checkpoint's fingerprint, ``sampled`` against ``full``.

    .venv/bin/python bench/fingerprint.py [--size-gib 4] [--tensors 300] [--shards 4]

1. checks that the temporary folder's file system has room (size plus 10% plus 1 GiB),
   then writes there a sharded safetensors checkpoint of ``--size-gib`` GiB in
   ``--tensors`` BF16/F16/F32 tensors, ``--shards`` files plus the index (bytes from a
   random 64 MiB pattern, streamed: memory stays small);
2. measures, each in a fresh process (``python bench/fingerprint.py --measure ...``), the
   time of ``open_checkpoint`` + ``compute_fingerprint``:
   ``sampled`` (``--repeat`` times), ``full`` with an empty hash cache (``cold``, once),
   ``full`` again with the cache the cold run filled (``cached``, ``--repeat`` times);
   each process also reports how many files it actually hashed;
3. prints the figures and each median divided by the ``sampled`` median of this run;
4. removes the checkpoint and the hash cache (also on failure or Ctrl-C).

The files were just written, so the page cache is warm: ``full`` cold measures sha256
over memory, the best case; a cold disk adds its read time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightcache.core.fingerprint import Level

GIB = 1 << 30
PATTERN_BYTES = 64 << 20
CHUNK = 8 << 20
DTYPES = {"BF16": 2, "F16": 2, "F32": 4}
COLUMNS = (1024, 2048, 4096)
#: Seconds one measurement process may take.
MEASURE_TIMEOUT = 900.0


class BenchError(RuntimeError):
    """A step failed; the message says which and why."""


# -- the checkpoint ---------------------------------------------------------------------


def plan(tensors: int, total: int, shards: int, seed: int) -> list[list[tuple[str, str, int, int]]]:
    """``tensors`` matrices ``(name, dtype, rows, cols)`` of about ``total`` bytes together,
    split into ``shards`` groups of similar size."""
    rng = random.Random(seed)
    drafts = [
        (rng.choice(list(DTYPES)), rng.choice(COLUMNS), rng.uniform(0.5, 1.5))
        for _ in range(tensors)
    ]
    per_weight = total / sum(w for _, _, w in drafts)
    specs = []
    for i, (dtype, cols, weight) in enumerate(drafts):
        rows = max(1, round(per_weight * weight / (cols * DTYPES[dtype])))
        specs.append((f"layers.{i // 7}.w{i % 7}.weight", dtype, rows, cols))
    size = sum(r * c * DTYPES[d] for _, d, r, c in specs)
    groups: list[list[tuple[str, str, int, int]]] = [[] for _ in range(shards)]
    done = 0
    for spec in specs:
        groups[min(shards - 1, done * shards // size)].append(spec)
        done += spec[2] * spec[3] * DTYPES[spec[1]]
    return groups


def write_shard(path: Path, specs: list[tuple[str, str, int, int]], pattern: bytes) -> int:
    """Write one safetensors file (header padded to 8 bytes, as safetensors does), its
    data streamed from ``pattern`` at a different offset per tensor; returns its size."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, rows, cols in specs:
        nbytes = rows * cols * DTYPES[dtype]
        header[name] = {
            "dtype": dtype,
            "shape": [rows, cols],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        start = 0
        for name, dtype, rows, cols in specs:
            left = rows * cols * DTYPES[dtype]
            start = (start + 4099 * len(name)) % PATTERN_BYTES
            while left:
                n = min(left, CHUNK, PATTERN_BYTES - start)
                fh.write(pattern[start : start + n])
                left -= n
                start = (start + n) % PATTERN_BYTES
    return path.stat().st_size


def write_checkpoint(folder: Path, tensors: int, total: int, shards: int) -> tuple[int, int]:
    """Write the checkpoint; returns (tensor count, bytes on disk)."""
    groups = plan(tensors, total, shards, seed=0)
    pattern = random.Random(1).randbytes(PATTERN_BYTES)
    weight_map = {}
    size = 0
    for number, group in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{shards:05d}.safetensors"
        size += write_shard(folder / name, group, pattern)
        weight_map.update({spec[0]: name for spec in group})
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return len(weight_map), size


# -- one measurement, in its own process ---------------------------------------------


def measure_here(level: Level, model_dir: str) -> dict[str, Any]:
    """Time open_checkpoint + compute_fingerprint at ``level`` (imports not included);
    count the files actually hashed."""
    import weightcache
    from weightcache.core import hashcache

    hashed: list[str] = []
    real_hash = hashcache._hash

    def counting(fd: int, path: Path, stop: threading.Event | None = None) -> str:
        hashed.append(os.path.basename(path))
        digest: str = real_hash(fd, path, stop)
        return digest

    hashcache._hash = counting
    # Resolve the lazy attributes (and import torch) before the clock starts.
    open_checkpoint, compute = weightcache.open_checkpoint, weightcache.compute_fingerprint
    recipe, placement = weightcache.Recipe(), weightcache.Placement()
    start = time.perf_counter()
    checkpoint = open_checkpoint(model_dir)
    fp = compute(checkpoint, recipe, placement, level)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "digest": fp.digest, "hashed": len(hashed)}


def run_measure(level: str, model: Path, hash_cache: Path) -> dict[str, Any]:
    """:func:`measure_here` in a fresh interpreter with ``$WEIGHTCACHE_HASH_CACHE`` set."""
    env = {**os.environ, "WEIGHTCACHE_HASH_CACHE": str(hash_cache), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--measure", level, str(model)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=MEASURE_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"{level}: ran over {MEASURE_TIMEOUT:.0f} s") from None
    if done.returncode != 0:
        raise BenchError(f"{level}: exited {done.returncode}:\n{done.stdout}{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# -- the report -----------------------------------------------------------------------


def fmt(seconds: float) -> str:
    return f"{seconds * 1000:7.1f} ms" if seconds < 1 else f"{seconds:7.2f} s "


def check_space(folder: Path, needed: int) -> int:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise BenchError(
            f"{folder}: {free / GIB:.1f} GiB free, {needed / GIB:.1f} GiB needed; "
            "use --size-gib or TMPDIR"
        )
    return free


def bench(args: argparse.Namespace) -> None:
    total = int(args.size_gib * GIB)
    base = Path(tempfile.gettempdir())
    free = check_space(base, int(total * 1.1) + GIB)
    tmp = Path(tempfile.mkdtemp(prefix="wcfpbench-", dir=base))
    try:
        model, cache = tmp / "checkpoint", tmp / "hash-cache"
        model.mkdir()
        print("weightcache benchmark: fingerprint time, sampled vs full (cold and cached)")
        print(
            f"  machine: {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
            f"python {platform.python_version()}, torch {metadata.version('torch')}"
        )
        print(f"  {base}: {free / GIB:.1f} GiB free before")
        start = time.monotonic()
        count, size = write_checkpoint(model, args.tensors, total, args.shards)
        print(
            f"  checkpoint: {size / GIB:.2f} GiB, {count} tensors (BF16/F16/F32), "
            f"{args.shards} shards + index, in {model}"
        )
        print(f"  written in {time.monotonic() - start:.1f} s; page cache warm (just written)")
        print(
            f"  runs: each in a fresh process; sampled x{args.repeat}, full cold x1, "
            f"full cached x{args.repeat}"
        )
        print()
        runs: dict[str, list[dict[str, Any]]] = {"sampled": [], "full cold": [], "full cached": []}
        for _ in range(args.repeat):
            runs["sampled"].append(run_measure("sampled", model, cache))
        runs["full cold"].append(run_measure("full", model, cache))
        for _ in range(args.repeat):
            runs["full cached"].append(run_measure("full", model, cache))

        digests = {r["digest"] for r in runs["full cold"] + runs["full cached"]}
        if len(digests) != 1:
            raise BenchError(f"full digests differ between runs: {digests}")
        entries = sorted(p.name for p in cache.iterdir())
        sampled = statistics.median(r["seconds"] for r in runs["sampled"])
        print(f"  {'level':<13}{'median':>10}{'min':>11}{'files hashed':>14}{'/ sampled':>12}")
        for label, results in runs.items():
            times = [r["seconds"] for r in results]
            hashed = "/".join(str(r["hashed"]) for r in results)
            median = statistics.median(times)
            print(
                f"  {label:<13}{fmt(median):>10} {fmt(min(times)):>10}{hashed:>14}"
                f"{median / sampled:>11.1f}x"
            )
        cold = runs["full cold"][0]["seconds"]
        print()
        print(f"  full cold hashed {size / GIB:.2f} GiB at {size / GIB / cold:.2f} GiB/s")
        print(f"  hash cache after the cold run: {len(entries)} entries (one per shard)")
        if any(r["hashed"] for r in runs["full cached"]):
            raise BenchError("a cached full run hashed files again")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"  removed {tmp}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=4.0)
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--measure", nargs=2, metavar=("LEVEL", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure_here(*args.measure)))
        return
    try:
        bench(args)
    except BenchError as err:
        print(f"FAILED: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
