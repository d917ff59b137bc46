"""Leases shared within a process: a ``load()`` that would send the very Acquire an open
one sent maps the daemon's arena again under the lease this process already holds.

Why it is safe to skip the Acquire: the daemon's answer cannot have changed. While a lease
is live its model is neither evicted nor replaced (a forced evict or a drain first revokes
the lease, and a revoked lease is not shared), and the answer depends on the request and
the model alone: the same files, by identity (device, inode, size, mtime, ctime), or the
same fingerprint, with the same recipe, placement, level and TTL. What is shared is the
lease, never the tensors: each load maps the arena anew (``MAP_PRIVATE``), so a write
through one load's tensors is not seen through another's (:mod:`weightcache._handles`).

Why it is worth it: an Acquire is a round trip through gRPC, about 1.5 ms on a 2-CPU host,
most of a repeated ``load()`` of a few hundred tensors (bench/README.md, ``repeat_load.py``).

A lease is shared only while it is live (not lost, not revoked, no revoke being handled),
only among zero-copy loads of shared memory with the same options of the attach (socket,
``wait_timeout``, ``fallback``, ``ttl``, ``lease_policy``, ``on_revoke``, ``trusted_uid``,
and ``on_lease_lost`` by identity), and is released when the last load sharing it closes.
A revoke with ``on_revoke="copy"`` makes the mapping of every load that shares it private
(docs/leases.md, "Shared within a process").
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from weightcache._handles import MappedArena
from weightcache._lease import ClientLease
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.per_process import PerProcess
from weightcache.core.records import SharedMemoryHandle, ViewColumns


@dataclass(frozen=True)
class Answer:
    """What a load needs of the daemon's answer to map the arena again.

    Attributes:
        storage: the arena's segment and size in bytes.
        views: the tensors' views of it.
        owner: uid the segment must belong to (the daemon's).
        fingerprint: the model's fingerprint, as the daemon sent it.
        model: the model's name.
        metadata: its checkpoint's ``__metadata__``.
    """

    storage: SharedMemoryHandle
    views: ViewColumns
    owner: int
    fingerprint: Fingerprint
    model: str
    metadata: dict[str, str] | None


class SharedLease:
    """One lease and the arenas of the loads that use it.

    Args:
        key: the request and lease options it answers (:func:`take`).
        lease: the lease.
        answer: the daemon's answer to map again.
    """

    def __init__(self, key: Hashable, lease: ClientLease, answer: Answer) -> None:
        self.key = key
        self.lease = lease
        self.answer = answer
        self._users = 0
        # Strong, as ClientLease.privatize held its one arena before: the weights of a
        # load dropped without close() are still made private on a revoke.
        self._arenas: dict[int, MappedArena] = {}
        self._privatizing = False

    @property
    def live(self) -> bool:
        """Whether the lease may be shared: not lost, not revoked, not being revoked."""
        return self.lease.lost is None and not self.lease.revoked and not self._privatizing

    def join(self, arena: MappedArena) -> None:
        """Count ``arena`` among those to make private on a revoke (its load was counted
        a user by :func:`take` or :func:`share`). If the lease is being revoked meanwhile,
        ``arena`` is made private here and now.

        Raises:
            RuntimeError, OSError: making it private failed (:meth:`MappedArena.privatize`).
        """
        with _leases.lock:
            late = self._privatizing
            if not late:
                self._arenas[id(arena)] = arena
        if late:
            arena.privatize()

    def leave(self, arena: MappedArena | None) -> bool:
        """A load stops using the lease (``arena``: its mapping, None if it made none);
        True when it was the last: the lease is then no longer shared, and is to be
        released."""
        with _leases.lock:
            if arena is not None:
                self._arenas.pop(id(arena), None)
            self._users -= 1
            if self._users:
                return False
            self._unregister()
            return True

    def privatize(self) -> None:
        """Make every user's mapping private (``on_revoke="copy"``,
        :meth:`MappedArena.privatize`); from now on the lease is not shared, and a load
        that joins it meanwhile makes its own mapping private (:meth:`join`).

        Raises:
            RuntimeError, OSError: copying an arena failed (those before it are private).
        """
        with _leases.lock:
            self._privatizing = True
            self._unregister()
            arenas = list(self._arenas.values())
        for arena in arenas:
            arena.privatize()

    def _unregister(self) -> None:
        # Under _leases.lock.
        leases = _leases.entries()
        if leases.get(self.key) is self:
            del leases[self.key]


#: This process's shared leases by key (a forked child's leases are its parent's).
_leases: PerProcess[Hashable, SharedLease] = PerProcess()


def take(key: Hashable) -> SharedLease | None:
    """The live lease that answers ``key`` (the Acquire request without its id, and the
    options of the attach: socket, mode, lease options), counted one user more, if this
    process holds one. The caller calls :meth:`SharedLease.join` once it mapped the arena,
    and :meth:`SharedLease.leave` when done with it (or when the mapping failed)."""
    with _leases.lock:
        shared = _leases.entries().get(key)
        if shared is None or not shared.live:
            return None
        shared._users += 1
        return shared


def share(key: Hashable, lease: ClientLease, answer: Answer, arena: MappedArena) -> SharedLease:
    """Register a lease just granted for ``key``, used by ``arena``'s load (its first
    user); its ``privatize`` becomes that of every load sharing it."""
    shared = SharedLease(key, lease, answer)
    shared._users = 1
    shared.join(arena)
    lease.privatize = shared.privatize
    with _leases.lock:
        _leases.entries()[key] = shared
    return shared
