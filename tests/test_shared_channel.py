"""A process keeps one gRPC channel per daemon socket (``weightcache.core.rpc.shared``):
its Acquires, its KeepAlive stream and its Releases share one connection; a channel that
stops reaching the daemon is retired, so the next load connects afresh instead of waiting
out gRPC's reconnect backoff."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from safetensors.torch import load_file

import weightcache
from tests.support import Checkpoints, DaemonPool, WorkerPool, assert_bitwise_equal, wait_until
from weightcache._lease import live_session
from weightcache.core import rpc

RETIRE_TIMEOUT = 10.0
#: Seconds for a KeepAlive stream that was cancelled to have ended and said so.
STREAM_SETTLE = 1.0


def _shared_now(socket: str) -> object | None:
    with rpc._shared.lock:
        opened = rpc._shared.entries().get(socket)
    return None if opened is None else opened[0]


def test_loads_keepalive_and_releases_share_one_channel_until_the_daemon_goes(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single])

    first = weightcache.load(checkpoints.single, socket=daemon.socket)
    channel = _shared_now(daemon.socket)
    session = live_session(daemon.socket)
    second = weightcache.load(checkpoints.single, socket=daemon.socket)
    second.close()

    assert (first.source, second.source) == ("cache", "cache")
    assert channel is not None
    assert session is not None and session._channel is channel
    assert _shared_now(daemon.socket) is channel  # the Release used it too
    assert_bitwise_equal(first.tensors, checkpoints.tensors)
    first.close()
    assert daemon.stop() == 0
    # The KeepAlive stream ends with the daemon and retires the channel.
    wait_until(lambda: _shared_now(daemon.socket) is None, RETIRE_TIMEOUT)
    assert not session.alive


def test_a_worker_attaches_at_once_when_its_daemon_is_back_after_a_crash(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    socket = daemons.socket("back")
    daemon = daemons.start([checkpoints.single], socket=socket)
    worker = workers.start()
    before = worker.load(checkpoints.single, socket=socket)
    assert worker.request("close", key="w")["ok"]
    daemon.kill()  # its socket file stays: a channel now fails to connect, then backs off

    away = worker.load(checkpoints.single, socket=socket, key="away")
    daemons.start([checkpoints.single], socket=socket)
    back = worker.load(checkpoints.single, socket=socket, key="back", dump=tmp_path / "w")

    assert before["source"] == "cache"
    assert (away["source"], away["fallback_reason"]["code"]) == ("disk", "DAEMON_UNAVAILABLE")
    assert back["ok"] and back["source"] == "cache", back
    assert_bitwise_equal(load_file(tmp_path / "w"), checkpoints.tensors)


def test_a_call_that_times_out_leaves_the_channel_and_the_other_leases(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    """A daemon too slow to answer (stopped) makes a Release time out. The channel, which
    carries the KeepAlive stream, is not retired for that: the other lease lives on."""
    daemon = daemons.start([checkpoints.single])
    first = weightcache.load(checkpoints.single, socket=daemon.socket, ttl=60.0)
    # Short: its Release is lost to the stall, so the daemon ends it by its TTL instead.
    second = weightcache.load(checkpoints.single, socket=daemon.socket, ttl=2.0)
    channel = _shared_now(daemon.socket)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        second.close()  # its Release runs into RPC_TIMEOUT; a close says nothing of it
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    time.sleep(STREAM_SETTLE)  # a cancelled stream declares its leases lost at once

    session = live_session(daemon.socket)
    assert _shared_now(daemon.socket) is channel
    assert session is not None and session.alive
    assert first.lease is not None and first.lease.lost is None
    again = weightcache.load(checkpoints.single, socket=daemon.socket)
    assert again.source == "cache"
    again.close()
    first.close()
