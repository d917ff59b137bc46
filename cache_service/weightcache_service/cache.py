"""The daemon's cache: the coordinator of a model's lifecycle.

:class:`WeightCache` owns the store and the lease table and hands each concern to its
part, which it wires together: loading (:mod:`.loading`), remote-Preload admission
(:mod:`.admission`), KeepAlive sessions and renewals (:mod:`.lease_grants`), revocation,
eviction and reaping (:mod:`.revocation`), the hand-over (:mod:`.adoption`). It keeps
what joins them: an Acquire (a model found in the store, a lease granted on it), model
snapshots, server info, the draining and hand-over flags. It takes and returns domain
objects (``Fingerprint``, ``Recipe``, ``ModelInfo``, ``Grant``...) and never sees a
protobuf message or a gRPC context: :mod:`weightcache_service.servicer` converts at the
edge. (Named ``cache``, not ``daemon``: ``server.Daemon`` is the process.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import structlog

from weightcache.core.errors import (
    DrainingError,
    FingerprintMismatchError,
    ModelLoadingError,
    ModelNotFoundError,
)
from weightcache.core.records import (
    Acquisition,
    Environment,
    Grant,
    LeaseHolder,
    LeaseStatus,
    ModelInfo,
    ServerInfo,
    UnlinkedArena,
)
from weightcache.core.version import PROTOCOL_VERSION, __version__
from weightcache_service import adoption
from weightcache_service.admission import Admission
from weightcache_service.arena import Arena
from weightcache_service.backend import Backend
from weightcache_service.environment import torch_version, with_skew
from weightcache_service.events import CacheEvents
from weightcache_service.handover import HeldModel
from weightcache_service.lease_grants import LeaseGrants, Outbox
from weightcache_service.leases import LeaseTable
from weightcache_service.loading import Loader
from weightcache_service.options import ServiceOptions
from weightcache_service.peers import Connection
from weightcache_service.revocation import Revocation
from weightcache_service.store import Entry, Store

log = structlog.get_logger("weightcache.daemon")


class WeightCache:
    """One daemon's models and leases.

    Args:
        store: the models held.
        leases: the lease table (its clock drives all lease timing).
        options: operator's permissions.
        instance_id: random id of this daemon process.
        backend: where arenas live (resolved once, by the server).
    """

    def __init__(
        self,
        store: Store,
        leases: LeaseTable,
        options: ServiceOptions,
        instance_id: str,
        backend: Backend,
    ) -> None:
        self.store = store
        self.leases = leases
        self.options = options
        self.instance_id = instance_id
        self.backend = backend
        self.draining = False
        #: Stopping for a restart: leases are handed over, not revoked.
        self.handing_over = False
        #: Until every start-up preload is registered, a miss may be a model about to load.
        self.starting = False
        self.start_time = time.time()
        self.environment = Environment(
            weightcache_version=__version__,
            torch_version=torch_version(),
            backend=backend.name,
            device_uuid=backend.device_uuid,
        )
        self._events = CacheEvents()
        #: What a remote Preload may name (the servicer asks it before a load begins).
        self.admission = Admission(options)
        #: Loads into the store (:mod:`.loading`).
        self.loader = Loader(
            store, options, self._events, self.admission.check_opened, self.unlinked_bytes
        )
        #: Loading is the loader's alone: these are its methods, not copies of their
        #: signatures (:meth:`.Loader.begin_load`, :meth:`.Loader.refuse`: a start-up model
        #: refused before it held anything, :meth:`.Loader.wait_loads`: at shutdown).
        self.begin_load = self.loader.begin_load
        self.refuse = self.loader.refuse
        self.wait_loads = self.loader.wait_loads
        #: Evictions, revocations, reaping, unlinked arenas (:mod:`.revocation`).
        self.revocation = Revocation(
            store,
            leases,
            unlink_keeps_mappings=backend.unlink_keeps_mappings,
            drain_timeout=options.drain_timeout,
            events=self._events,
            # A lambda: the grants are made next, and free what they held through it.
            push=lambda lease: self.grants.push(lease),  # noqa: PLW0108
        )
        #: KeepAlive sessions, renewals, releases (:mod:`.lease_grants`).
        self.grants = LeaseGrants(leases, instance_id, self._events, self.revocation.free_evicted)

    @property
    def events(self) -> CacheEvents:
        """Where events go (:class:`CacheEvents`); the metrics replace it, in every part."""
        return self._events

    @events.setter
    def events(self, events: CacheEvents) -> None:
        self._events = self.grants.events = self.revocation.events = self.loader.events = events

    # -- hand-over -------------------------------------------------------------------------

    def handed_over(self) -> list[HeldModel]:
        """What a hand-over leaves to the successor: :func:`.adoption.handed_over`."""
        return adoption.handed_over(self.store, self.leases)

    def adopt(self, held: HeldModel, arena_of: Callable[[int], Arena]) -> Entry:
        """Serve a model a predecessor handed over: :func:`.adoption.adopt` (its Raises)."""
        return adoption.adopt(self.store, self.leases, held, arena_of)

    def announce_hand_over(self) -> None:
        """Tell every KeepAlive stream that this daemon hands its leases over to its
        successor (``KeepAliveResponse.hand_over``): their holders reconnect."""
        self.handing_over = True
        self.grants.broadcast([])

    # -- models ------------------------------------------------------------------------

    def model(self, name: str) -> ModelInfo:
        """A snapshot of the model called ``name``.

        Raises:
            ModelNotFoundError: no such model.
        """
        refusal = self.store.refusals.get(name)
        return refusal.info() if refusal is not None else self.info(self.store.get(name))

    def models(self) -> list[ModelInfo]:
        """Snapshots of every model, sorted by name: those held or loading, and the
        start-up models refused before they held anything (:class:`Refusal`), FAILED."""
        held = [self.info(entry) for entry in self.store.entries()]
        refused = [refusal.info() for refusal in self.store.refusals.values()]
        return sorted(held + refused, key=lambda m: m.name)

    def info(self, entry: Entry) -> ModelInfo:
        """A snapshot of ``entry`` with its live lease count."""
        return entry.info(len(self.leases.for_model(entry.name)))

    def server_info(self) -> ServerInfo:
        """Versions, backend and memory of this daemon."""
        budget = self.store.budget
        limit = budget.limit if budget is not None else None
        return ServerInfo(
            version=__version__,
            protocol_version=PROTOCOL_VERSION,
            torch_version=self.environment.torch_version,
            backend=self.backend.name,
            device=self.backend.device,
            device_uuid=self.backend.device_uuid,
            memory_held_bytes=self.store.held_bytes(),
            memory_budget_bytes=limit or 0,
            instance_id=self.instance_id,
            start_time=self.start_time,
            memory_unlinked_bytes=self.unlinked_bytes(),
        )

    # -- leases ------------------------------------------------------------------------

    def check_open(self) -> None:
        """Refuse new leases while draining.

        Raises:
            DrainingError: the daemon is draining.
        """
        if self.draining:
            raise DrainingError("the daemon is draining; load from disk or retry elsewhere")

    def acquire(self, want: Acquisition) -> Grant:
        """Lease the READY model whose fingerprint ``want`` names, or (with ``want.files``)
        which was loaded from the worker's very files.

        Raises:
            DrainingError: the daemon is draining.
            ModelLoadingError: the model is loading, or start-up preloads are not all
                registered yet and nothing matches.
            FingerprintMismatchError, ModelNotFoundError: no held model matches (the
                message notes a version skew of the worker's environment).
            ModelFailedError, ResourceExhaustedError: the model failed or was refused.
            InvalidArgumentError: ``request_id`` was used for another model's lease.
        """
        self.check_open()
        try:
            entry = self._find(want)
        except (FingerprintMismatchError, ModelNotFoundError) as err:
            if self.starting:
                raise ModelLoadingError(
                    "the daemon is starting: its start-up models are not all registered yet",
                    metadata={"bytes_done": "0", "bytes_total": "0"},
                ) from None
            raise with_skew(err, want.environment, self.environment) from None
        if entry.handle is None:
            raise ModelLoadingError(f"model {entry.name!r} is not ready")
        lease = self.leases.grant(entry.name, want.ttl, want.request_id, want.pid, want.worker)
        match = "files" if want.files else "fingerprint"
        log.info(
            "acquired",
            model=entry.name,
            lease=lease.lease_id[:8],
            pid=want.pid,
            hostname=want.worker.hostname,
            label=want.worker.label,
            match=match,
        )
        return Grant(
            lease=self.grants.lease_info(lease),
            model=self.info(entry),
            storage=entry.handle,
            tensors=entry.views,  # the same tuple every time: the servicer keys on it
            environment=self.environment,
        )

    def _find(self, want: Acquisition) -> Entry:
        if want.files:
            return self.store.find_by_files(
                want.fingerprint.components, want.files, want.checkpoint_path
            )
        return self.store.find(want.fingerprint, want.checkpoint_path)

    def open_session(self) -> tuple[int, Outbox]:
        """A new KeepAlive session: :meth:`.LeaseGrants.open_session`."""
        return self.grants.open_session()

    def close_session(self, session: int) -> None:
        """End a KeepAlive session and its leases: :meth:`.LeaseGrants.close_session`."""
        self.grants.close_session(session)

    def renew(self, lease_ids: Iterable[str], session: int) -> list[LeaseStatus]:
        """Renew leases for ``session``; each id's status: :meth:`.LeaseGrants.renew`."""
        return self.grants.renew(lease_ids, session)

    def release(self, lease_id: str) -> None:
        """End a lease (idempotent): :meth:`.LeaseGrants.release`."""
        self.grants.release(lease_id)

    def lease_holders(
        self, model: str, peers: list[Connection], only_peer: str | None = None
    ) -> list[LeaseHolder]:
        """Every live lease with who holds it: :meth:`.LeaseGrants.lease_holders`."""
        return self.grants.lease_holders(model, peers, only_peer)

    # -- eviction and draining ---------------------------------------------------------

    def evict(self, name: str, force: bool) -> ModelInfo:
        """Free a model now, or revoke its leases first: :meth:`.Revocation.evict` (its
        Raises)."""
        return self.revocation.evict(name, force)

    def close_sessions(self) -> None:
        """End every KeepAlive stream (at shutdown, so that stopping waits for none)."""
        self.grants.broadcast(None)

    def revoke_all(self) -> None:
        """Revoke every lease (drain): :meth:`.Revocation.revoke_all`."""
        self.revocation.revoke_all()

    def reap(self) -> None:
        """End expired leases, free what only they held: :meth:`.Revocation.reap`."""
        self.revocation.reap()

    def unlinked_arenas(self) -> list[UnlinkedArena]:
        """Arenas revoked on shared memory that workers still map, oldest first:
        :meth:`.Revocation.unlinked_arenas`."""
        return self.revocation.unlinked_arenas()

    def unlinked_bytes(self) -> int:
        """Bytes of :meth:`unlinked_arenas` (counted against the budget)."""
        return self.revocation.unlinked_bytes()
