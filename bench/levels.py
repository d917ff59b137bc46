"""Benchmark: attach at the default fingerprint level (``full``) against ``sampled``.

Usage::

    .venv/bin/python bench/levels.py [--size-gib 0.25] [--tensors 1000] [--repeat 5]

1. generates a checkpoint as ``attach_vs_disk.py`` does, and a copy of it in another folder
   (the same bytes in other files: other inodes);
2. starts two daemons holding the checkpoint, one at ``--fingerprint-level sampled``, one
   at the default (``full``);
3. runs, interleaved, each in a fresh worker process (``attach_worker.py attach``), a
   zero-copy attach plus the first byte of every tensor:

   - ``own sampled`` / ``own full``: the daemon's own files, at each level: the worker
     is matched by file identity and reads none of them, whatever the level;
   - ``copy sampled``: the copy, at ``sampled``: the worker reads the headers and 3 x 64
     bytes per tensor, then attaches by fingerprint;
   - ``copy full``: the copy, at ``full``, with the worker's hash cache warm (the copy
     was hashed once, before the runs): headers plus one cache lookup per shard;
   - ``copy full cold``: the same with an empty hash cache for every run: the worker
     hashes every byte of the copy (what a first load of a copied checkpoint costs);

4. prints median, min and max per row and the ``own sampled`` median over each median;
5. stops both daemons and checks they left nothing behind.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path

from attach_vs_disk import (
    BenchError,
    generate,
    new_checkpoint,
    preloaded,
    print_header,
    print_table,
    run_script,
    run_worker,
)

#: row -> (which folder, level, hash cache: "warm", "cold" or "-")
ROWS = {
    "own sampled": ("own", "sampled", "-"),
    "own full": ("own", "full", "-"),
    "copy sampled": ("copy", "sampled", "-"),
    "copy full": ("copy", "full", "warm"),
    "copy full cold": ("copy", "full", "cold"),
}
TIMED = {
    "own sampled": "load(own files, level sampled): matched by file identity",
    "own full": "load(own files, level full): matched by file identity",
    "copy sampled": "load(copy, level sampled): headers + samples, then by fingerprint",
    "copy full": "load(copy, level full): headers + cached file digests, by fingerprint",
    "copy full cold": "load(copy, level full), empty hash cache: hashes every byte",
}


def measure(
    folders: dict[str, Path],
    sockets: dict[str, str],
    tmp: Path,
    args: argparse.Namespace,
    count: int,
) -> dict[str, list[float]]:
    """Every row ``--repeat`` times, interleaved; returns seconds per row.

    Raises:
        BenchError: a worker failed, or did not attach with ``count`` tensors.
    """
    warm = tmp / "hash-warm"
    seconds: dict[str, list[float]] = {row: [] for row in ROWS}
    for run in range(args.repeat):
        for row, (which, level, cache) in ROWS.items():
            hashes = warm if cache != "cold" else tmp / f"hash-cold-{run}"
            os.environ["WEIGHTCACHE_HASH_CACHE"] = str(hashes)
            result = run_worker(
                "attach", folders[which], sockets[level], tmp / "r.json", ["--level", level]
            )
            if result["source"] != "cache" or result["tensors"] != count:
                raise BenchError(f"{row}: expected {count} tensors from the cache: {result}")
            seconds[row].append(result["seconds"])
    return seconds


def run_bench(args: argparse.Namespace, tmp: Path) -> bool:
    """Steps 1-5 in ``tmp``; True when every run attached."""
    folder, specs = new_checkpoint(tmp, args.tensors, int(args.size_gib * 2**30), args.seed)
    print_header(
        "weightcache benchmark: attach at fingerprint level full vs sampled",
        specs,
        args.shards,
        folder,
        "GiB",
    )
    generate(folder, specs, args)
    copy = tmp / "copy"
    shutil.copytree(folder, copy)
    os.environ["WEIGHTCACHE_HASH_CACHE"] = str(tmp / "hash-warm")
    with ExitStack() as stack:
        sockets = {}
        for level in ("sampled", "full"):
            log_dir = tmp / f"daemon-{level}"
            log_dir.mkdir()
            daemon = stack.enter_context(
                preloaded(folder, log_dir, args=["--fingerprint-level", level], timeout=900)
            )
            sockets[level] = daemon.socket
        # Warm the worker's cache for the copy at full (one load, not timed).
        run_worker("attach", copy, sockets["full"], tmp / "r.json", ["--level", "full"])
        print()
        seconds = measure({"own": folder, "copy": copy}, sockets, tmp, args, len(specs))
    print()
    note = ("  timed, in each worker after its imports, + first byte of every tensor:",)
    print_table(seconds, TIMED, 16, note, "own sampled")
    return True


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=0.25, help="checkpoint size, GiB")
    parser.add_argument("--tensors", type=int, default=1000, help="number of tensors")
    parser.add_argument("--shards", type=int, default=4, help="number of shard files")
    parser.add_argument("--repeat", type=int, default=5, help="runs per row")
    parser.add_argument("--seed", type=int, default=0, help="seed of shapes and values")
    return parser.parse_args()


def main() -> int:
    """Run the benchmark; exit status 0 when it completed."""
    args = parse_args()
    ok = run_script("wclevels-", lambda tmp: run_bench(args, tmp), (BenchError,))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
