"""Benchmark: the CPU seconds (user + system, ``wait4``) of a bare daemon and of the admin
commands, this tree against another's code, interleaved (issue 39, item 2).

    .venv/bin/python bench/start_cpu.py [--rounds 7] [--against CLIENT:SERVICE] [--bytecode]

CPU time, unlike the wall time of ``daemon_start.py`` and ``admin_commands.py``, hardly
moves with the load other processes put on a shared machine, so a change of a few
milliseconds shows. Each round, in fresh processes, for this tree and (``--against``: a
``PYTHONPATH`` with another checkout's ``client`` and ``cache_service``, e.g. a ``git
archive`` of main) the other, their order alternating round by round:
``python -c "import grpc"``; a bare ``weightcache preload --socket S`` from the spawn to
its ``READY=1``, then SIGTERM, to its exit; ``health``, ``ls``, ``ls --json``, ``info``,
``leases`` and ``--version`` against a daemon (``weightcache.testing.run_daemon``)
holding a small checkpoint. ``--bytecode``: every process caches its bytecode in the
temporary folder (``pycache.py``), warmed by an untimed round. Prints each row's median
and its median over ``import grpc``'s; removes its folder at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pycache

from weightcache.testing import make_checkpoints, run_daemon

COMMAND = str(Path(sys.executable).with_name("weightcache"))
BASELINE = "import grpc"
DAEMON = "bare daemon: spawn .. READY, SIGTERM .. exit"
#: Seconds a bare daemon may take to send READY=1.
TIMEOUT = 120.0


def cpu_seconds(argv: list[str], env: dict[str, str], notify: Path | None = None) -> float:
    """User + system CPU seconds of ``argv`` run to its exit; with ``notify``, a daemon:
    SIGTERM once it sent ``READY=1`` to that datagram socket."""
    if notify is None:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(str(notify))
            sock.settimeout(TIMEOUT)
            env = {**env, "NOTIFY_SOCKET": str(notify)}
            proc = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL)
            while b"READY=1" not in sock.recv(4096).split(b"\n"):
                pass
            proc.send_signal(signal.SIGTERM)
        notify.unlink()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--against", default=None, metavar="PYTHONPATH", help="other code")
    parser.add_argument("--bytecode", action="store_true", help="cache bytecode (installed)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="wc-cpu-", dir="/tmp"))
    trees = {"this": dict(os.environ)}
    if args.against:
        trees["other"] = {**os.environ, "PYTHONPATH": args.against}
    times: dict[str, dict[str, list[float]]] = {tree: {} for tree in trees}
    try:
        if args.bytecode:
            pycache.use_cache(root / "pycache")
            for env in trees.values():
                env.update(os.environ)
                env.pop("PYTHONDONTWRITEBYTECODE", None)
        checkpoints = make_checkpoints(root / "checkpoints")
        with run_daemon([checkpoints.single]) as daemon:
            rows = {
                BASELINE: [sys.executable, "-c", "import grpc"],
                DAEMON: [COMMAND, "preload", "--socket", str(root / "bare.sock")],
                **{
                    " ".join(cmd): [COMMAND, *cmd, "--socket", daemon.socket]
                    for cmd in (["health"], ["ls"], ["ls", "--json"], ["info"], ["leases"])
                },
                "--version": [COMMAND, "--version"],
            }
            for index in range(args.rounds + args.bytecode):
                order = list(trees) if index % 2 == 0 else list(trees)[::-1]
                for tree in order:
                    for name, argv in rows.items():
                        notify = root / "notify" if name == DAEMON else None
                        seconds = cpu_seconds(argv, trees[tree], notify)
                        if index >= args.bytecode:  # the first round wrote the bytecode
                            times[tree].setdefault(name, []).append(seconds)
        load = os.getloadavg()[0]
        print(f"{args.rounds} rounds, {os.cpu_count()} CPUs, load average {load:.1f}")
        print(f"CPU seconds (user + system), medians; {pycache.describe()}")
        header = "".join(f" {tree:>8} {'x grpc':>7}" for tree in trees)
        print(f"{'row':<46}{header}")
        for name in rows:
            cells = ""
            for tree in trees:
                median = statistics.median(times[tree][name])
                cells += f" {median:8.3f} {median / statistics.median(times[tree][BASELINE]):6.2f}x"
            print(f"{name:<46}{cells}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
