"""One daemon per socket: an flock'd lock file beside the socket, that survives cleaners.

Only the lock holder may remove a stale socket file or the shared-memory segments a dead
predecessor left behind. The lock file holds the owner's pid so that a second daemon can
say who it collided with.

A lock file is a path, and a path can be deleted under a live daemon (``systemd-tmpfiles``
age cleanup, or anyone): a second daemon would then lock a new file at the same path. So:

- the holder also takes a shared ``flock`` on the socket's folder, which
  ``systemd-tmpfiles`` honours by not aging that folder's contents (tmpfiles.d(5),
  "Age": a directory locked with ``flock(2)`` is skipped); shared, so that the daemons of
  several sockets in one folder (``cpu.sock``, ``GPU-….sock``) can all hold it;
- a daemon that gets the lock still refuses the socket when a daemon answers on it
  (``connect(2)`` succeeds): the lock file of that live daemon was removed;
- the holder checks its lock file as it serves (:meth:`SocketLock.keep`) and re-creates it
  when it is gone, and removes at exit only a lock file that is still its own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time


class SocketInUseError(RuntimeError):
    """Another live daemon holds the socket's lock, or answers on the socket."""


class SocketLostError(RuntimeError):
    """The socket path stopped being this daemon's while it served (the file removed or
    replaced, or its lock file taken): it stopped."""


class SocketLock:
    """The exclusive lock for ``<socket>.lock``; released on :meth:`release` or exit.

    Raises:
        SocketInUseError: another process holds the lock (the message names its pid), or
            a daemon answers on the socket although its lock file is gone.
        OSError: the socket's folder cannot be opened.
    """

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.path = socket_path + ".lock"
        self._folder = os.open(
            os.path.dirname(os.path.abspath(socket_path)),
            os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC,
        )
        try:
            # tmpfiles.d(5): systemd-tmpfiles does not age a folder locked with flock(2).
            # Best effort: a cleaner holding it exclusively for a moment must not stop us,
            # and the probe below is the guard against a removed lock file.
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(self._folder, fcntl.LOCK_SH | fcntl.LOCK_NB)
            self._fd = self._lock()
            if answers(socket_path):
                self._drop_own_file()
                raise SocketInUseError(
                    f"socket {socket_path} is served by a live daemon whose lock file "
                    f"{self.path} was removed; stop that daemon first"
                )
        except BaseException:
            os.close(self._folder)
            raise

    def _lock(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _owner(fd)
                os.close(fd)
                raise SocketInUseError(
                    f"socket {self.socket_path} is served by another daemon (pid {owner})"
                ) from None
            # The previous holder unlinks the file as it exits: a lock on an unlinked file
            # is no lock. Keep it only if the path still names the file we locked.
            if _names(self.path, fd):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
            os.close(fd)

    def keep(self) -> bool:
        """Check that the lock file is still ours, re-creating it if it was removed; False
        when another process now holds a lock at its path (the socket is no longer
        ours to serve)."""
        if _names(self.path, self._fd):
            return True
        try:
            fd = self._lock()
        except SocketInUseError:
            return False
        os.close(self._fd)
        self._fd = fd
        return True

    def _drop_own_file(self) -> None:
        if _names(self.path, self._fd):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self._fd)

    def release(self) -> None:
        """Remove the lock file, if it is still ours, and release the locks."""
        self._drop_own_file()
        os.close(self._folder)


def answers(socket_path: str) -> bool:
    """Whether a process accepts connections on the Unix socket ``socket_path`` now."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(socket_path)
    except OSError as exc:
        # A full backlog (EAGAIN) or a slow accept is a live listener all the same.
        return exc.errno in (errno.EAGAIN, errno.ETIMEDOUT) or isinstance(exc, TimeoutError)
    finally:
        probe.close()
    return True


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` names the file open as ``fd``."""
    try:
        here, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def _owner(fd: int) -> str:
    # The holder writes its pid just after locking: give it a moment.
    for _ in range(20):
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.005)
    return "unknown"
