"""The daemon's lease table: grant, renew over KeepAlive sessions, release, expire.

Times are read from an injected clock (monotonic seconds), so TTL behaviour is tested by
advancing a fake clock instead of sleeping. A lease ends on Release, when the KeepAlive
stream it was bound to closes (the worker died), or when its TTL passes unrenewed.

As in etcd, a lease whose TTL (or revoke deadline) has passed is gone at that moment, not
at the next :meth:`LeaseTable.reap`: no method returns, renews or counts it any more. It is
removed, and handed back so that the daemon frees whatever only it held, by ``reap`` (the
daemon's periodic reaper) or by ``end_if_expired`` (when a KeepAlive or Release names it).
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from weightcache.core.errors import InvalidArgumentError, ResourceExhaustedError
from weightcache.core.records import WorkerDescription

Clock = Callable[[], float]

DEFAULT_TTL = 10.0
MAX_LEASES = 65536
MAX_LEASES_PER_PID = 1024
#: Transfer leases (seeding, :mod:`.seed_serve`) one peer identity may hold at once, and
#: all peers together (SECURITY.md, "Seeding"); they do not count against any pid's bound.
MAX_TRANSFER_LEASES_PER_PEER = 16
MAX_TRANSFER_LEASES = 64
MIN_TTL = 1.0
MAX_TTL = 300.0


@dataclass
class Lease:
    """One live lease.

    Attributes:
        lease_id: opaque id, unique across daemon instances.
        model: name of the model leased.
        ttl: seconds granted after clamping.
        expire_at: clock reading after which the lease ends unless renewed.
        request_id: the Acquire request that created it (for idempotent retries).
        pid: the worker's pid as it reported it.
        session: id of the KeepAlive stream the lease is bound to, once named on one.
        revoke_deadline: clock reading at which a revoked lease's memory is freed.
        detached: revoked on shared memory: its model was dropped at once and its segment
            unlinked, which the worker still maps; the lease no longer counts as a
            holder of any model (:meth:`LeaseTable.for_model`) and lives on, renewed,
            until released, expired or its stream closes, so that the daemon knows the
            memory is still mapped.
        settled: detached, and renewed since: its holder took note of the revoke and
            keeps its mapping (a drain need not wait for it).
        granted_at: clock reading at which it was granted.
        worker: the worker's description of itself (for operators: ListLeases).
        peer: for a transfer lease (BeginSeed), the identity of the peer that began it
            (its certificate names; ``unix:...`` for the Unix socket): only that peer may
            read through it or end it. Empty for a worker's lease.
    """

    lease_id: str
    model: str
    ttl: float
    expire_at: float
    request_id: str
    pid: int
    session: int | None = None
    revoke_deadline: float | None = None
    detached: bool = False
    settled: bool = False
    granted_at: float = 0.0
    worker: WorkerDescription = field(default_factory=WorkerDescription)
    peer: str = ""


@dataclass
class LeaseTable:
    """All live leases of one daemon instance.

    Args:
        clock: monotonic seconds; ``time.monotonic`` unless a test injects one.
        min_ttl, max_ttl: bounds a requested TTL is clamped to, in seconds.
        default_ttl: TTL for a request that names none, in seconds.
        max_leases, max_leases_per_pid: bounds on live leases, in all and per worker pid.
        max_transfer_leases, max_transfer_leases_per_peer: bounds on live transfer leases,
            in all and per peer identity.
    """

    clock: Clock = time.monotonic
    min_ttl: float = MIN_TTL
    max_ttl: float = MAX_TTL
    default_ttl: float = DEFAULT_TTL
    max_leases: int = MAX_LEASES
    max_leases_per_pid: int = MAX_LEASES_PER_PID
    max_transfer_leases: int = MAX_TRANSFER_LEASES
    max_transfer_leases_per_peer: int = MAX_TRANSFER_LEASES_PER_PEER
    _leases: dict[str, Lease] = field(default_factory=dict)
    _by_request: dict[str, str] = field(default_factory=dict)
    _session_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def clamp(self, ttl: float | None) -> float:
        """The TTL granted for a requested one (``None`` or ``<= 0``: the default)."""
        if ttl is None or ttl <= 0:
            return self.default_ttl
        return min(max(ttl, self.min_ttl), self.max_ttl)

    def grant(
        self,
        model: str,
        ttl: float | None,
        request_id: str,
        pid: int,
        worker: WorkerDescription | None = None,
        *,
        peer: str = "",
    ) -> Lease:
        """Grant a lease, or return the live one an earlier call with ``request_id`` granted.
        ``worker`` is kept on the lease as the worker described itself; ``peer`` makes it
        a transfer lease of that peer identity (bounded per peer and in all, not per pid).

        Raises:
            InvalidArgumentError: ``request_id`` already holds a lease on another model.
            ResourceExhaustedError: the daemon, this pid, or (a transfer lease) this peer
                or all peers hold the most leases allowed.
        """
        existing = self._live(self._by_request.get(request_id, ""))
        if request_id and existing is not None:
            if existing.model != model:
                raise InvalidArgumentError(
                    "request_id was used for a lease on another model",
                    metadata={"field": "request_id"},
                )
            return existing
        if len(self._leases) >= self.max_leases:
            raise ResourceExhaustedError(f"the daemon holds {self.max_leases} leases already")
        if peer:
            self._check_transfer_bounds(peer)
        elif (
            sum(lease.pid == pid and not lease.peer for lease in self._leases.values())
            >= self.max_leases_per_pid
        ):
            raise ResourceExhaustedError(
                f"pid {pid} holds {self.max_leases_per_pid} leases already; release some"
            )
        granted = self.clamp(ttl)
        now = self.clock()
        lease = Lease(
            lease_id=secrets.token_hex(16),
            model=model,
            ttl=granted,
            expire_at=now + granted,
            request_id=request_id,
            pid=pid,
            granted_at=now,
            worker=worker or WorkerDescription(pid=pid),
            peer=peer,
        )
        self._leases[lease.lease_id] = lease
        if request_id:
            self._by_request[request_id] = lease.lease_id
        return lease

    def _check_transfer_bounds(self, peer: str) -> None:
        """Raises ResourceExhaustedError when ``peer``, or all peers, hold the most live
        transfer leases allowed."""
        now = self.clock()
        transfers = [x for x in self._leases.values() if x.peer and not self._over(x, now)]
        if sum(x.peer == peer for x in transfers) >= self.max_transfer_leases_per_peer:
            raise ResourceExhaustedError(
                f"this peer holds {self.max_transfer_leases_per_peer} transfer leases "
                "already; end some (EndSeed)",
                metadata={"field": "transfer_leases"},
            )
        if len(transfers) >= self.max_transfer_leases:
            raise ResourceExhaustedError(
                f"the daemon serves {self.max_transfer_leases} seeds already; try later",
                metadata={"field": "transfer_leases"},
            )

    def transfer(self, lease_id: str, peer: str) -> Lease | None:
        """The live transfer lease ``lease_id`` if ``peer`` began it; ``None`` otherwise
        (unknown, ended, a worker's lease, or another peer's: alike to the caller)."""
        lease = self._live(lease_id)
        return lease if lease is not None and peer and lease.peer == peer else None

    def restore(
        self,
        lease_id: str,
        model: str,
        ttl: float,
        request_id: str,
        pid: int,
        *,
        age: float = 0.0,
        worker: WorkerDescription | None = None,
    ) -> Lease:
        """Take over a lease a predecessor handed over, under the same id: live for a full
        TTL from now (its holder renews it once its KeepAlive stream reconnects), bound to
        no stream yet; granted ``age`` seconds ago (>= 0), to ``worker`` as it described
        itself to the predecessor."""
        now = self.clock()
        lease = Lease(
            lease_id,
            model,
            self.clamp(ttl),
            now + self.clamp(ttl),
            request_id,
            pid,
            granted_at=now - max(age, 0.0),
            worker=worker or WorkerDescription(pid=pid),
        )
        self._leases[lease_id] = lease
        if request_id:
            self._by_request[request_id] = lease_id
        return lease

    def live_leases(self) -> list[Lease]:
        """Every live lease (for a hand-over)."""
        now = self.clock()
        return [lease for lease in self._leases.values() if not self._over(lease, now)]

    def get(self, lease_id: str) -> Lease | None:
        """The live lease with this id, or ``None`` (also once it has expired)."""
        return self._live(lease_id)

    def _live(self, lease_id: str) -> Lease | None:
        lease = self._leases.get(lease_id)
        return lease if lease is not None and not self._over(lease, self.clock()) else None

    @staticmethod
    def _over(lease: Lease, now: float) -> bool:
        return lease.expire_at <= now or (
            lease.revoke_deadline is not None and lease.revoke_deadline <= now
        )

    def open_session(self) -> int:
        """A fresh id for a KeepAlive stream."""
        return next(self._session_ids)

    def renew(self, lease_id: str, session: int) -> Lease | None:
        """Extend a live lease by its TTL and bind it to ``session``.

        Returns ``None`` for an unknown lease and for one whose TTL or revoke deadline has
        passed, even if :meth:`reap` has not removed it yet: an expired lease is never revived.
        """
        lease = self._live(lease_id)
        if lease is None:
            return None
        lease.expire_at = self.clock() + lease.ttl
        lease.session = session
        lease.settled = lease.detached
        return lease

    def end_if_expired(self, lease_id: str) -> Lease | None:
        """End and return the lease if its TTL or revoke deadline has passed (as :meth:`reap`
        does for all), so that a caller naming it can free what it held; else ``None``."""
        lease = self._leases.get(lease_id)
        if lease is None or not self._over(lease, self.clock()):
            return None
        self.release(lease_id)
        return lease

    def release(self, lease_id: str) -> Lease | None:
        """End a lease; returns it, or ``None`` when it was not live (idempotent).

        An expired lease not yet reaped is removed too, but ``None`` is returned for it.
        """
        lease = self._leases.pop(lease_id, None)
        if lease is not None and self._by_request.get(lease.request_id) == lease_id:
            del self._by_request[lease.request_id]
        return lease if lease is not None and not self._over(lease, self.clock()) else None

    def end_session(self, session: int) -> list[Lease]:
        """End every lease bound to a KeepAlive stream that closed."""
        ended = [lease for lease in self._leases.values() if lease.session == session]
        for lease in ended:
            self.release(lease.lease_id)
        return ended

    def reap(self) -> list[Lease]:
        """End and return every lease whose TTL, or revoke deadline, has passed."""
        now = self.clock()
        expired = [lease for lease in self._leases.values() if self._over(lease, now)]
        for lease in expired:
            self.release(lease.lease_id)
        return expired

    def live(self) -> list[Lease]:
        """Every live lease, oldest first."""
        now = self.clock()
        live = [lease for lease in self._leases.values() if not self._over(lease, now)]
        return sorted(live, key=lambda lease: lease.granted_at)

    def for_model(self, model: str) -> list[Lease]:
        """Live leases holding a model (expired and detached ones do not)."""
        now = self.clock()
        return [
            lease
            for lease in self._leases.values()
            if lease.model == model and not lease.detached and not self._over(lease, now)
        ]

    def detach(self, model: str) -> list[Lease]:
        """Mark every lease holding ``model`` as revoked and detached (its arena is being
        unlinked under the workers' mappings); they end as any lease does, with no
        deadline."""
        leases = self.for_model(model)
        for lease in leases:
            lease.detached = True
        return leases

    def live_ids(self, lease_ids: Iterable[str]) -> list[str]:
        """Those of ``lease_ids`` that are still live."""
        return [lease_id for lease_id in lease_ids if self._live(lease_id) is not None]

    def unsettled(self) -> int:
        """Live leases that hold a model, or are detached but not renewed since (their
        holder may not know yet): what a drain waits for."""
        now = self.clock()
        return sum(
            not lease.settled and not self._over(lease, now) for lease in self._leases.values()
        )

    def revoke(self, model: str, deadline: float) -> list[Lease]:
        """Mark every lease on ``model`` as revoking at ``deadline`` (clock seconds)."""
        leases = self.for_model(model)
        for lease in leases:
            # A repeated revoke must not postpone the deadline already announced.
            if lease.revoke_deadline is None or deadline < lease.revoke_deadline:
                lease.revoke_deadline = deadline
        return leases

    def wall(self, clock_seconds: float) -> float:
        """A reading of :attr:`clock` as epoch seconds."""
        return time.time() + clock_seconds - self.clock()

    def __len__(self) -> int:
        return len(self._leases)
