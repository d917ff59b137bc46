"""Restart-to-READY of the CPU daemon: with a hand-over, against a reload (issue 26).

For each round, the same checkpoint on the same socket:

- ``reload``: a daemon without ``--hand-over`` is stopped (SIGTERM: a drain, the arenas
  freed) and a new one started; it loads the checkpoint again (the hash cache holds the
  shards' digests from the first start, so this is the copy alone, as in a real restart);
- ``hand-over``: a daemon with ``--hand-over`` is stopped (SIGTERM: arenas and manifest
  left) and a new one started; it adopts the arena (headers read, no tensor).

Timed: restart-to-READY, from the new process's start to its readiness (the harness's
``Daemon.ready_seconds``: interpreter start and imports included, as an operator sees it),
and the old daemon's stop, from SIGTERM to its exit. The page cache is warm in both.

Usage: ``python bench/handover.py [--mib 1024] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from weightcache.testing import daemon_pool
from weightcache.testing.daemon import Daemon, DaemonPool

#: Bytes of one tensor of the checkpoint.
TENSOR_BYTES = 64 * 2**20


def write_checkpoint(folder: Path, mib: int) -> Path:
    """``folder/model.safetensors``: random U8 tensors of 64 MiB, ``mib`` MiB in all."""
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    count = max(1, mib * 2**20 // TENSOR_BYTES)
    tensors = {
        f"layers.{i}.weight": torch.randint(
            0, 256, (TENSOR_BYTES,), dtype=torch.uint8, generator=gen
        )
        for i in range(count)
    }
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def stop(daemon: Daemon) -> float:
    """SIGTERM and wait; seconds to the exit."""
    start = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    daemon.proc.wait(600)
    return time.monotonic() - start


def rounds(
    pool: DaemonPool, model: Path, args: list[str], count: int
) -> tuple[list[float], list[float]]:
    """Start once, then ``count`` times stop and start again; the restarts' ready and stop
    seconds."""
    socket = pool.socket("h" if args else "r")
    daemon = pool.start([model], socket=socket, args=args)
    ready, stopped = [], []
    for _ in range(count):
        stopped.append(stop(daemon))
        daemon = pool.start([model], socket=socket, args=args)
        assert daemon.ready_seconds is not None
        ready.append(daemon.ready_seconds)
        if args:
            assert "] adopted " in daemon.log(), daemon.log()
        else:
            assert "] loading " in daemon.log(), daemon.log()
    daemon.proc.send_signal(signal.SIGINT)  # SIGINT drains: the last one frees its arena
    daemon.proc.wait(600)
    return ready, stopped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mib", type=int, default=1024, help="checkpoint size (MiB)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_checkpoint(root / "model", args.mib)
        os.environ["WEIGHTCACHE_HASH_CACHE"] = str(root / "hashes")
        (root / "logs").mkdir()
        with daemon_pool(root / "logs") as pool:
            results = {
                "reload": rounds(pool, model, [], args.rounds),
                "hand-over": rounds(pool, model, ["--hand-over"], args.rounds),
            }
    print(f"checkpoint: {args.mib} MiB, {args.rounds} restarts each, {os.cpu_count()} CPUs")
    print(f"{'restart':<10} {'ready median s':>15} {'ready all s':>24} {'stop median s':>14}")
    for name, (ready, stopped) in results.items():
        runs = ", ".join(f"{s:.2f}" for s in ready)
        print(
            f"{name:<10} {statistics.median(ready):>15.2f} {runs:>24} "
            f"{statistics.median(stopped):>14.2f}"
        )


if __name__ == "__main__":
    main()
