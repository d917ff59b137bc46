"""Who may reach the daemon: the socket's folder and mode, the optional group, TCP rules.

- The socket lives in a folder the daemon creates (0700, or 0750 with ``--group``) or
  verifies: owned by the daemon's user, not a symlink, not writable by group or others.
  The socket itself is 0600, or 0660 with ``--group``.
- Shared-memory segments are 0600, or 0640 and owned by the group with ``--group``.
- TCP needs TLS; plaintext TCP (``--insecure``) binds loopback addresses only. Which RPCs
  a TCP peer may call is :mod:`weightcache_service.authz`'s business.
"""

from __future__ import annotations

import grp
import ipaddress
import os
import pwd
import stat
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from weightcache.core.sockets import MAX_SOCKET_PATH

#: Milliseconds a new connection gets to finish its handshake (TLS and HTTP/2's preface
#: and settings; gRPC's default is 120 s): a peer that connects and sends nothing holds a
#: descriptor no longer.
HANDSHAKE_TIMEOUT_MS = 5_000
#: Milliseconds a connection may stay without a call before the server closes it with a
#: GOAWAY (gRPC's ``grpc.max_connection_idle_ms``; a client reconnects when it calls).
MAX_CONNECTION_IDLE_MS = 60_000
#: Server options that bound what idle connections hold, on every listener.
#: Calls (HTTP/2 streams) one connection may have open at once; a client queues the rest.
MAX_CONCURRENT_STREAMS = 128
CONNECTION_OPTIONS = [
    ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
    ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
    ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
    # No bandwidth-delay probing: each stream's receive window stays at gRPC's 64 KiB
    # lookahead instead of growing to megabytes, so what a stream the daemon does not read
    # (a paced KeepAlive flood) can make it buffer stays small. Requests are small (4 MiB
    # at most); what the daemon sends is paced by its clients' windows, not this one.
    ("grpc.http2.bdp_probe", 0),
]
#: Connections one TCP listener (``--listen``, ``--health-listen``, ``--metrics-listen``)
#: holds at once; one more is closed as soon as it is accepted. gRPC's
#: ``grpc.max_allowed_incoming_connections`` counts per listener (each port of a server);
#: the Unix socket, on a server of its own, is not bounded.
MAX_TCP_CONNECTIONS = 256
#: File descriptors kept out of the TCP listeners' reach (of the soft ``RLIMIT_NOFILE``):
#: for the Unix socket's workers and for loads (checkpoint files, segments).
FD_RESERVE = 512


def tcp_connection_bound(soft_limit: int, listeners: int) -> int:
    """Connections each of ``listeners`` TCP listeners may hold so that together they
    leave :data:`FD_RESERVE` of ``soft_limit`` descriptors: at most
    :data:`MAX_TCP_CONNECTIONS`, at least 1."""
    if listeners <= 0:
        return MAX_TCP_CONNECTIONS
    return max(1, min(MAX_TCP_CONNECTIONS, (soft_limit - FD_RESERVE) // listeners))


def tcp_server_options(max_connections: int) -> list[tuple[str, int]]:
    """gRPC server options of a TCP listener: :data:`CONNECTION_OPTIONS` and at most
    ``max_connections`` connections at once."""
    return [*CONNECTION_OPTIONS, ("grpc.max_allowed_incoming_connections", max_connections)]


class AccessError(RuntimeError):
    """The socket folder, group or listen address is unusable or unsafe."""


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
            AccessError: no such group, or the daemon's user is neither root nor a member
                of it (chown(2) lets an unprivileged owner give a file only to one of its
                own groups).
        """
        if name is None:
            return cls()
        try:
            gid = grp.getgrnam(name).gr_gid
        except KeyError:
            raise AccessError(f"no group named {name!r}") from None
        if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
            raise AccessError(_not_member(gid))
        return cls(gid)

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
            AccessError: the absolute path (the one bound) is too long; the folder is a
                symlink, not a folder, owned by another user, or writable by group or
                others; the folder cannot be given to the group.
        """
        bound = os.path.abspath(socket)
        if len(os.fsencode(bound)) > MAX_SOCKET_PATH:
            raise AccessError(
                f"socket path is over {MAX_SOCKET_PATH} bytes once made absolute "
                f"({len(os.fsencode(bound))} bytes): {bound}; use a shorter --socket"
            )
        folder = os.path.dirname(bound)
        if not os.path.lexists(folder):
            os.makedirs(folder, mode=0o755, exist_ok=True)
            os.chmod(folder, self.folder_mode)
            self._chgrp(folder)
        info = os.lstat(folder)
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
            raise AccessError(f"socket folder {folder} is a symlink or not a folder")
        if info.st_uid != os.geteuid():
            raise AccessError(f"socket folder {folder} belongs to uid {info.st_uid}, not us")
        if self.gid is not None and (info.st_gid != self.gid or info.st_mode & 0o050 != 0o050):
            # Our folder (say systemd's RuntimeDirectory, 0700): open it to the group.
            self._chgrp(folder)
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
        """Set ``mode`` and, with a group, the group of a socket or segment.

        Raises:
            AccessError: the daemon's user may not give the file to the group.
        """
        os.chmod(path, mode)
        self._chgrp(path)

    def _chgrp(self, path: str) -> None:
        if self.gid is None:
            return
        try:
            os.chown(path, -1, self.gid)
        except PermissionError:
            raise AccessError(f"cannot give {path} to the group: {_not_member(self.gid)}") from None


def _not_member(gid: int) -> str:
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        user = str(os.geteuid())
    return (
        f"--group {group}: the daemon's user {user} is not a member of group {group}; "
        f"add {user} to {group} (and log in again) or run the daemon as root"
    )


#: The largest TCP port number (RFC 793: 16 bits).
MAX_PORT = 65535


def parse_listen(address: str, flag: str = "--listen") -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` for IPv6), given with the option ``flag``.

    Raises:
        AccessError: not of that form, or the port is above 65535.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise AccessError(f"{flag} {address!r}: use HOST:PORT")
    if int(port) > MAX_PORT:
        raise AccessError(f"{flag} {address!r}: the port is above {MAX_PORT}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (IPv4-mapped ones included) or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return _loopback(ipaddress.ip_address(host))
    except ValueError:
        return False


def _loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    # ::ffff:127.0.0.1 is IPv4 loopback seen through a dual-stack socket.
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def peer_address(peer: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address of a gRPC peer string, or None for a non-IP peer or a malformed one.

    gRPC names a peer by a URI (its ``grpc_sockaddr_to_uri``): ``ipv4:127.0.0.1:5``,
    ``ipv6:%5B::1%5D:5`` (the brackets percent-encoded), ``unix:/path``,
    ``unix-abstract:name``.
    """
    scheme, sep, rest = peer.partition(":")
    if not sep or scheme not in ("ipv4", "ipv6"):
        return None
    try:
        host = urllib.parse.urlsplit("//" + urllib.parse.unquote(rest)).hostname
        return ipaddress.ip_address(host) if host else None
    except ValueError:
        return None


def peer_is_unix(peer: str) -> bool:
    """Whether a gRPC peer string (``context.peer()``) names a Unix-socket client."""
    return peer.startswith(("unix:", "unix-abstract:"))


def peer_is_local(peer: str) -> bool:
    """Whether a gRPC peer (see :func:`peer_address`) is on this host: a Unix socket or a
    loopback address."""
    if peer_is_unix(peer):
        return True
    ip = peer_address(peer)
    return ip is not None and _loopback(ip)
