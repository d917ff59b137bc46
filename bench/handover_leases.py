"""Benchmark: do workers keep their leases across hand-over restarts at the default TTL on
a loaded host (issue 39's goal: no lease lost across 20 hand-over restarts with a CPU hog
running beside them)?

    .venv/bin/python bench/handover_leases.py [--restarts 20] [--workers 2] [--hogs 2] [--mib 64]

A ``--hand-over`` daemon holds a ``--mib`` MiB checkpoint; ``--workers`` worker processes
each ``weightcache.load`` it (the default TTL, 10 s, and loss policy ``ignore``, with an
``on_lease_lost`` callback that counts) and hold it; ``--hogs`` processes spin on the CPU
the whole time. Then ``--restarts`` times, back to back: SIGTERM to the daemon (a
hand-over), its exit, its successor spawned on the same socket until ``READY=1`` (the
model adopted). After the last restart the workers keep holding for one more TTL, so a
loss the last restart caused is seen, then report. Prints each restart's seconds (signal
to successor ready), and the leases lost (the goal: 0). Uses ``daemon_start``'s helpers;
removes its temporary folder at the end, also on failure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from daemon_start import TIMEOUT, notify_socket, spawn, write_checkpoint

#: The worker: loads, holds until its stdin closes, then prints the leases it lost.
WORKER = """
import sys, time, weightcache
lost = []
w = weightcache.load(sys.argv[1], socket=sys.argv[2], lease_policy="ignore",
                     on_lease_lost=lost.append)
assert w.lease is not None, "not attached"
print("held", flush=True)
sys.stdin.read()
print(len(lost), flush=True)
"""
#: Seconds the workers hold after the last restart (the default TTL, and a margin).
SETTLE = 12.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="wc-hol-", dir="/tmp"))
    hogs: list[subprocess.Popen[bytes]] = []
    workers: list[subprocess.Popen[str]] = []
    daemon: subprocess.Popen[bytes] | None = None
    try:
        os.environ["WEIGHTCACHE_HASH_CACHE"] = str(root / "hashes")
        model = write_checkpoint(root / "model", args.mib)
        sock, log = str(root / "h.sock"), root / "daemon.log"
        argv = ["preload", str(model), "--hand-over", "--socket", sock]
        with notify_socket(root) as notify:
            daemon, _ = spawn(argv, notify, log)
            for _ in range(args.workers):
                kid = subprocess.Popen(
                    [sys.executable, "-c", WORKER, str(model), sock],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                workers.append(kid)
                assert kid.stdout is not None and kid.stdout.readline().strip() == "held"
            hogs = [
                subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.hogs)
            ]
            seconds = []
            for _ in range(args.restarts):
                begin = time.perf_counter()
                daemon.send_signal(signal.SIGTERM)
                daemon.wait(TIMEOUT)
                daemon, _ = spawn(argv, notify, log)
                seconds.append(time.perf_counter() - begin)
            time.sleep(SETTLE)
            load = os.getloadavg()[0]
        lost = []
        for kid in workers:
            out, _ = kid.communicate("", timeout=TIMEOUT)
            lost.append(int(out.split()[-1]))
        print(
            f"{args.restarts} hand-over restarts, {args.workers} workers holding {args.mib} MiB, "
            f"{args.hogs} CPU hogs, {os.cpu_count()} CPUs, load average {load:.1f}"
        )
        print(
            f"signal -> successor ready: median {statistics.median(seconds):.3f} s, "
            f"max {max(seconds):.3f} s"
        )
        print(f"leases lost: {sum(lost)} of {args.workers} (per worker: {lost})")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        for kid in workers:
            kid.kill()
            kid.wait()
        if daemon is not None and daemon.poll() is None:
            daemon.send_signal(signal.SIGINT)  # a drain: the last one frees its arena
            daemon.wait(TIMEOUT)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
