"""Another client's latency while one client floods KeepAlive streams (issue 27, item 9).

Run with ``.venv/bin/python bench/keepalive_flood.py [--streams 32] [--seconds 5]``.

1. make the harness's small checkpoints in a temporary folder and start a daemon on them
   (``weightcache.testing.run_daemon``);
2. time ``GetServerInfo`` from a client of its own (one channel, ``--calls`` calls one
   after another): the quiet baseline;
3. start a flooder process that opens ``--streams`` KeepAlive streams on one channel,
   each sending messages of ``--ids`` made-up lease ids as fast as gRPC lets it, for
   ``--seconds``, reading their answers;
4. time ``GetServerInfo`` again, one call after another for as long as the flood runs
   (``--calls`` at least), and read the daemon's VmRSS and its peak VmHWM
   (``/proc/PID/status``) at the end of the flood;
5. print p50/p99/max latency of both phases, the KeepAlive answers the flooder got per
   second, and the daemon's RSS before, after and at its peak; stop the daemon (it must
   leave nothing).
"""

from __future__ import annotations

import argparse
import multiprocessing
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


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """``field`` of ``/proc/PID/status`` (``VmRSS``, or ``VmHWM``: the peak), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def latencies(socket: str, calls: int, until: Any = None) -> list[float]:
    """Seconds per GetServerInfo, one after another on one channel: ``calls`` of them,
    and more while ``until()`` is false (when given)."""
    out: list[float] = []
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = pb_grpc.WeightCacheServiceStub(channel)
        stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)  # connect first
        while len(out) < calls or (until is not None and not until()):
            start = time.perf_counter()
            stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
            out.append(time.perf_counter() - start)
    return out


def flood(socket: str, streams: int, ids: int, seconds: float, answers: Any) -> None:
    """In a process of its own: ``streams`` KeepAlive streams sending without pause."""
    request = pb.KeepAliveRequest(lease_ids=[f"flood-{i:08d}" for i in range(ids)])
    end = time.monotonic() + seconds

    def one() -> None:
        def requests() -> Iterator[pb.KeepAliveRequest]:
            while time.monotonic() < end:
                yield request

        got = 0
        try:
            for _ in stub.KeepAlive(requests(), timeout=seconds + 30):
                got += 1
        except grpc.RpcError:
            pass
        with answers.get_lock():
            answers.value += got

    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = pb_grpc.WeightCacheServiceStub(channel)
        threads = [threading.Thread(target=one) for _ in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def summary(name: str, values: list[float]) -> str:
    ms = sorted(v * 1e3 for v in values)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"{name}: p50 {statistics.median(ms):.2f} ms, p99 {p99:.2f} ms, max {ms[-1]:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--ids", type=int, default=1024, help="lease ids per message")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wc-flood-") as tmp:
        ckpt = make_checkpoints(Path(tmp) / "ckpt")
        with run_daemon([ckpt.single]) as daemon:
            quiet = latencies(daemon.socket, args.calls)
            rss_before = rss_kib(daemon.pid)
            answers = multiprocessing.get_context("spawn").Value("q", 0)
            flooder = multiprocessing.get_context("spawn").Process(
                target=flood, args=(daemon.socket, args.streams, args.ids, args.seconds, answers)
            )
            flood_start = time.monotonic()
            flooder.start()
            time.sleep(min(1.0, args.seconds / 4))  # the flood is under way
            # Calls all along the flood, until the flooder has ended.
            loud = latencies(daemon.socket, args.calls, until=lambda: not flooder.is_alive())
            rss_after = rss_kib(daemon.pid)
            peak = rss_kib(daemon.pid, "VmHWM")
            flooder.join(args.seconds + 60)
            flood_took = time.monotonic() - flood_start
    print(f"flood: {args.streams} KeepAlive streams x {args.ids} ids, {args.seconds:.0f} s")
    print(summary("GetServerInfo quiet ", quiet))
    print(summary("GetServerInfo flooded", loud) + f" ({len(loud)} calls)")
    print(
        f"KeepAlive answers to the flooder: {answers.value} in {flood_took:.1f} s "
        f"({answers.value / flood_took:.0f}/s, {answers.value * args.ids / flood_took:.0f} "
        "lease ids/s), until its last stream ended"
    )
    print(
        f"daemon VmRSS: {rss_before / 1024:.0f} MiB before, {rss_after / 1024:.0f} MiB after, "
        f"peak (VmHWM) {peak / 1024:.0f} MiB"
    )


if __name__ == "__main__":
    main()
