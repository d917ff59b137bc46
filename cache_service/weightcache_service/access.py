"""Who may reach the daemon: the socket's folder and mode, the optional group, TCP rules.

- The socket lives in a folder the daemon creates (0700, or 0750 with ``--group``) or
  verifies: owned by the daemon's user, not a symlink, not writable by group or others.
  The socket itself is 0600, or 0660 with ``--group``.
- Shared-memory segments are 0600, or 0640 and owned by the group with ``--group``.
- TCP needs TLS; plaintext TCP (``--insecure``) binds loopback addresses only.
"""

from __future__ import annotations

import grp
import ipaddress
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass


class AccessError(RuntimeError):
    """The socket folder, group or listen address is unusable or unsafe."""


#: sockaddr_un.sun_path is 108 bytes including the terminating NUL (unix(7)).
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class Access:
    """The permissions the daemon applies.

    Attributes:
        gid: group allowed to connect and map segments, or None for the owner only.
    """

    gid: int | None = None

    @classmethod
    def for_group(cls, name: str | None) -> Access:
        """Resolve ``--group``.

        Raises:
            AccessError: no such group.
        """
        if name is None:
            return cls()
        try:
            return cls(grp.getgrnam(name).gr_gid)
        except KeyError:
            raise AccessError(f"no group named {name!r}") from None

    @property
    def folder_mode(self) -> int:
        """0700, or 0750 with a group."""
        return 0o750 if self.gid is not None else 0o700

    @property
    def socket_mode(self) -> int:
        """0600, or 0660 with a group."""
        return 0o660 if self.gid is not None else 0o600

    @property
    def segment_mode(self) -> int:
        """0600, or 0640 with a group."""
        return 0o640 if self.gid is not None else 0o600

    def prepare_folder(self, socket: str) -> None:
        """Create or verify the socket's folder.

        Raises:
            AccessError: the path is too long; the folder is a symlink, not a folder, owned
                by another user, or writable by group or others.
        """
        if len(os.fsencode(socket)) > MAX_SOCKET_PATH:
            raise AccessError(f"socket path is over {MAX_SOCKET_PATH} bytes: {socket}")
        folder = os.path.dirname(os.path.abspath(socket))
        if not os.path.lexists(folder):
            os.makedirs(folder, mode=0o755, exist_ok=True)
            os.chmod(folder, self.folder_mode)
            if self.gid is not None:
                os.chown(folder, -1, self.gid)
        info = os.lstat(folder)
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
            raise AccessError(f"socket folder {folder} is a symlink or not a folder")
        if info.st_uid != os.geteuid():
            raise AccessError(f"socket folder {folder} belongs to uid {info.st_uid}, not us")
        if self.gid is not None and (info.st_gid != self.gid or info.st_mode & 0o050 != 0o050):
            # Our folder (say systemd's RuntimeDirectory, 0700): open it to the group.
            os.chown(folder, -1, self.gid)
            os.chmod(folder, (stat.S_IMODE(info.st_mode) | 0o050) & ~0o022)
            info = os.lstat(folder)
        if info.st_mode & 0o022:
            raise AccessError(
                f"socket folder {folder} is writable by others (mode "
                f"{stat.S_IMODE(info.st_mode):o}); use a folder only the daemon can write"
            )
        # Never remove or truncate a file that is not ours to replace. A stale socket, or a
        # symlink planted at its path (unlinking removes the link, never its target), is.
        self._check_replaceable(socket, lambda m: stat.S_ISSOCK(m) or stat.S_ISLNK(m))
        self._check_replaceable(socket + ".lock", stat.S_ISREG)

    @staticmethod
    def _check_replaceable(path: str, kind: Callable[[int], bool]) -> None:
        try:
            found = os.lstat(path)
        except FileNotFoundError:
            return
        if not kind(found.st_mode) or found.st_uid != os.geteuid():
            raise AccessError(f"{path} exists and is not a daemon's socket or lock file")

    def secure_path(self, path: str, mode: int) -> None:
        """Set ``mode`` and, with a group, the group of a socket or segment."""
        os.chmod(path, mode)
        if self.gid is not None:
            os.chown(path, -1, self.gid)


def parse_listen(address: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` for IPv6).

    Raises:
        AccessError: not of that form.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise AccessError(f"--listen {address!r}: use HOST:PORT")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def peer_is_local(peer: str) -> bool:
    """Whether a gRPC peer string (``unix:...``, ``ipv4:127.0.0.1:5``, ``ipv6:[::1]:5``)
    is on this host."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind in ("ipv4", "ipv6"):
        host = rest.rpartition(":")[0].strip("[]")
        return is_loopback(host)
    return False
