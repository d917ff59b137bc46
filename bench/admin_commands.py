"""Benchmark: the wall time of each ``weightcache`` admin command, against a bare
``python -c "import grpc"`` on the same machine (issue 28, item 5: within 1.5x).

    .venv/bin/python bench/admin_commands.py [--repeat 7] [--skip leases]

1. starts a daemon (``weightcache.testing.run_daemon``) preloading a small checkpoint
   (``weightcache.testing.make_checkpoints``, about 40 KiB) in a temporary folder;
2. runs, ``--repeat`` times each and interleaved (so that a burst of load elsewhere on
   the machine touches every command alike), each in a fresh process: the baseline
   ``python -c "import grpc"``, ``weightcache --version``, ``health``, ``health
   --liveness``, ``ls``, ``ls --json``, ``info``, ``leases``, ``evict NOSUCH`` (a refusal:
   MODEL_NOT_FOUND, exit 1) and ``gc --dry-run``; each process is the console script the
   package installs (``.venv/bin/weightcache``);
3. prints each command's median and min wall time and its median over the baseline's,
   and whether the processes ran from cached bytecode (``pycache.describe``);
   ``--bytecode``: every process caches its bytecode in the folder, warmed by an untimed
   pass first (what an installed package runs from: ``pip install`` compiles it);
4. stops the daemon and removes the folder (also on failure or Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pycache

#: The commands measured, after ``weightcache``; ``{socket}`` is the daemon's.
COMMANDS: dict[str, list[str]] = {
    "--version": ["--version"],
    "health": ["health", "--socket", "{socket}"],
    "health --liveness": ["health", "--liveness", "--socket", "{socket}"],
    "ls": ["ls", "--socket", "{socket}"],
    "ls --json": ["ls", "--json", "--socket", "{socket}"],
    "info": ["info", "--socket", "{socket}"],
    "leases": ["leases", "--socket", "{socket}"],
    "evict (refused)": ["evict", "nosuch", "--socket", "{socket}"],
    "gc --dry-run": ["gc", "--dry-run"],
}
#: What each command exits with against the benchmark's daemon.
EXPECTED_RC = {"evict (refused)": 1}
BASELINE = "python -c 'import grpc'"


def _timed(argv: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, check=False, timeout=120)
    return time.perf_counter() - start, done.returncode


def measure(socket: str, repeat: int, skip: list[str]) -> dict[str, list[float]]:
    """Each command's wall times in seconds, ``repeat`` runs, interleaved; the commands
    named in ``skip`` left out (``leases``, to measure a version without it).

    Raises:
        RuntimeError: a command exited with another status than expected.
    """
    command = str(Path(sys.executable).with_name("weightcache"))
    runs: dict[str, list[str]] = {BASELINE: [sys.executable, "-c", "import grpc"]}
    for name, args in COMMANDS.items():
        if name in skip:
            continue
        runs[name] = [command, *(a.format(socket=socket) for a in args)]
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, argv in runs.items():
            seconds, rc = _timed(argv)
            if rc != EXPECTED_RC.get(name, 0):
                raise RuntimeError(f"{name}: exit {rc}, expected {EXPECTED_RC.get(name, 0)}")
            times[name].append(seconds)
    return times


def report(times: dict[str, list[float]]) -> None:
    """Print the table: median, min, and the median over the baseline's."""
    base = statistics.median(times[BASELINE])
    print(f"{'command':<24} {'median s':>9} {'min s':>7} {'x baseline':>11}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<24} {median:>9.3f} {min(values):>7.3f} {median / base:>10.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="runs of each command")
    parser.add_argument("--skip", action="append", default=[], help="a command to leave out")
    parser.add_argument(
        "--bytecode", action="store_true", help="cache bytecode, as an installed package has it"
    )
    args = parser.parse_args()
    from weightcache.testing import make_checkpoints, run_daemon

    print(f"{platform.node()} {platform.python_version()} cpus={os.cpu_count()}")
    folder = Path(tempfile.mkdtemp(prefix="wc-admin-bench-"))
    try:
        checkpoints = make_checkpoints(folder)
        if args.bytecode:
            pycache.use_cache(folder / "pycache")
        with run_daemon([checkpoints.single]) as daemon:
            if args.bytecode:
                measure(daemon.socket, 1, args.skip)  # writes it, untimed
            times = measure(daemon.socket, args.repeat, args.skip)
            print(f"load average {os.getloadavg()[0]:.1f}; {pycache.describe()}")
            report(times)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
