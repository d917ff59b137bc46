"""A registry of this process's own objects, emptied in a forked child."""

from __future__ import annotations

import os
import threading
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class PerProcess(Generic[K, V]):
    """Objects of this process by key, emptied in a forked child: what a parent made (a
    gRPC channel, a KeepAlive thread, a lease it renews) is the parent's, and a child
    that used it would speak over a connection or hold leases it does not own. The
    process's pid, checked at each use, tells a child: it sees every kind of fork, where
    ``os.register_at_fork`` sees only Python's own.

    Use: ``with registry.lock: entries = registry.entries()``.
    """

    def __init__(self) -> None:
        #: Held while reading or changing :meth:`entries`.
        self.lock = threading.Lock()
        self._pid = os.getpid()
        self._entries: dict[K, V] = {}
        # A lock held by another thread at a fork stays held in the child, by no one.
        os.register_at_fork(after_in_child=self._reset_lock)

    def _reset_lock(self) -> None:
        self.lock = threading.Lock()

    def entries(self) -> dict[K, V]:
        """This process's entries, the dict itself (call with :attr:`lock` held)."""
        if self._pid != os.getpid():
            self._entries = {}
            self._pid = os.getpid()
        return self._entries
