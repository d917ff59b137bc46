"""Every signal that would end the daemon by default either drains and stops it or is
logged and ignored (issue 27, item 8; :mod:`weightcache_service.signals`)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.support import Checkpoints, DaemonPool, health, wait_until
from weightcache.testing.daemon import wait_or_kill
from weightcache_service.signals import IGNORED, STOP, name


def test_ignored_signals_leave_the_daemon_serving(
    daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single])
    names = [name(signum) for signum in IGNORED]
    assert names[:3] == ["SIGHUP", "SIGUSR1", "SIGALRM"]  # SIGUSR2 hands over (test_handover)

    for signum in IGNORED:
        os.kill(daemon.pid, signum)
    wait_until(lambda: daemon.log().count("signal ignored") >= len(IGNORED), timeout=30)

    assert daemon.proc.poll() is None
    assert health(daemon.socket) == "SERVING"
    lines = [line for line in daemon.log().splitlines() if "signal ignored" in line]
    for signame in names:
        assert sum(f"signal={signame} " in f"{line} " for line in lines) == 1, (signame, lines)
    assert daemon.segments() != []
    assert daemon.stop() == 0  # and the pool checks it left nothing behind


@pytest.mark.parametrize("signum", STOP, ids=[s.name for s in STOP])
def test_stop_signals_drain_and_clean_up(
    daemons: DaemonPool, checkpoints: Checkpoints, signum: signal.Signals
) -> None:
    daemon = daemons.start([checkpoints.single])
    assert daemon.segments() != []

    daemon.proc.send_signal(signum)

    assert not wait_or_kill(daemon.proc), daemon.log()
    assert daemon.proc.returncode == 0, daemon.log()
    assert daemon.leftovers() == []
    log = daemon.log()
    assert any(
        f"signal={signum.name}" in line and "drain and stop" in line for line in log.splitlines()
    ), log
    assert "stopped" in log
