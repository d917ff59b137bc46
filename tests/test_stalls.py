"""Clients that stall or flood the daemon (issue 27, items 4, 5 and 9), on real daemons.

- a Health ``Watch`` stream whose client opened a zero HTTP/2 flow-control window must
  not hold SIGTERM: the daemon exits within its drain timeout;
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from grpc_health.v1 import health_pb2

from tests.http2_support import ZeroWindowStream, unix_connection
from tests.support import Checkpoints, DaemonPool

pytestmark = pytest.mark.timeout(120)

WATCH = "/grpc.health.v1.Health/Watch"


def test_sigterm_is_bounded_behind_zero_window_health_watches(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    drain_timeout = 2.0
    daemon = daemons.start([checkpoints.single], args=["--drain-timeout", str(drain_timeout)])
    services = ("", "readiness", "liveness", "weightcache.v1.WeightCacheService")
    watches = [
        ZeroWindowStream(
            unix_connection(daemon.socket),
            WATCH,
            health_pb2.HealthCheckRequest(service=service).SerializeToString(),
        )
        for service in services
    ]
    try:
        time.sleep(0.5)  # the watches are open and their first writes pending
        assert not any(w.closed.is_set() for w in watches)
        start = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        try:
            rc = daemon.proc.wait(drain_timeout + 30)
        except subprocess.TimeoutExpired:
            daemon.proc.kill()
            daemon.proc.wait()
            daemon.killed = True
            pytest.fail(f"SIGTERM hung behind zero-window Watch streams:\n{daemon.log()}")
        took = time.monotonic() - start
        assert rc == 0, daemon.log()
        assert took < drain_timeout + 5, took
        assert daemon.leftovers() == []
    finally:
        for watch in watches:
            watch.close()
