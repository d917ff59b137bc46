"""Other clients' latency while flooding processes hold many KeepAlive streams (issue 27,
item 9; issue 37, item 12).

Run with ``.venv/bin/python bench/keepalive_flood.py [--processes 4] [--streams 50]
[--ids 4096] [--rounds 2] [--seconds 5] [--quiet-seconds 3]``.

1. make the harness's small checkpoints in a temporary folder and start a daemon on them
   (``weightcache.testing.run_daemon``);
2. start a probe process of its own, which, until told to stop, calls ``GetServerInfo``
   and sends one KeepAlive message (one made-up lease id, on a stream it keeps open) one
   after another, timing each, each sample tagged with the phase the run is in;
3. ``--rounds`` times, alternately: a quiet phase of ``--quiet-seconds``, then a flood
   phase: ``--processes`` flooding processes, each opening ``--streams`` KeepAlive streams
   (over connections of at most 100 streams each: a connection holds 128 calls) and
   sending messages of ``--ids`` made-up lease ids as fast as gRPC lets them for
   ``--seconds``, reading their answers; the phase lasts until the last flooder has
   ended (the daemon's queued tail included);
4. print p50/p99/max of the probe's two calls in each phase (all rounds together, then
   per round), the KeepAlive answers the flooders got, and the daemon's VmRSS before and
   its peak (VmHWM); stop the daemon (it must leave nothing).
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from weightcache.testing import make_checkpoints, run_daemon
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc

#: Streams per flooding connection (a connection holds 128 calls at once).
STREAMS_PER_CONNECTION = 100
#: Phases the probe tags its samples with.
STOP, QUIET, FLOOD = 0, 1, 2


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """``field`` of ``/proc/PID/status`` (``VmRSS``, or ``VmHWM``: the peak), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def probe(socket: str, phase: Any, ready: Any, out: Any) -> None:
    """In a process of its own: GetServerInfo and a one-id KeepAlive, one after another
    (``ready`` set once both are connected), until ``phase`` is STOP; puts
    ``[(phase, round, call, seconds), ...]`` on ``out``."""
    samples: list[tuple[int, int, str, float]] = []
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = pb_grpc.WeightCacheServiceStub(channel)
        stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)  # connect first
        ask: queue.SimpleQueue[pb.KeepAliveRequest | None] = queue.SimpleQueue()
        answers = stub.KeepAlive(iter(ask.get, None), timeout=3600)
        ask.put(pb.KeepAliveRequest(lease_ids=["probe-lease"]))
        next(answers)
        ready.set()
        while (now := phase.value) != STOP:
            start = time.perf_counter()
            stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=60)
            samples.append((now % 4, now // 4, "GetServerInfo", time.perf_counter() - start))
            start = time.perf_counter()
            ask.put(pb.KeepAliveRequest(lease_ids=["probe-lease"]))
            next(answers)
            samples.append((now % 4, now // 4, "KeepAlive", time.perf_counter() - start))
        ask.put(None)
        answers.cancel()
    out.put(samples)


def flood(socket: str, streams: int, ids: int, seconds: float, answers: Any) -> None:
    """In a process of its own: ``streams`` KeepAlive streams sending without pause."""
    request = pb.KeepAliveRequest(lease_ids=[f"flood-{i:08d}" for i in range(ids)])
    end = time.monotonic() + seconds

    def one(stub: Any) -> None:
        def requests() -> Iterator[pb.KeepAliveRequest]:
            while time.monotonic() < end:
                yield request

        got = 0
        try:
            for _ in stub.KeepAlive(requests(), timeout=seconds + 120):
                got += 1
        except grpc.RpcError:
            pass
        with answers.get_lock():
            answers.value += got

    # A connection of its own per STREAMS_PER_CONNECTION streams (no shared subchannel).
    channels = [
        grpc.insecure_channel(f"unix:{socket}", options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(-(-streams // STREAMS_PER_CONNECTION))
    ]
    stubs = [pb_grpc.WeightCacheServiceStub(c) for c in channels]
    threads = [
        threading.Thread(target=one, args=(stubs[i // STREAMS_PER_CONNECTION],))
        for i in range(streams)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for channel in channels:
        channel.close()


def summary(name: str, values: list[float]) -> str:
    if not values:
        return f"{name}: no calls"
    ms = sorted(v * 1e3 for v in values)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return (
        f"{name}: p50 {statistics.median(ms):8.2f} ms, p99 {p99:8.2f} ms, "
        f"max {ms[-1]:8.2f} ms ({len(ms)} calls)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4, help="flooding processes")
    parser.add_argument("--streams", type=int, default=50, help="KeepAlive streams per process")
    parser.add_argument("--ids", type=int, default=4096, help="lease ids per message")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0, help="each flood's sending time")
    parser.add_argument("--quiet-seconds", type=float, default=3.0)
    args = parser.parse_args()
    spawn = multiprocessing.get_context("spawn")
    answers = spawn.Value("q", 0)
    phase = spawn.Value("i", QUIET)
    results = spawn.Queue()
    took: list[float] = []
    with tempfile.TemporaryDirectory(prefix="wc-flood-") as tmp:
        ckpt = make_checkpoints(Path(tmp) / "ckpt")
        with run_daemon([ckpt.single]) as daemon:
            rss_before = rss_kib(daemon.pid)
            ready = spawn.Event()
            prober = spawn.Process(target=probe, args=(daemon.socket, phase, ready, results))
            prober.start()
            ready.wait(120)
            for round_ in range(args.rounds):
                phase.value = round_ * 4 + QUIET
                time.sleep(args.quiet_seconds)
                flooders = [
                    spawn.Process(
                        target=flood,
                        args=(daemon.socket, args.streams, args.ids, args.seconds, answers),
                    )
                    for _ in range(args.processes)
                ]
                start = time.monotonic()
                for flooder in flooders:
                    flooder.start()
                phase.value = round_ * 4 + FLOOD
                for flooder in flooders:
                    flooder.join(args.seconds + 180)
                took.append(time.monotonic() - start)
            phase.value = STOP
            samples = results.get(timeout=120)
            prober.join(30)
            peak = rss_kib(daemon.pid, "VmHWM")
    print(
        f"flood: {args.processes} processes x {args.streams} KeepAlive streams x {args.ids} "
        f"ids, {args.seconds:.0f} s of sending, {args.rounds} rounds (quiet "
        f"{args.quiet_seconds:.0f} s, then flood)"
    )
    for call in ("GetServerInfo", "KeepAlive"):
        for name, kind in (("quiet  ", QUIET), ("flooded", FLOOD)):
            values = [s for p, _, c, s in samples if p == kind and c == call]
            print(summary(f"{call:13s} {name}", values))
    for round_ in range(args.rounds):
        for call in ("GetServerInfo", "KeepAlive"):
            for name, kind in (("quiet  ", QUIET), ("flooded", FLOOD)):
                values = [s for p, r, c, s in samples if (p, r, c) == (kind, round_, call)]
                print(summary(f"  round {round_ + 1} {call:13s} {name}", values))
    total = sum(took)
    print(
        f"KeepAlive answers to the flooders: {answers.value} in {total:.1f} s of flood "
        f"({answers.value / total:.0f}/s, {answers.value * args.ids / total:.0f} lease ids/s; "
        f"floods lasted {', '.join(f'{t:.1f}' for t in took)} s)"
    )
    print(f"daemon VmRSS: {rss_before / 1024:.0f} MiB before, peak (VmHWM) {peak / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
