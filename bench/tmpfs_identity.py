"""Benchmark: what refusing identity on tmpfs costs an attach (issue 36).

Usage::

    .venv/bin/python bench/tmpfs_identity.py [--size-gib 0.25] [--tensors 1000] [--repeat 5]

On tmpfs a write through a shared mapping moves no stamp, so a file's identity never
vouches for its bytes there (``core.timestamps.stamps_every_write``): an Acquire by file
identity is refused, the hash cache is not used, and a worker at the default level
(``full``) hashes every byte before it attaches by fingerprint.

1. generates a checkpoint as ``attach_vs_disk.py`` does, in a folder under /tmp, and a copy
   of it in a folder of its own under /dev/shm (a tmpfs), removed at the end;
2. starts two daemons at the default level, one holding each;
3. runs, interleaved, each in a fresh worker process (``attach_worker.py attach``), a
   zero-copy attach plus the first byte of every tensor:

   - ``disk identity``: the daemon's own files on the disk's file system: matched by
     file identity, no byte of them read (what tmpfs got before issue 36);
   - ``tmpfs full``: the daemon's own files on tmpfs: the identity probe is refused, the
     worker hashes every byte (sha256), then attaches by fingerprint;
   - ``tmpfs sampled``: the same at ``--fingerprint-level sampled`` (a third daemon):
     headers plus 3 x 64 bytes per tensor;

4. prints median, min and max per row and the ``disk identity`` median over each median;
5. stops the daemons, checks they left nothing behind, removes the tmpfs folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
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

#: row -> (which folder, level)
ROWS = {
    "disk identity": ("disk", "full"),
    "tmpfs full": ("tmpfs", "full"),
    "tmpfs sampled": ("tmpfs", "sampled"),
}
TIMED = {
    "disk identity": "load(daemon's files on ext4, full): matched by file identity",
    "tmpfs full": "load(daemon's files on tmpfs, full): probe refused, hashes every byte",
    "tmpfs sampled": "load(daemon's files on tmpfs, sampled): headers + samples",
}
SHM = Path("/dev/shm")


def measure(
    folders: dict[str, Path],
    sockets: dict[tuple[str, str], str],
    tmp: Path,
    args: argparse.Namespace,
    count: int,
) -> dict[str, list[float]]:
    """Every row ``--repeat`` times, interleaved; returns seconds per row.

    Raises:
        BenchError: a worker failed, or did not attach with ``count`` tensors.
    """
    seconds: dict[str, list[float]] = {row: [] for row in ROWS}
    for _ in range(args.repeat):
        for row, (which, level) in ROWS.items():
            result = run_worker(
                "attach",
                folders[which],
                sockets[which, level],
                tmp / "r.json",
                ["--level", level],
            )
            if result["source"] != "cache" or result["tensors"] != count:
                raise BenchError(f"{row}: expected {count} tensors from the cache: {result}")
            seconds[row].append(result["seconds"])
    return seconds


def run_bench(args: argparse.Namespace, tmp: Path) -> bool:
    """Steps 1-5 in ``tmp``; True when every run attached."""
    folder, specs = new_checkpoint(tmp, args.tensors, int(args.size_gib * 2**30), args.seed)
    print_header(
        "weightcache benchmark: attach of a checkpoint on tmpfs (identity never vouches)",
        specs,
        args.shards,
        folder,
        "GiB",
    )
    generate(folder, specs, args)
    shm_root = SHM / f"wc-bench-tmpfs-{uuid.uuid4().hex}"
    os.environ["WEIGHTCACHE_HASH_CACHE"] = str(tmp / "hash-cache")
    try:
        shutil.copytree(folder, shm_root / "checkpoint")
        folders = {"disk": folder, "tmpfs": shm_root / "checkpoint"}
        with ExitStack() as stack:
            sockets = {}
            for which, level in ROWS.values():
                log_dir = tmp / f"daemon-{which}-{level}"
                log_dir.mkdir()
                daemon = stack.enter_context(
                    preloaded(
                        folders[which],
                        log_dir,
                        args=["--fingerprint-level", level],
                        timeout=900,
                    )
                )
                sockets[which, level] = daemon.socket
            print()
            seconds = measure(folders, sockets, tmp, args, len(specs))
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
    print()
    note = ("  timed, in each worker after its imports, + first byte of every tensor:",)
    print_table(seconds, TIMED, 16, note, "disk identity")
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
    ok = run_script("wctmpfs-", lambda tmp: run_bench(args, tmp), (BenchError,))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
