"""One owner per socket, robustly, and health that follows the socket (issue 26, items 3
and 4): a removed lock file lets no second daemon take a live daemon's socket; a socket
file removed or replaced turns every health service NOT_SERVING, and the daemon stops
(exit status 1) without touching what now lies at its path.
"""

from __future__ import annotations

import os
import socket as socketlib
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import Checkpoints, DaemonPool, health, run_cli, wait_until
from tests.test_probes import SERVICES
from weightcache.testing.daemon import Daemon
from weightcache_service.socket_lock import SocketInUseError, SocketLock

pytestmark = pytest.mark.timeout(120)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def forget(daemons: DaemonPool, daemon: Daemon) -> None:
    """The daemon exited 1 on purpose, checked by the test: not the pool's to judge."""
    daemons.daemons.remove(daemon)


def test_a_listening_socket_without_its_lock_file_is_not_taken(tmp_path: Path) -> None:
    path = str(tmp_path / "d.sock")
    with socketlib.socket(socketlib.AF_UNIX) as live:
        live.bind(path)
        live.listen()
        with pytest.raises(SocketInUseError) as refused:
            SocketLock(path)
    assert str(refused.value) == (
        f"socket {path} is served by a live daemon whose lock file {path}.lock was "
        "removed; stop that daemon first"
    )
    assert not os.path.exists(path + ".lock")
    # Nobody listens on the stale file now: taken, and released cleanly.
    lock = SocketLock(path)
    assert Path(path + ".lock").read_text() == f"{os.getpid()}\n"
    lock.release()
    assert not os.path.exists(path + ".lock")


def test_a_removed_lock_file_lets_no_second_daemon_take_the_socket(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    first = daemons.start([checkpoints.single])
    lock = first.socket + ".lock"
    os.unlink(lock)

    second = run_cli("preload", "--socket", first.socket)

    assert second.returncode == 1, second.stderr
    # Refused by the probe, or by the lock file the first daemon re-created meanwhile.
    assert f"weightcache preload: socket {first.socket} is served by " in second.stderr
    wait_until(lambda: os.path.exists(lock), 10.0)
    assert Path(lock).read_text() == f"{first.pid}\n"
    assert health(first.socket) == "SERVING"
    third = run_cli("preload", "--socket", first.socket)
    assert third.returncode == 1
    assert f"is served by another daemon (pid {first.pid})" in third.stderr


def test_a_removed_socket_turns_every_health_service_not_serving_and_stops(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single], args=["--health-listen", "127.0.0.1:0"])
    port = daemon.bound_port("health")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        wait_until(
            lambda: (
                stub.Check(health_pb2.HealthCheckRequest(service="readiness")).status == SERVING
            ),
            30.0,
        )
        streams = {
            name: stub.Watch(health_pb2.HealthCheckRequest(service=name), timeout=60)
            for name in SERVICES
        }
        assert {name: next(s).status for name, s in streams.items()} == dict.fromkeys(
            SERVICES, SERVING
        )

        os.unlink(daemon.socket)

        assert {name: next(s).status for name, s in streams.items()} == dict.fromkeys(
            SERVICES, NOT_SERVING
        )
    assert daemon.proc.wait(30) == 1
    log = daemon.log()
    assert "socket lost: stopping" in log and "the socket file was removed" in log
    assert f"socket {daemon.socket}: the socket file was removed; stopped" in log
    assert daemon.leftovers() == []
    forget(daemons, daemon)


def test_a_replaced_socket_is_left_to_its_new_owner(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single])
    other = str(Path(daemons.sock_dir) / "other.sock")
    with socketlib.socket(socketlib.AF_UNIX) as newcomer:
        newcomer.bind(other)
        inode = os.stat(other).st_ino
        os.rename(other, daemon.socket)  # the path now names another socket

        assert daemon.proc.wait(30) == 1
        assert "the socket path names another file" in daemon.log()
        # Its own lock file and segments are gone; the newcomer's socket stays.
        assert os.path.exists(daemon.socket)
        assert os.stat(daemon.socket).st_ino == inode
        assert not os.path.exists(daemon.socket + ".lock")
        assert daemon.segments() == []
    os.unlink(daemon.socket)
    forget(daemons, daemon)
