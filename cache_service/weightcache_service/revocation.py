"""Revocation: taking models back from their lease holders. A model is evicted at once when
nobody holds it, else (forced) its leases are revoked: REVOKING is pushed to every holder
(:meth:`.LeaseGrants.push`); on shared memory the segment is unlinked at once and counted
as unlinked while workers still map it, on a GPU the model is EVICTING until its leases
end or the drain timeout passes. Also the reaping of expired leases and the freeing of
what they held (docs/leases.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from weightcache.core.errors import LeasesActiveError, ModelLoadingError
from weightcache.core.records import ModelInfo, UnlinkedArena
from weightcache_service.events import CacheEvents
from weightcache_service.leases import Lease, LeaseTable
from weightcache_service.store import Entry, Store

log = structlog.get_logger("weightcache.daemon")


class Revocation:
    """Evictions, revocations and the reaping of leases of one daemon's store.

    Args:
        store: the models held.
        leases: the lease table.
        unlink_keeps_mappings: the backend's
            :attr:`~weightcache_service.backend.Backend.unlink_keeps_mappings`: a revoked
            arena is unlinked at once, the workers' mappings keep its bytes.
        drain_timeout: seconds lease holders get after REVOKING on a backend without it.
        events: where expiries and revocations are reported (the cache replaces it).
        push: sends a revoked lease's status to its KeepAlive session
            (:meth:`.LeaseGrants.push`).
    """

    def __init__(
        self,
        store: Store,
        leases: LeaseTable,
        *,
        unlink_keeps_mappings: bool,
        drain_timeout: float,
        events: CacheEvents,
        push: Callable[[Lease], None],
    ) -> None:
        self.store = store
        self.leases = leases
        self._unlink_keeps_mappings = unlink_keeps_mappings
        self._drain_timeout = drain_timeout
        self.events = events
        self._push = push
        #: Arenas revoked on shared memory, unlinked, that workers still map, oldest first.
        self._unlinked: list[_Unlinked] = []

    def evict(self, name: str, force: bool) -> ModelInfo:
        """Free a model now, or (``force`` with live leases) revoke its leases and free it
        once they end; returns the model as it was before.

        Raises:
            ModelNotFoundError: no such model.
            ModelLoadingError: the model is loading.
            LeasesActiveError: it has live leases of workers and ``force`` is not set
                (transfer leases, of peers seeding from this daemon, are ended instead).
        """
        refusal = self.store.refusals.pop(name, None)
        if refusal is not None:
            self.store.given_up.add(name)
            log.info("evicted", model=name)
            return refusal.info()
        entry = self.store.get(name)
        if entry.state == "failed":
            self.store.given_up.add(name)
        if entry.state == "loading":
            raise ModelLoadingError(f"model {entry.name!r} is loading; evict it once loaded")
        held = self.leases.for_model(entry.name)
        holders = [lease for lease in held if not lease.peer]
        if holders and not force:
            raise LeasesActiveError(
                f"model {entry.name!r} has {len(holders)} live lease(s); release them or "
                "evict with force (weightcache evict --force)",
                metadata={"model": entry.name, "leases": str(len(holders))},
            )
        snapshot = entry.info(len(held))
        self._end_transfers(entry)
        if holders:
            self._revoke(entry)
        else:
            self.store.remove(entry.name)
            log.info("evicted", model=entry.name)
        return snapshot

    def revoke_all(self) -> None:
        """Revoke every lease (drain)."""
        for entry in self.store.entries():
            if self.leases.for_model(entry.name):
                self._revoke(entry)

    def _end_transfers(self, entry: Entry) -> None:
        """End the transfer leases on ``entry`` (peers seeding from this daemon): they never
        hold an evict or a drain back, and a revoke would leave them for the drain to wait
        on; each seeder's next chunk is refused and it loads from its own files."""
        for lease in self.leases.for_model(entry.name):
            if lease.peer:
                self.leases.release(lease.lease_id)
                log.info("transfer lease ended", model=entry.name, peer=lease.peer)

    def _revoke(self, entry: Entry) -> None:
        """Push REVOKING to every holder of ``entry``. On shared memory the model is
        dropped now (its segment unlinked: the workers' mappings keep their bytes, which
        never change) and its leases detached, counted as unlinked until they end; on a GPU
        it is EVICTING until they end or the drain timeout passes. Transfer leases end
        (:meth:`_end_transfers`)."""
        self._end_transfers(entry)
        if self._unlink_keeps_mappings:
            revoked = self.leases.detach(entry.name)
            self.store.remove(entry.name)
            self._unlinked.append(
                _Unlinked(entry.name, entry.size, time.time(), {x.lease_id for x in revoked})
            )
            log.warning(
                "revoked: segment unlinked, workers keep their mappings",
                model=entry.name,
                leases=len(revoked),
                bytes=entry.size,
            )
        else:
            entry.state = "evicting"
            deadline = self.leases.clock() + self._drain_timeout
            revoked = self.leases.revoke(entry.name, deadline)
            log.warning("revoking", model=entry.name, leases=len(revoked))
        self.events.leases_revoked(len(revoked))
        for lease in revoked:
            self._push(lease)

    def reap(self) -> None:
        """End expired leases and free evicting models nobody holds any more."""
        for lease in self.leases.reap():
            log.info("lease expired", model=lease.model, lease=lease.lease_id[:8])
            self.events.lease_expired()
        self.free_evicted()

    def free_evicted(self) -> None:
        for entry in self.store.entries():
            if entry.state == "evicting" and not self.leases.for_model(entry.name):
                self.store.remove(entry.name)
                log.info("evicted", model=entry.name)
        self._prune_unlinked()

    def _prune_unlinked(self) -> None:
        """Forget the unlinked arenas whose revoked leases have all ended."""
        kept = []
        for unlinked in self._unlinked:
            unlinked.lease_ids = set(self.leases.live_ids(unlinked.lease_ids))
            if unlinked.lease_ids:
                kept.append(unlinked)
            else:
                log.info("unlinked arena released", model=unlinked.model, bytes=unlinked.size)
        self._unlinked = kept

    def unlinked_arenas(self) -> list[UnlinkedArena]:
        """Arenas revoked on shared memory that workers still map, oldest first: known by
        their revoked leases not yet ended (released, expired, or their stream closed)."""
        self._prune_unlinked()
        return [
            UnlinkedArena(u.model, u.size, len(u.lease_ids), u.unlink_time) for u in self._unlinked
        ]

    def unlinked_bytes(self) -> int:
        """Bytes of :meth:`unlinked_arenas`: not held, but not free either (counted
        against the budget)."""
        self._prune_unlinked()
        return sum(u.size for u in self._unlinked)


@dataclass
class _Unlinked:
    """An arena revoked on shared memory: unlinked, mapped by the holders of
    ``lease_ids`` (revoked leases not yet ended)."""

    model: str
    size: int
    unlink_time: float
    lease_ids: set[str]
