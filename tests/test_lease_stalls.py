"""Leases on a host that stalls (issue 27, item 12): a daemon or a worker that is not
scheduled for a while, on real daemons and real worker processes.

- A daemon and its worker frozen together past the TTL (a starved host, a paused VM):
  the daemon does not expire the lease whose renewals were queued behind it (its lease
  clock stops while its event loop does not run), a plain ``evict`` is refused, and the
  worker keeps its lease.
- A worker frozen for longer than its validity window (2/3 TTL) but less than the TTL
  does not declare its lease lost ("no keepalive acknowledgement") while the daemon still
  counts it: it renews at once and believes the daemon's ACTIVE.
- Under CPU starvation by many busy processes, a plain ``evict`` is refused all along
  while the lease lives, and the worker keeps it.
- :class:`weightcache.core.stalls.StallWatch` measures an injected stall exactly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from tests.support import (
    Checkpoints,
    DaemonPool,
    WorkerPool,
    assert_attached,
    get_model,
    rpc_failure,
    service_stub,
)
from weightcache.core.stalls import TOLERANCE, StallWatch
from weightcache.v1 import weight_cache_service_pb2 as pb

pytestmark = pytest.mark.timeout(120)


class FakeClock:
    """Monotonic seconds that move only when told to (trio's ``MockClock`` style)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def jump(self, seconds: float) -> None:
        self.now += seconds


def test_stall_watch_measures_an_injected_stall() -> None:
    clock = FakeClock()
    watch = StallWatch(clock)
    assert watch.now() == 100.0
    assert watch.beat(0.1) == 0.0
    clock.jump(0.1)  # on time
    assert watch.beat(0.1) == 0.0
    assert watch.now() == 100.1
    # Not scheduled for 5 s: the clock stops once the beat is overdue (0.1 s + TOLERANCE).
    clock.jump(5.0)
    assert watch.now() == pytest.approx(100.1 + 0.1 + TOLERANCE)
    stall = watch.beat(0.1)
    assert stall == pytest.approx(5.0 - 0.1 - TOLERANCE)
    assert (watch.stalled, watch.longest, watch.count) == (stall, stall, 1)
    assert watch.now() == pytest.approx(100.1 + 0.1 + TOLERANCE)  # no jump at the beat
    clock.jump(0.1)
    assert watch.now() == pytest.approx(100.2 + 0.1 + TOLERANCE)
    assert watch.beat(0.1) == 0.0
    # Lateness within the tolerance is no stall; nothing is counted while no beat is due.
    clock.jump(0.1 + TOLERANCE / 2)
    assert watch.beat(None) == 0.0
    clock.jump(30.0)
    assert watch.beat(0.1) == 0.0
    assert (watch.count, watch.stalled) == (1, stall)
    # A second stall adds up; the longest is kept.
    clock.jump(1.0)
    second = watch.beat(None)
    assert second == pytest.approx(1.0 - 0.1 - TOLERANCE)
    assert (watch.count, watch.stalled, watch.longest) == (2, stall + second, stall)


@contextlib.contextmanager
def stopped(*pids: int) -> Iterator[None]:
    """SIGSTOP the processes; SIGCONT them on the way out, whatever happens."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def assert_evict_refused(socket: str) -> None:
    with service_stub(socket) as stub, pytest.raises(grpc.RpcError) as raised:
        stub.Evict(pb.EvictRequest(name="single"), timeout=30)
    failure = rpc_failure(raised.value)
    assert (failure.code, failure.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "LEASES_ACTIVE")
    assert failure.metadata["leases"] == "1"


def test_a_host_frozen_past_the_ttl_keeps_the_lease(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints
) -> None:
    ttl = 2.0
    daemon = daemons.start([checkpoints.single])
    worker = workers.start()
    reply = worker.load(checkpoints.single, socket=daemon.socket, ttl=ttl, lost_callback=True)
    assert_attached(reply)
    assert reply["lease"]["ttl"] == ttl
    assert worker.request("wait_ack", key="w", seconds=5)["ok"]
    # Neither is scheduled for twice the TTL (before: the daemon reaped the lease first
    # thing when it ran again, and the worker gave it up).
    with stopped(daemon.pid, worker.pid):
        time.sleep(2 * ttl)
    assert_evict_refused(daemon.socket)
    lost = worker.request("wait_lost", key="w", seconds=2 * ttl)
    assert (lost["fired"], lost["callback_t"], lost["tensors_error"]) == (False, None, None)
    assert get_model(daemon.socket, "single").lease_count == 1
    assert "event loop stalled: lease times extended" in daemon.log()


def test_a_worker_frozen_past_its_validity_asks_the_daemon(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints
) -> None:
    ttl = 6.0
    daemon = daemons.start([checkpoints.single])
    worker = workers.start()
    reply = worker.load(checkpoints.single, socket=daemon.socket, ttl=ttl, lost_callback=True)
    assert_attached(reply)
    assert reply["lease"]["validity"] == ttl * 2 / 3
    # Right after a renewal, the worker is not scheduled for longer than its validity
    # window (4 s) but less than the TTL: the daemon still counts the lease (before: the
    # worker woke and gave it up, "no keepalive acknowledgement for 4.0 s").
    assert worker.request("wait_ack", key="w", seconds=ttl)["ok"]
    with stopped(worker.pid):
        time.sleep(ttl * 3 / 4)
    lost = worker.request("wait_lost", key="w", seconds=ttl / 2)
    assert (lost["fired"], lost["callback_t"], lost["tensors_error"]) == (False, None, None)
    assert_evict_refused(daemon.socket)
    assert get_model(daemon.socket, "single").lease_count == 1


#: Busy processes per CPU for the starvation test (load average about 8 x CPUs).
HOGS_PER_CPU = 8
#: Seconds the CPU is starved.
STARVED = 10.0


@pytest.mark.slow
def test_leases_hold_under_cpu_starvation(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints
) -> None:
    ttl = 3.0  # the TTL of the report (issue 27, item 12)
    daemon = daemons.start([checkpoints.single])
    worker = workers.start()
    reply = worker.load(checkpoints.single, socket=daemon.socket, ttl=ttl, lost_callback=True)
    assert_attached(reply)
    assert worker.request("wait_ack", key="w", seconds=5)["ok"]
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(HOGS_PER_CPU * (os.cpu_count() or 1))
    ]
    refused = 0
    try:
        end = time.monotonic() + STARVED
        while time.monotonic() < end:
            assert_evict_refused(daemon.socket)
            refused += 1
            time.sleep(0.1)
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
    assert refused > 0
    lost = worker.request("wait_lost", key="w", seconds=1.0)
    assert (lost["fired"], lost["callback_t"], lost["tensors_error"]) == (False, None, None)
    assert get_model(daemon.socket, "single").lease_count == 1
