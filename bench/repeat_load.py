"""A second ``load()`` in one process: repeated loads of one model vs ``load_file``.

Run with ``.venv/bin/python bench/repeat_load.py [options]``.

1. generate a checkpoint (``--tensors`` tensors, ``--size-mib`` MiB, ``--shards`` shards;
   the generator of attach_vs_disk.py) in a temporary folder under /tmp and start
   ``weightcache preload`` on it;
2. in each of ``--processes`` fresh worker processes: a first ``weightcache.load()`` (kept
   open, so that the process holds a lease and its KeepAlive stream as a serving worker
   does), then ``--loads`` rounds, interleaved, of (a) ``load()`` timed, then ``close()``
   timed, and (b) ``safetensors.torch.load_file`` of every shard, timed;
3. print per process the medians and minima, and ``load_file`` / ``load()`` of the
   medians (>= 1: a repeated load is at least as fast as reading the files again).

Issue 10's goal: a second ``load()`` under 1 ms for 300 tensors.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

# bench/ is sys.path[0] when this file runs as a script.
from attach_vs_disk import (
    BenchError,
    machine_line,
    plan_tensors,
    preloaded,
    run_child,
    run_script,
    write_checkpoint,
)

WORKER = r"""
import json, pathlib, sys, time
import safetensors.torch
import weightcache

folder, socket, loads = sys.argv[1], sys.argv[2], int(sys.argv[3])
shards = sorted(pathlib.Path(folder).glob("*.safetensors"))
load = weightcache.load
held = load(folder, socket=socket, fallback=False)
out = {"load": [], "close": [], "load_file": []}
for _ in range(loads):
    begin = time.perf_counter()
    again = load(folder, socket=socket, fallback=False)
    loaded = time.perf_counter()
    again.close()
    out["load"].append(loaded - begin)
    out["close"].append(time.perf_counter() - loaded)
    begin = time.perf_counter()
    for shard in shards:
        safetensors.torch.load_file(shard)
    out["load_file"].append(time.perf_counter() - begin)
held.close()
print(json.dumps(out))
"""


def run(args: argparse.Namespace, tmp: Path) -> bool:
    """Steps 1-3 of the module docstring; True once done (a failure raises)."""
    folder = tmp / "checkpoint"
    folder.mkdir()
    specs = plan_tensors(args.tensors, args.size_mib * 2**20, args.seed)
    write_checkpoint(folder, specs, args.shards, args.seed)
    print("weightcache benchmark: a repeated load() in one process vs load_file")
    print(machine_line())
    print(f"  checkpoint: {args.size_mib} MiB, {args.tensors} tensors, {args.shards} shards")
    print(f"  {args.processes} worker processes x {args.loads} rounds; ", end="")
    with preloaded(folder, tmp, timeout=300) as daemon:
        for number in range(args.processes):
            command = [sys.executable, "-c", WORKER, str(folder), daemon.socket, str(args.loads)]
            done = run_child(command, "repeat-load", timeout=600)
            if done.returncode != 0:
                raise BenchError(f"worker exited {done.returncode}: {done.stderr[-2000:]}")
            print_process(number, json.loads(done.stdout))
    return True


def print_process(number: int, seconds: dict[str, list[float]]) -> None:
    """One line per process: median (min) of each, in ms, and the ratio of medians."""
    median = {name: statistics.median(values) for name, values in seconds.items()}
    parts = [
        f"{name} median {1e3 * median[name]:.2f} ms (min {1e3 * min(seconds[name]):.2f})"
        for name in ("load", "close", "load_file")
    ]
    ratio = median["load_file"] / median["load"]
    print(f"  process {number}: " + "; ".join(parts) + f"; load_file/load {ratio:.2f}x")


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=300, help="number of tensors")
    parser.add_argument("--size-mib", type=int, default=16, help="checkpoint size, MiB")
    parser.add_argument("--shards", type=int, default=1, help="number of shard files")
    parser.add_argument("--loads", type=int, default=30, help="rounds per process")
    parser.add_argument("--processes", type=int, default=3, help="worker processes")
    parser.add_argument("--seed", type=int, default=0, help="seed of shapes and values")
    args = parser.parse_args()
    if min(args.tensors, args.size_mib, args.shards, args.loads, args.processes) < 1:
        parser.error("every count must be positive")
    return args


def main() -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args()
    ok = run_script("wcbench-", functools.partial(run, args), (BenchError,))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
