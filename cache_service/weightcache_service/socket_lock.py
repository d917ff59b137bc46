"""One daemon per socket: an flock'd lock file beside the socket.

Only the lock holder may remove a stale socket file or the shared-memory segments a dead
predecessor left behind. The lock file holds the owner's pid so that a second daemon can
say who it collided with.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time


class SocketInUseError(RuntimeError):
    """Another live daemon holds the socket's lock."""


class SocketLock:
    """The exclusive lock for ``<socket>.lock``; released on :meth:`release` or exit.

    Raises:
        SocketInUseError: another process holds the lock; the message names its pid.
    """

    def __init__(self, socket_path: str) -> None:
        self.path = socket_path + ".lock"
        while True:
            self._fd = os.open(
                self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = self._owner()
                os.close(self._fd)
                raise SocketInUseError(
                    f"socket {socket_path} is served by another daemon (pid {owner})"
                ) from None
            # The previous holder unlinks the file as it exits: a lock on an unlinked file
            # is no lock. Keep it only if the path still names the file we locked.
            if self._still_linked():
                break
            os.close(self._fd)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def _still_linked(self) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return False

    def _owner(self) -> str:
        # The holder writes its pid just after locking: give it a moment.
        for _ in range(20):
            text = os.pread(self._fd, 32, 0).decode(errors="replace").strip()
            if text:
                return text
            time.sleep(0.005)
        return "unknown"

    def release(self) -> None:
        """Remove the lock file and release the lock."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
