"""Clients that stall or flood the daemon (issue 27, items 4, 5 and 9), on real daemons.

- a Health ``Watch`` stream whose client opened a zero HTTP/2 flow-control window must
  not hold SIGTERM: the daemon exits within its drain timeout;
- connections that never speak are closed after the handshake timeout, and the daemon
  raises its soft file descriptor limit to the hard one;
- a KeepAlive stream that floods is read at a bounded rate, and another client is served
  meanwhile (``bench/keepalive_flood.py`` measures its latency);
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.http2_support import ZeroWindowStream, unix_connection
from tests.support import Checkpoints, DaemonPool, service_stub
from tests.test_probes import free_port
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache_service.access import HANDSHAKE_TIMEOUT_MS
from weightcache_service.servicer import KEEPALIVE_BURST, MAX_KEEPALIVES_PER_SECOND

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


def test_idle_tcp_connections_are_closed_and_the_fd_limit_is_raised(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    port = free_port()
    # A soft limit below the hard one, as shells and service managers often set it.
    daemon = daemons.start(
        [checkpoints.single],
        args=["--health-listen", f"127.0.0.1:{port}"],
        wrap=["prlimit", "--nofile=256:4096", "--"],
    )
    limits = Path(f"/proc/{daemon.pid}/limits").read_text()
    line = next(row for row in limits.splitlines() if row.startswith("Max open files"))
    assert line.split()[3:5] == ["4096", "4096"], line
    # Connections that never speak: closed after the handshake timeout (gRPC's default
    # kept them 120 s, each holding a descriptor).
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    try:
        start = time.monotonic()
        for conn in idle:
            conn.settimeout(HANDSHAKE_TIMEOUT_MS / 1000 + 20)
            while conn.recv(65536):  # the server's SETTINGS, perhaps a GOAWAY, then EOF
                pass
        took = time.monotonic() - start
        assert took < HANDSHAKE_TIMEOUT_MS / 1000 + 20, took
    finally:
        for conn in idle:
            conn.close()
    # The daemon kept serving through it.
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="liveness"), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_keepalive_flood_is_paced_and_others_are_served(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single])
    sent = 60
    requests = (pb.KeepAliveRequest(lease_ids=[f"flood-{i}"]) for i in range(sent))
    with service_stub(daemon.socket) as flooder, service_stub(daemon.socket) as other:
        info = other.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        stream = flooder.KeepAlive(requests, timeout=60)
        times = []
        for response in stream:
            times.append(time.monotonic())
            assert [s.lease_id for s in response.leases] == [f"flood-{len(times) - 1}"]
            if len(times) == sent // 2:
                # Another client is answered in the middle of the flood.
                again = other.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
                assert again.instance_id == info.instance_id
            if len(times) == sent:
                stream.cancel()
                break
    # 20 at once, then 20 a second (before: all 60 within milliseconds).
    paced = (sent - KEEPALIVE_BURST) / MAX_KEEPALIVES_PER_SECOND
    assert times[-1] - times[0] >= 0.8 * paced, times[-1] - times[0]
