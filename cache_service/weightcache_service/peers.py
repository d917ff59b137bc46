"""Who is connected to the daemon's Unix socket, as the kernel says, and which connection
is a given worker's.

gRPC does not tell a handler which connection a call came on, nor the credentials of a
Unix-socket peer (grpc/grpc#28755). The daemon finds them itself: each connection it
accepted on its socket is a descriptor of its own process (``/proc/self/fd``), on which
``getsockopt(SO_PEERCRED)`` gives the connecting process's pid (in the daemon's pid
namespace; 0 when it is not visible there), uid and gid (unix(7)). A worker describes
itself in its Acquire with its pid *in its own namespace* and that namespace's inode
(``WorkerDescription``); ``/proc/<pid>/status`` (``NSpid``, proc(5)) and
``/proc/<pid>/ns/pid`` give the same two values of each connected process, so the
worker's connection is the one whose process has both. When the daemon cannot read a
peer's namespace (another user's process, without root) the pid alone decides, and when
several connected processes match, none is named.

Linux only (procfs, ``SO_PEERCRED``); elsewhere no connection is found.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

from weightcache.core.records import PeerCredentials, WorkerDescription

_UCRED = struct.Struct("3i")  # struct ucred: pid_t pid; uid_t uid; gid_t gid (unix(7))


@dataclass(frozen=True)
class Connection:
    """One connection accepted on the daemon's Unix socket.

    Attributes:
        peer: its credentials (``SO_PEERCRED``).
        own_pid: the peer process's pid in its innermost pid namespace (the last
            ``NSpid`` value); 0 when unknown.
        pid_namespace: the inode of that namespace; 0 when the daemon may not read it.
    """

    peer: PeerCredentials
    own_pid: int
    pid_namespace: int


def connections(socket_path: str) -> list[Connection]:
    """Every connection this process accepted on the Unix socket ``socket_path``."""
    path = os.path.abspath(socket_path)
    found = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for name in names:
        peer = _peer_of(int(name), path)
        if peer is not None:
            found.append(Connection(peer, *_namespace_of(peer.pid)))
    return found


def _peer_of(fd: int, path: str) -> PeerCredentials | None:
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
            return None
        # A duplicate, closed here: the original stays gRPC's.
        with socket.socket(fileno=os.dup(fd)) as sock:
            if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                return None
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return None  # the listening socket itself
            bound = sock.getsockname()
            if os.fsdecode(bound) != path:
                return None
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None  # closed meanwhile, or not a socket after all
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


def _namespace_of(pid: int) -> tuple[int, int]:
    """``(pid in its innermost namespace, that namespace's inode)``, 0 for what is unknown."""
    if pid <= 0:
        return 0, 0
    own = 0
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    own = int(line.split()[-1])
                    break
    except (OSError, ValueError):
        return 0, 0
    try:
        inode = os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        inode = 0  # ptrace access is needed: another user's process
    return own, inode


def holder(worker: WorkerDescription, among: list[Connection]) -> PeerCredentials | None:
    """The credentials of the connection of the worker that described itself as
    ``worker``: the one process connected whose own pid and pid namespace are the
    worker's (the namespace compared when both are known); None when no connected
    process, or more than one, matches."""
    if worker.pid <= 0:
        return None
    matches = {
        c.peer
        for c in among
        if c.own_pid == worker.pid
        and (
            0 in (c.pid_namespace, worker.pid_namespace) or c.pid_namespace == worker.pid_namespace
        )
    }
    return matches.pop() if len(matches) == 1 else None
