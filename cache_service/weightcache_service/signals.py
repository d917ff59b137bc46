"""What the daemon does on each signal whose default action would end it.

A signal's default action (signal(7): "Term" or "Core") ends the process at once: no
drain, the socket and the /dev/shm segments left behind. The daemon handles every such
signal that a service manager, a terminal or an operator may send:

- :data:`STOP` (SIGTERM, SIGINT, SIGQUIT, SIGXCPU): drain and stop, as documented for
  SIGTERM (README, "Running the daemon"; docs/leases.md, "Drain"); a second one cuts the
  drain short. SIGXCPU is the kernel's warning that the soft CPU limit is spent, before
  the SIGKILL at the hard one: the time left goes to a clean exit.
- :data:`HAND_OVER` (SIGUSR2): stop and leave the arenas and leases to the next daemon
  (hand-over, README "Restarts and upgrades"); SIGTERM does so too under ``--hand-over``.
- :data:`IGNORED` (SIGHUP, SIGUSR1, SIGALRM, SIGVTALRM, SIGPROF, SIGIO, SIGPWR,
  SIGSTKFLT and the real-time signals): logged and ignored. The daemon has no
  configuration to reload, so SIGHUP (a closed terminal, ``systemctl reload``, systemd's
  ``SendSIGHUP=`` right after SIGTERM) must neither kill it nor cut its drain short.

Left at their defaults: SIGKILL and SIGSTOP (cannot be caught); SIGABRT, SIGSEGV, SIGBUS,
SIGILL, SIGFPE, SIGTRAP, SIGSYS (a fault or an abort: the process must not go on; systemd's
watchdog sends SIGABRT for a core dump); SIGTSTP, SIGTTIN, SIGTTOU, SIGCONT (stop and
continue, nothing ends); SIGPIPE and SIGXFSZ (Python ignores them: a write fails instead).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import structlog

log = structlog.get_logger("weightcache.daemon")

#: Drain and stop (a second one skips the rest of the drain).
STOP: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGXCPU,
)
#: Stop with a hand-over of the arenas to the next daemon.
HAND_OVER: tuple[signal.Signals, ...] = (signal.SIGUSR2,)
#: Logged and ignored.
IGNORED: tuple[int, ...] = (
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGALRM,
    signal.SIGVTALRM,
    signal.SIGPROF,
    signal.SIGIO,
    signal.SIGPWR,
    signal.SIGSTKFLT,
    *range(signal.SIGRTMIN, signal.SIGRTMAX + 1),
)


def name(signum: int) -> str:
    """``SIGHUP``, or ``SIGRTMIN+3`` for a real-time signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}"


def ignore_early() -> None:
    """Ignore :data:`IGNORED` from now on, before the event loop runs (the daemon takes
    seconds to import and to open its backend; a SIGHUP then must not end it either)."""
    for signum in IGNORED:
        signal.signal(signum, signal.SIG_IGN)


def install(
    loop: asyncio.AbstractEventLoop,
    stop: Callable[[int], None],
    hand_over: Callable[[], None],
) -> None:
    """Handle every signal of :data:`STOP` with ``stop(signum)``, those of
    :data:`HAND_OVER` with ``hand_over()``, and log those of :data:`IGNORED`, on ``loop``
    (its handlers run on the loop, between callbacks)."""

    def stopping(signum: int) -> None:
        log.info("signal", signal=name(signum), action="drain and stop")
        stop(signum)

    def handing_over(signum: int) -> None:
        log.info("signal", signal=name(signum), action="hand over and stop")
        hand_over()

    def ignored(signum: int) -> None:
        log.warning("signal ignored", signal=name(signum), hint="SIGTERM stops the daemon")

    for stop_signal in STOP:
        loop.add_signal_handler(stop_signal, stopping, stop_signal)
    for hand_over_signal in HAND_OVER:
        loop.add_signal_handler(hand_over_signal, handing_over, hand_over_signal)
    for signum in IGNORED:
        loop.add_signal_handler(signum, ignored, signum)
