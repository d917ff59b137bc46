"""Benchmark: the daemon's start, stop, hand-over restart and idle memory, against a bare
``python -c "import grpc"`` on the same machine (issue 39).

    .venv/bin/python bench/daemon_start.py [--rounds 7] [--mib 64]

Each round, interleaved (a burst of load elsewhere touches every row alike), each in a
fresh process:

- ``import grpc``: the wall time of ``python -c "import grpc"`` (the baseline);
- ``bare start``: ``weightcache preload --socket S`` with no model, from the spawn to its
  ``READY=1`` (sd_notify, sent when the readiness health service turns SERVING; the bench
  binds the ``$NOTIFY_SOCKET`` datagram socket itself); then its PSS
  (``/proc/<pid>/smaps_rollup``) once ready, idle;
- ``stop``: SIGTERM to the bare daemon until it has exited, and of that the part after
  its last log line (``stopped``);
- ``hand-over``: a daemon with ``--hand-over`` holding a ``--mib`` MiB checkpoint: SIGTERM,
  its exit, then the successor spawned on the same socket until its ``READY=1`` with the
  model adopted (the wall time an operator's restart takes).

Prints each row's median and min, and its median over the baseline's, and whether the
processes ran from cached bytecode (``pycache.describe``); ``--bytecode``: every process
caches its bytecode in the temporary folder, warmed by an untimed round first (what an
installed daemon runs from: ``pip install`` compiles it). Removes its temporary folder
(sockets, checkpoint, hash cache, bytecode) at the end, also on failure.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pycache
from safetensors.numpy import save_file

BASELINE = "python -c 'import grpc'"
COMMAND = str(Path(sys.executable).with_name("weightcache"))
#: Seconds a daemon may take to be ready or to exit before the round fails.
TIMEOUT = 120.0


def write_checkpoint(folder: Path, mib: int) -> Path:
    """``folder/model.safetensors``: random U8 tensors of 8 MiB, ``mib`` MiB in all."""
    folder.mkdir(parents=True)
    gen = np.random.default_rng(0)
    tensors = {
        f"layers.{i}.weight": gen.integers(0, 256, 8 << 20, dtype=np.uint8)
        for i in range(max(1, mib // 8))
    }
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@contextlib.contextmanager
def notify_socket(folder: Path) -> Iterator[socket.socket]:
    """A datagram socket for sd_notify messages, bound in ``folder``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = folder / "notify"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock.bind(str(path))
    try:
        yield sock
    finally:
        sock.close()


def spawn(
    argv: list[str], notify: socket.socket, log: Path
) -> tuple[subprocess.Popen[bytes], float]:
    """Start ``weightcache ARGV`` and wait for its ``READY=1``; the process and the seconds
    from the spawn to READY.

    Raises:
        RuntimeError: it exited, or was not ready within :data:`TIMEOUT`.
    """
    env = {**os.environ, "NOTIFY_SOCKET": notify.getsockname()}
    start = time.perf_counter()
    with open(log, "ab") as out:
        proc = subprocess.Popen([COMMAND, *argv], stdout=out, stderr=out, env=env)
    notify.settimeout(0.05)
    while time.perf_counter() - start < TIMEOUT:
        try:
            message = notify.recv(4096).decode()
        except TimeoutError:
            if proc.poll() is not None:
                raise RuntimeError(f"exited {proc.returncode}: {log.read_text()[-2000:]}") from None
            continue
        if "READY=1" in message.split("\n"):
            return proc, time.perf_counter() - start
    proc.kill()
    raise RuntimeError(f"not ready in {TIMEOUT} s")


def stop(proc: subprocess.Popen[bytes], log: Path) -> tuple[float, float]:
    """SIGTERM and wait; the seconds to the exit, and from the log's last line to it."""
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait(TIMEOUT)
    seconds = time.perf_counter() - start
    exited = datetime.datetime.now(datetime.UTC)
    last = log.read_text().rstrip("\n").rsplit("\n", 1)[-1]
    if "stopped" not in last:
        raise RuntimeError(f"the last log line is not 'stopped': {last}")
    stamp = datetime.datetime.fromisoformat(last.split()[0])
    return seconds, (exited - stamp).total_seconds()


def pss_mib(pid: int) -> float:
    """Proportional set size of ``pid`` in MiB (smaps_rollup)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no Pss in smaps_rollup")


def one_round(root: Path, model: Path, times: dict[str, list[float]]) -> None:
    """One interleaved round of every row, appended to ``times``."""
    begin = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import grpc"], check=True)
    times[BASELINE].append(time.perf_counter() - begin)

    log = root / "bare.log"
    with notify_socket(root) as notify:
        proc, ready = spawn(["preload", "--socket", str(root / "b.sock")], notify, log)
        times["bare start -> SERVING"].append(ready)
        times["idle PSS (MiB)"].append(pss_mib(proc.pid))
        seconds, after = stop(proc, log)
        times["stop: SIGTERM -> exit"].append(seconds)
        times["stop: 'stopped' -> exit"].append(after)

        log = root / "handover.log"
        argv = ["preload", str(model), "--hand-over", "--socket", str(root / "h.sock")]
        old, _ = spawn(argv, notify, log)
        begin = time.perf_counter()
        old.send_signal(signal.SIGTERM)
        old.wait(TIMEOUT)
        new, _ = spawn(argv, notify, log)
        times["hand-over: SIGTERM -> successor SERVING"].append(time.perf_counter() - begin)
        if "] adopted " not in log.read_text():
            raise RuntimeError("the successor did not adopt the model")
        new.send_signal(signal.SIGINT)  # a drain: the last one frees its arena
        new.wait(TIMEOUT)


def report(times: dict[str, list[float]]) -> None:
    """The table: median, min, and the median over the baseline's (times only)."""
    base = statistics.median(times[BASELINE])
    print(f"{'row':<42} {'median':>8} {'min':>8} {'x baseline':>11}")
    for name, values in times.items():
        median = statistics.median(values)
        ratio = "" if "MiB" in name else f"{median / base:>10.2f}x"
        print(f"{name:<42} {median:>8.3f} {min(values):>8.3f} {ratio:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--mib", type=int, default=64, help="hand-over checkpoint size (MiB)")
    parser.add_argument(
        "--bytecode", action="store_true", help="cache bytecode, as an installed daemon has it"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="wc-start-", dir="/tmp"))
    try:
        os.environ["WEIGHTCACHE_HASH_CACHE"] = str(root / "hashes")
        model = write_checkpoint(root / "model", args.mib)
        if args.bytecode:
            pycache.use_cache(root / "pycache")
            one_round(root, model, collections.defaultdict(list))  # writes it, untimed
        times: dict[str, list[float]] = {
            BASELINE: [],
            "bare start -> SERVING": [],
            "idle PSS (MiB)": [],
            "stop: SIGTERM -> exit": [],
            "stop: 'stopped' -> exit": [],
            "hand-over: SIGTERM -> successor SERVING": [],
        }
        for _ in range(args.rounds):
            one_round(root, model, times)
        load = os.getloadavg()
        print(f"{args.rounds} rounds, {os.cpu_count()} CPUs, load average {load[0]:.1f}")
        print(f"hand-over checkpoint {args.mib} MiB; seconds unless MiB; {pycache.describe()}")
        report(times)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
