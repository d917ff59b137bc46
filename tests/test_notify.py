"""``Type=notify``: a real daemon's ``sd_notify`` datagrams, received on a datagram socket
bound as its ``$NOTIFY_SOCKET`` (as systemd does)."""

from __future__ import annotations

import contextlib
import socket as socketlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Checkpoints, DaemonPool, get_model, write_malformed
from weightcache_service.notify import Notifier

#: $WATCHDOG_USEC: a 0.4 s watchdog, so a ping every 0.2 s.
WATCHDOG_USEC = 400_000


class Listener:
    """A bound datagram socket that collects what is sent to it."""

    def __init__(self, sock: socketlib.socket) -> None:
        self.sock = sock
        self.messages: list[str] = []

    def wait_for(self, field: str, timeout: float = 60.0) -> list[str]:
        """Read until a message holding ``field`` (a line) arrives; returns all so far.

        Raises:
            AssertionError: none within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while not any(field in m.split("\n") for m in self.messages):
            left = deadline - time.monotonic()
            assert left > 0, f"no {field} within {timeout} s: {self.messages}"
            self.sock.settimeout(left)
            with contextlib.suppress(TimeoutError):
                self.messages.append(self.sock.recv(4096).decode())
        return self.messages

    def drain(self) -> list[str]:
        """Everything sent so far, without waiting."""
        self.sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                self.messages.append(self.sock.recv(4096).decode())
        self.sock.setblocking(True)
        return self.messages


@pytest.fixture
def notify(daemons: DaemonPool) -> Iterator[tuple[str, Listener]]:
    path = daemons.socket("notify")
    with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM) as sock:
        sock.bind(path)
        try:
            yield path, Listener(sock)
        finally:
            Path(path).unlink()


def test_ready_watchdog_and_stopping(
    daemons: DaemonPool, checkpoints: Checkpoints, notify: tuple[str, Listener]
) -> None:
    path, listener = notify
    daemon = daemons.start(
        [checkpoints.single],
        env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": str(WATCHDOG_USEC)},
        wait=False,
    )

    listener.wait_for("READY=1")
    # While the start-up preload ran, the start timeout was extended (large checkpoints).
    [ready] = [m for m in listener.messages if "READY=1" in m.split("\n")]
    before = listener.messages[: listener.messages.index(ready)]
    assert "EXTEND_TIMEOUT_USEC=60000000" in before
    assert ready.split("\n") == ["READY=1", "STATUS=serving 1 model(s)", f"MAINPID={daemon.pid}"]
    listener.messages.clear()
    listener.wait_for("WATCHDOG=1", timeout=5)  # pings go on after READY
    assert set(listener.messages) == {"WATCHDOG=1"}

    assert daemon.stop() == 0
    stopping = [m for m in listener.drain() if "STOPPING=1" in m.split("\n")]
    assert stopping == ["STOPPING=1\nSTATUS=draining"]


def test_no_ready_while_a_required_model_failed(
    daemons: DaemonPool, checkpoints: Checkpoints, notify: tuple[str, Listener], tmp_path: Path
) -> None:
    path, listener = notify
    bad = write_malformed(tmp_path / "bad", "invalid-json")
    daemon = daemons.start([checkpoints.single, bad], env={"NOTIFY_SOCKET": path})  # ended

    time.sleep(1.0)  # readiness is re-evaluated every 0.2 s: give it a few turns
    messages = listener.drain()
    assert "EXTEND_TIMEOUT_USEC=60000000" in messages  # the daemon did notify...
    assert [m for m in messages if "READY=1" in m.split("\n")] == []  # ...but never READY
    # ...and says why (issue 28, item 8): systemctl status shows it while the unit waits.
    [status] = [m for m in messages if m.startswith("STATUS=not ready")]
    error = get_model(daemon.socket, "bad").error
    assert status == f"STATUS=not ready: 1 model(s) FAILED: bad: {error}"


def test_without_notify_socket_nothing_is_sent(
    notify: tuple[str, Listener], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, listener = notify
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    silent = Notifier.from_env()
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    told = Notifier.from_env()
    monkeypatch.setenv("WATCHDOG_PID", "1")  # the watchdog is another process's
    other = Notifier.from_env()

    assert (silent.address, silent.watchdog_interval) == (None, None)
    assert silent.send("READY=1") is False
    assert (told.address, told.watchdog_interval) == (path, 1.0)
    assert told.send("READY=1", "STATUS=x") is True
    assert other.watchdog_interval is None
    assert listener.drain() == ["READY=1\nSTATUS=x"]  # the one send with a socket
