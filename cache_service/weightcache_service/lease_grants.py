"""The leases workers hold, as the cache grants and keeps them: KeepAlive sessions and
what each is sent (:data:`Outbox`), renewals, releases, expiries found on the way, each
lease's status and its holders. :class:`~weightcache_service.leases.LeaseTable` keeps the
table and its timing; :mod:`.cache` grants a lease on a model (``WeightCache.acquire``)
and :mod:`.revocation` revokes them, pushing REVOKING through :meth:`LeaseGrants.push`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import structlog

from weightcache.core.protocol import MAX_ID_CHARS
from weightcache.core.records import LeaseHolder, LeaseInfo, LeaseStatus
from weightcache_service.events import CacheEvents
from weightcache_service.leases import Lease, LeaseTable
from weightcache_service.peers import Connection, holder

log = structlog.get_logger("weightcache.daemon")

#: An answer the servicer encoded already, queued as it is: the cache never looks in it.
Encoded = object
#: What a KeepAlive session is sent: statuses of some of its leases (pushed by the
#: cache: revocations, a hand-over), or an answer encoded already (the renewals of the
#: servicer's reader); None ends it.
Outbox = asyncio.Queue[list[LeaseStatus] | Encoded | None]


class LeaseGrants:
    """The KeepAlive sessions of one daemon and the leases they renew.

    Args:
        leases: the lease table (its clock drives all lease timing).
        instance_id: random id of this daemon process (in every :class:`LeaseInfo`).
        events: where expiries are reported (the cache replaces it with the metrics).
        ended: called when leases ended, to free what only they held
            (:meth:`.Revocation.free_evicted`).
    """

    def __init__(
        self,
        leases: LeaseTable,
        instance_id: str,
        events: CacheEvents,
        ended: Callable[[], None],
    ) -> None:
        self.leases = leases
        self.instance_id = instance_id
        self.events = events
        self._free_evicted = ended
        self._sessions: dict[int, Outbox] = {}

    def open_session(self) -> tuple[int, Outbox]:
        """A new KeepAlive session: its id, and the queue of what it is to be sent
        (renewals, and REVOKING notices: :meth:`push`)."""
        session = self.leases.open_session()
        outbox: Outbox = asyncio.Queue()
        self._sessions[session] = outbox
        return session, outbox

    def close_session(self, session: int) -> None:
        """End a KeepAlive session: every lease bound to it ends, and what only they held
        is freed."""
        del self._sessions[session]
        for lease in self.leases.end_session(session):
            log.info("lease ended: keepalive stream closed", lease=lease.lease_id[:8])
        self._free_evicted()

    def renew(self, lease_ids: Iterable[str], session: int) -> list[LeaseStatus]:
        """Renew leases on behalf of ``session``; each id's status, in order (ids are cut
        to :data:`MAX_ID_CHARS` to look up, and reported as given)."""
        statuses = []
        expired = False
        for lease_id in lease_ids:
            lease = self.leases.renew(lease_id[:MAX_ID_CHARS], session)
            # Expired since the last reap: gone now (NOT_FOUND), and what only it held is
            # freed now rather than at the next reaper tick.
            expired |= lease is None and self._end_if_expired(lease_id[:MAX_ID_CHARS])
            statuses.append(self.lease_status(lease_id, lease))
        if expired:
            self._free_evicted()
        return statuses

    def release(self, lease_id: str) -> None:
        """End a lease (idempotent), freeing a revoked model nobody holds any more."""
        expired = self._end_if_expired(lease_id)
        lease = self.leases.release(lease_id)
        if lease is not None:
            log.info("released", model=lease.model, lease=lease.lease_id[:8])
        if lease is not None or expired:
            self._free_evicted()

    def _end_if_expired(self, lease_id: str) -> bool:
        lease = self.leases.end_if_expired(lease_id)
        if lease is not None:
            log.info("lease expired", model=lease.model, lease=lease.lease_id[:8])
            self.events.lease_expired()
        return lease is not None

    def lease_status(self, lease_id: str, lease: Lease | None) -> LeaseStatus:
        if lease is None:
            return LeaseStatus(lease_id, "not_found")
        if lease.detached:
            # No deadline: the daemon frees nothing under the mapping any more.
            return LeaseStatus(lease_id, "revoking", expire_time=self.leases.wall(lease.expire_at))
        if lease.revoke_deadline is not None:
            return LeaseStatus(
                lease_id,
                "revoking",
                expire_time=self.leases.wall(lease.expire_at),
                revoke_deadline=self.leases.wall(lease.revoke_deadline),
            )
        return LeaseStatus(lease_id, "active", expire_time=self.leases.wall(lease.expire_at))

    def lease_holders(
        self, model: str, peers: list[Connection], only_peer: str | None = None
    ) -> list[LeaseHolder]:
        """Every live lease (on ``model`` only, unless empty; only the transfer leases
        peer ``only_peer`` began, unless None), oldest first, with who holds it: the
        worker's description, and the credentials of its connection among ``peers``
        (:func:`weightcache_service.peers.holder`)."""
        holders = []
        for lease in self.leases.live():
            if (model and lease.model != model) or (
                only_peer is not None and lease.peer != only_peer
            ):
                continue
            status = self.lease_status(lease.lease_id, lease)
            holders.append(
                LeaseHolder(
                    lease=self.lease_info(lease),
                    state=status.state,
                    create_time=self.leases.wall(lease.granted_at),
                    worker=lease.worker,
                    peer=holder(lease.worker, peers),
                    revoke_deadline=status.revoke_deadline,
                )
            )
        return holders

    def lease_info(self, lease: Lease) -> LeaseInfo:
        return LeaseInfo(
            lease_id=lease.lease_id,
            model=lease.model,
            ttl=lease.ttl,
            expire_time=self.leases.wall(lease.expire_at),
            instance_id=self.instance_id,
        )

    def push(self, lease: Lease) -> None:
        """Send ``lease``'s status to its KeepAlive session, if it is bound to one (a
        revocation: REVOKING)."""
        outbox = self._sessions.get(lease.session) if lease.session is not None else None
        if outbox is not None:
            outbox.put_nowait([self.lease_status(lease.lease_id, lease)])

    def broadcast(self, message: list[LeaseStatus] | None) -> None:
        """Queue ``message`` to every KeepAlive session: ``[]`` tells of a hand-over
        (``KeepAliveResponse.hand_over``), None ends the stream."""
        for outbox in self._sessions.values():
            outbox.put_nowait(message)
