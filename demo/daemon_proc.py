"""Run a ``weightcache preload`` daemon as a child process, for the demo and the benchmarks.

The daemon is started as ``sys.executable -m weightcache_service.cli`` (no PATH needed), in
its own session so that a Ctrl-C in the terminal reaches only the parent, which then stops
it with SIGTERM. Its stdout and stderr go to a log file, shown only when something fails.

:func:`run_with_daemon` is the frame of every script here (a temporary folder, a daemon in
it, stopped and checked and the folder removed whatever happens); :func:`run_child` runs a
worker in a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from weightcache_service.arena import SEGMENT_PREFIX, SHM_DIR
from weightcache_service.server import socket_tag

#: Seconds between readiness probes.
PROBE_INTERVAL = 0.2
#: Seconds one ``weightcache health`` probe may take.
PROBE_TIMEOUT = 10.0
#: Characters of the daemon log shown on failure.
LOG_TAIL_CHARS = 4000


class DaemonError(RuntimeError):
    """The daemon did not start, or did not stop cleanly; the message has its log tail."""


def cli(*args: str) -> list[str]:
    """The command line of ``weightcache ARGS...`` run with this interpreter."""
    return [sys.executable, "-m", "weightcache_service.cli", *args]


class DaemonProcess:
    """One daemon serving ``socket`` with ``models`` preloaded, logging to ``log_path``."""

    def __init__(self, models: list[str], socket: str, log_path: Path) -> None:
        self.models = models
        self.socket = socket
        self.log_path = log_path
        self.tag = socket_tag(socket)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> float:
        """Start the daemon and wait until ``weightcache health`` exits 0.

        Args:
            timeout: seconds to wait for readiness.

        Returns:
            Seconds from spawn to the first successful health probe (an upper bound: each
            probe is a fresh interpreter, about 1.5 s).

        Raises:
            DaemonError: it exited, or was not ready within ``timeout``.
        """
        begin = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cli("preload", *self.models, "--socket", self.socket),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        while not self._healthy():
            if self.proc.poll() is not None:
                raise DaemonError(f"daemon exited with status {self.proc.returncode}")
            if time.monotonic() - begin > timeout:
                raise DaemonError(f"daemon not ready after {timeout:.0f} s")
            time.sleep(PROBE_INTERVAL)
        return time.monotonic() - begin

    def _healthy(self) -> bool:
        if not os.path.exists(self.socket):
            return False
        probe = cli("health", "--socket", self.socket, "--timeout", "2")
        try:
            done = subprocess.run(probe, capture_output=True, timeout=PROBE_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def stop(self, timeout: float = 30.0) -> int | None:
        """Send SIGTERM and wait; SIGKILL after ``timeout`` seconds.

        Returns:
            The exit status (negative: killed by that signal), or None if never started.
        """
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def stop_and_check(self, show_log: bool) -> bool:
        """Stop with SIGTERM, print how it ended and whether it left anything; remove that.

        Prints the log (to stderr) when ``show_log`` or when the daemon did not stop cleanly.

        Returns:
            True when it exited 0 and left neither a segment nor the socket (or never ran).
        """
        status = self.stop()
        if status is None:
            return True
        left = self.remove_leftovers()
        print()
        print(f"  daemon sent SIGTERM: {self.describe()}")
        if left:
            print(f"  FAILED: it left behind (now removed): {', '.join(left)}")
        else:
            print(f"  socket removed; /dev/shm has no {SEGMENT_PREFIX}{self.tag}-* segment left")
        if show_log or status != 0 or left:
            print(f"--- daemon log ---\n{self.log_tail()}", file=sys.stderr)
        return status == 0 and not left

    def describe(self) -> str:
        """How the daemon ended, in words: ``exit status N`` or ``killed by SIGNAME``."""
        status = None if self.proc is None else self.proc.poll()
        if status is None:
            return "not started" if self.proc is None else "running"
        if status < 0:
            return f"killed by {signal.Signals(-status).name}"
        return f"exit status {status}"

    @property
    def pid(self) -> int | None:
        """The daemon's process id, once started."""
        return None if self.proc is None else self.proc.pid

    def segments(self) -> list[str]:
        """Paths of the shared-memory segments of daemons on this socket, sorted."""
        return sorted(glob.glob(os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{self.tag}-*")))

    def leftovers(self) -> list[str]:
        """What a cleanly stopped daemon must not leave: its segments and its socket."""
        left = self.segments()
        if os.path.lexists(self.socket):
            left.append(self.socket)
        return left

    def remove_leftovers(self) -> list[str]:
        """Remove :meth:`leftovers` (after a crash or a kill); returns what was removed."""
        removed = self.leftovers()
        for path in removed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return removed

    def log_tail(self) -> str:
        """The last :data:`LOG_TAIL_CHARS` characters of the daemon's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return text[-LOG_TAIL_CHARS:]


def run_child(
    command: list[str], what: str, timeout: float, error: type[Exception]
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to completion, its stdout and stderr captured as text.

    Args:
        command: the command line.
        what: the worker's name in the timeout message (``<what> worker ran over N s``).
        timeout: seconds it may take.
        error: the exception class raised when it runs over ``timeout``.

    Returns:
        The finished process, whatever its exit status.
    """
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise error(f"{what} worker ran over {timeout:.0f} s") from None


def _exit_on_sigterm(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)


def run_with_daemon(
    prefix: str,
    socket_name: str,
    body: Callable[[Path, DaemonProcess], bool],
    errors: tuple[type[Exception], ...] = (),
) -> bool:
    """Run ``body(tmp, daemon)`` with a fresh folder under /tmp and a daemon not yet started.

    SIGTERM becomes ``SystemExit``; a :class:`DaemonError` or one of ``errors`` is printed as
    ``FAILED: ...`` and a Ctrl-C as ``interrupted`` (to stderr). Whatever happens, the daemon
    is stopped and checked (:meth:`DaemonProcess.stop_and_check`, its log shown unless the
    body succeeded) and the folder removed.

    Args:
        prefix: of the temporary folder's name.
        socket_name: the daemon's socket, in that folder.
        body: sets ``daemon.models``, starts it and does the work; returns whether it passed.
        errors: exceptions that end the body with a message rather than a traceback.

    Returns:
        True when the body returned True and the daemon stopped cleanly.
    """
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    daemon = DaemonProcess([], str(tmp / socket_name), tmp / "daemon.log")
    expected: tuple[type[Exception], ...] = (DaemonError, *errors)
    ok = clean = False
    try:
        ok = body(tmp, daemon)
    except expected as err:
        print(f"FAILED: {err}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        clean = daemon.stop_and_check(show_log=not ok)
        shutil.rmtree(tmp, ignore_errors=True)
    return ok and clean
