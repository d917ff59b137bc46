"""``sd_notify``: tell systemd (``Type=notify``) that the daemon is ready, stopping, alive.

The protocol is a datagram of ``KEY=VALUE`` lines to the Unix socket named by
``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace); see sd_notify(3).
It is a few lines, so it is written here rather than pulled in as a C binding. Without
``$NOTIFY_SOCKET`` (not under systemd) every call does nothing.

The daemon sends ``READY=1`` once its required models are READY (the readiness health
service turns SERVING), ``EXTEND_TIMEOUT_USEC=`` while start-up preloads run (a large
checkpoint may take longer than ``TimeoutStartSec=``), ``STOPPING=1`` when a drain
begins, and, when systemd set
``WatchdogSec=`` (``$WATCHDOG_USEC``), ``WATCHDOG=1`` every half period from the event
loop, so that a loop that stops answering gets the daemon restarted.
"""

from __future__ import annotations

import os
import socket

import structlog

log = structlog.get_logger("weightcache.daemon")


class Notifier:
    """Sends ``sd_notify`` messages to one address.

    Args:
        address: the ``$NOTIFY_SOCKET`` value, or None to send nothing.
        watchdog_usec: the ``$WATCHDOG_USEC`` value (microseconds), or None.
    """

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address or None
        self.watchdog_usec = watchdog_usec

    @classmethod
    def from_env(cls) -> Notifier:
        """The notifier systemd asked for through the environment: ``$NOTIFY_SOCKET``, and
        ``$WATCHDOG_USEC`` when ``$WATCHDOG_PID`` is unset or this process's pid."""
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        watchdog = int(usec) if usec.isdigit() and int(usec) > 0 and mine else None
        return cls(os.environ.get("NOTIFY_SOCKET"), watchdog)

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between ``WATCHDOG=1`` pings (half the period), or None: no watchdog."""
        if self.watchdog_usec is None or self.address is None:
            return None
        return self.watchdog_usec / 2e6

    def send(self, *fields: str) -> bool:
        """Send ``fields`` (``"READY=1"``...) as one datagram; returns whether it was sent.
        A failure is logged, never raised: systemd's absence must not stop the daemon."""
        if self.address is None:
            return False
        # "@name" is an abstract socket: the name starts with a NUL byte.
        address = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto("\n".join(fields).encode(), address)
        except OSError as exc:
            log.warning("sd_notify failed", address=self.address, error=str(exc))
            return False
        return True
