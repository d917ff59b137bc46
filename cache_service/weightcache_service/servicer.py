"""The ``weightcache.v1.WeightCacheService`` servicer: the gRPC edge of the cache.

Each RPC decodes its request (:mod:`weightcache.core.protocol`), calls the
:class:`~weightcache_service.cache.WeightCache`, encodes the reply, and ends with a rich
status when the cache refuses. What is about the transport stays here: whether the peer is
on the daemon's host, and how much of a KeepAlive stream is read ahead.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast, get_args

import grpc

from weightcache.core.errors import (
    FingerprintMismatchError,
    InvalidArgumentError,
    ModelLoadingError,
    ModelNotFoundError,
    NotSameHostError,
    WeightCacheError,
)
from weightcache.core.protocol import (
    MAX_COMPONENTS,
    MAX_ID_CHARS,
    MAX_LEASES_PER_REQUEST,
    MAX_PATH_CHARS,
    acquire_response_pb,
    acquisition_from_pb,
    add_lease_statuses,
    check_len,
    keepalive_response_pb,
    lease_holder_pb,
    level_from_pb,
    model_pb,
    model_state_pb,
    placement_from_pb,
    progress_pb,
    recipe_from_pb,
    server_info_pb,
    tensor_view_pb,
    tensor_views_pb,
    unlinked_arena_pb,
)
from weightcache.core.records import (
    Grant,
    LeaseStatus,
    TensorFormat,
    TensorView,
    WorkerDescription,
)
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc
from weightcache_service.access import peer_is_local, peer_is_unix
from weightcache_service.authz import certificate_names
from weightcache_service.cache import WeightCache
from weightcache_service.fair_queue import BATCH_IDS, FairQueue
from weightcache_service.interceptors import abort
from weightcache_service.lease_grants import Outbox
from weightcache_service.peers import connections, holder
from weightcache_service.refusals import RefusalLog
from weightcache_service.seed_serve import SeedServer
from weightcache_service.store import Entry, clip

if TYPE_CHECKING:
    # The seeding data plane: imported by the daemon only with --allow-seeding (issue 39).
    from weightcache_service.sendfile_serve import SendfileServer

#: KeepAlive answers queued for a peer before its stream is no longer read.
MAX_PENDING_RESPONSES = 64
#: Seconds between Preload progress messages.
PROGRESS_INTERVAL = 0.25
#: KeepAlive messages one stream may send per second, on average; the SDK sends one every
#: TTL/3 (at least 1/3 s apart, the TTL being at least 1 s). A stream over it is no longer
#: read until its budget allows (HTTP/2 flow control then stalls its sender), so a flood
#: costs the daemon neither memory nor the time of other clients.
MAX_KEEPALIVES_PER_SECOND = 20.0
#: The messages a stream may send at once before the rate applies.
KEEPALIVE_BURST = 20.0
#: Lease ids one message may name for the price of one: a message naming more costs
#: ``ceil(ids / IDS_PER_KEEPALIVE)`` of the stream's budget, so what a flooding stream
#: costs the daemon is bounded in lease ids (20 x 256 = 5 120 a second), not only in
#: messages. A worker holding the most leases a pid may hold (1024) with the shortest TTL
#: (1 s) renews 3 x 1024 ids a second: 12 of the 20.
IDS_PER_KEEPALIVE = 256
#: ErrorInfo metadata keys written into a refusal's log line.
_LOGGED_METADATA = ("model", "components", "cause", "environment", "field")

R = TypeVar("R")
Context = grpc.aio.ServicerContext[Any, Any]


def _unary(
    fn: Callable[[Any, Any, Any], Awaitable[R]],
) -> Callable[[Any, Any, Any], Awaitable[R]]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Any) -> R:
        try:
            return await fn(self, request, context)
        except WeightCacheError as err:
            if fn.__name__ != "Acquire":  # which logs its refusals with more fields
                self.refusals.refused(fn.__name__, err.reason, err.detail, **_subject(request))
            await abort(context, err)
            raise AssertionError("unreachable: abort raises") from err

    return wrapper


class WeightCacheServicer(pb_grpc.WeightCacheServiceServicer):
    """Serves one daemon's cache over gRPC.

    Args:
        cache: the models and leases served.
    """

    def __init__(
        self,
        cache: WeightCache,
        socket: str = "",
        refusals: RefusalLog | None = None,
        seeds: SeedServer | None = None,
    ) -> None:
        self.cache = cache
        #: The serving side of seeding (BeginSeed, ReadSeedData, EndSeed).
        self.seeds = seeds or SeedServer(cache)
        #: The sendfile data plane offered to seeders, if any (set by the daemon).
        self.data_plane: SendfileServer | None = None
        #: The path the daemon's Unix socket was bound at (before its rename into place:
        #: the name its accepted connections report): they are the peers ListLeases names.
        self.socket = socket
        self.refusals = refusals or RefusalLog()
        #: Every KeepAlive stream's renewals and answers, in fair batches (:mod:`.fair_queue`).
        self.fair = FairQueue()
        # Per model name and tensor format: its views (the cache's own tuple) and their
        # encoding, made at the first Acquire that asks for it; dropped at Evict, remade
        # when the name holds a new model.
        self._views: dict[
            tuple[str, TensorFormat], tuple[tuple[TensorView, ...], pb.AcquireResponse]
        ] = {}

    async def Preload(
        self, request: pb.PreloadRequest, context: Context
    ) -> AsyncIterator[pb.PreloadResponse]:
        try:
            try:
                name = None
                if request.repo_id:  # the snapshot in this daemon's Hub cache, by repo id
                    path, name = await asyncio.to_thread(
                        self.cache.admission.remote_hub_model, request.repo_id, request.revision
                    )
                else:
                    path = self.cache.admission.remote_path(request.path)
                recipe = recipe_from_pb(request.recipe, admit=self.cache.admission.admit_plugin)
                placement = placement_from_pb(request.placement)
                level = level_from_pb(request.fingerprint_level)
                check_len("seed_from", request.seed_from, MAX_PATH_CHARS)
            except WeightCacheError as err:
                # Refused before the cache saw it (begin_load counts its own refusals).
                self.cache.events.preload_refused(err.reason)
                raise
            entry, task = await self.cache.begin_load(
                path, recipe, placement, level, confine=True, name=name, seed_from=request.seed_from
            )
            while not task.done():
                yield _preload_response(entry)
                await asyncio.wait([task], timeout=PROGRESS_INTERVAL)
            if entry.failure is not None:
                raise entry.failure
            yield _preload_response(entry)
        except WeightCacheError as err:
            self.refusals.refused("Preload", err.reason, err.detail, **_subject(request))
            await abort(context, err)

    @_unary
    async def GetModel(self, request: pb.GetModelRequest, context: Context) -> pb.GetModelResponse:
        check_len("name", request.name, MAX_PATH_CHARS)
        return pb.GetModelResponse(model=model_pb(self.cache.model(request.name)))

    @_unary
    async def ListModels(
        self, request: pb.ListModelsRequest, context: Context
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(
            models=[model_pb(m) for m in self.cache.models()],
            unlinked=[unlinked_arena_pb(a) for a in self.cache.unlinked_arenas()],
        )

    @_unary
    async def Acquire(self, request: pb.AcquireRequest, context: Context) -> pb.AcquireResponse:
        start = time.perf_counter()
        try:
            reply = self._acquire(request, context)
        except WeightCacheError as err:
            result = _asked_again(request, err)
            self.cache.events.acquired(err.reason, time.perf_counter() - start, result)
            self._log_acquire_refused(request, context, err, debug=bool(result))
            raise
        self.cache.events.acquired("", time.perf_counter() - start)
        return reply

    def _log_acquire_refused(
        self, request: pb.AcquireRequest, context: Context, err: WeightCacheError, debug: bool
    ) -> None:
        # Read from the raw request: a refusal at decode (INVALID_ARGUMENT) is logged too,
        # with every string clipped as in error messages. One the worker asks again after
        # (``debug``) is no fallback: logged at debug.
        self.refusals.refused(
            "Acquire",
            err.reason,
            err.detail,
            debug=debug,
            path=clip(request.checkpoint_path),
            fingerprint=clip(request.fingerprint.digest)[:16],
            match="files" if request.files else "fingerprint",
            fingerprint_level=pb.FingerprintLevel.Name(request.fingerprint.level).removeprefix(
                "FINGERPRINT_LEVEL_"
            ),
            peer=lambda: self._peer(request, context),
            **{k: v for k, v in err.metadata.items() if k in _LOGGED_METADATA},
        )

    def _peer(self, request: pb.AcquireRequest, context: Context) -> dict[str, object]:
        """The peer as the daemon sees it (the transport's address; on the Unix socket,
        its connection's credentials when they can be told apart: :mod:`.peers`) and as
        the worker describes itself."""
        fields: dict[str, object] = {"peer": context.peer(), "pid": request.pid}
        worker = request.worker
        if worker.hostname or worker.label:
            fields.update(hostname=clip(worker.hostname), label=clip(worker.label))
        if self.socket and peer_is_unix(context.peer()):
            description = WorkerDescription(
                pid=worker.pid or request.pid, pid_namespace=worker.pid_namespace
            )
            creds = holder(description, connections(self.socket))
            if creds is not None:
                fields.update(peer_pid=creds.pid, peer_uid=creds.uid, peer_gid=creds.gid)
        return fields

    def _acquire(self, request: pb.AcquireRequest, context: Context) -> pb.AcquireResponse:
        self.cache.check_open()
        want = acquisition_from_pb(request)
        if not peer_is_local(context.peer()):
            raise NotSameHostError(
                "shared-memory handles open only on the daemon's host; connect over its "
                "Unix socket or a loopback address"
            )
        grant = self.cache.acquire(want)
        return acquire_response_pb(grant, self._encoded_views(grant, want.tensor_format))

    def _encoded_views(self, grant: Grant, tensor_format: TensorFormat) -> pb.AcquireResponse:
        key = (grant.model.name, tensor_format)
        cached = self._views.get(key)
        if cached is None or cached[0] is not grant.tensors:
            cached = (grant.tensors, tensor_views_pb(grant.tensors, tensor_format))
            self._views[key] = cached
        return cached[1]

    async def KeepAlive(
        self, request_iterator: AsyncIterator[pb.KeepAliveRequest], context: Context
    ) -> AsyncIterator[pb.KeepAliveResponse]:
        session, outbox = self.cache.open_session()
        reader = asyncio.create_task(self._read_keepalives(request_iterator, session, outbox))
        try:
            while (item := await outbox.get()) is not None:
                if isinstance(item, pb.KeepAliveResponse):
                    yield item  # renewed and encoded in the reader's fair turn
                else:
                    yield await self._keepalive_response(session, cast(list[LeaseStatus], item))
        finally:
            reader.cancel()
            self.fair.forget(session)
            self.cache.close_session(session)

    async def _keepalive_response(
        self, session: int, statuses: list[LeaseStatus]
    ) -> pb.KeepAliveResponse:
        """The answer naming ``statuses`` that the cache pushed (revocations, a hand-over),
        encoded in fair batches (:mod:`.fair_queue`)."""
        response = keepalive_response_pb(
            self.cache.instance_id, (), hand_over=self.cache.handing_over
        )
        # Charged nothing: a push is the daemon's doing, not the stream's.
        async with self.fair.turn(session, 0) as pause:
            for at in range(0, len(statuses), BATCH_IDS):
                if at:
                    await pause()
                add_lease_statuses(response, statuses[at : at + BATCH_IDS])
        return response

    async def _read_keepalives(
        self, requests: AsyncIterator[pb.KeepAliveRequest], session: int, outbox: Outbox
    ) -> None:
        budget = _TokenBucket(MAX_KEEPALIVES_PER_SECOND, KEEPALIVE_BURST)
        try:
            async for request in requests:
                if len(request.lease_ids) > MAX_LEASES_PER_REQUEST:
                    break
                await budget.take(max(1, -(-len(request.lease_ids) // IDS_PER_KEEPALIVE)))
                # A peer that sends without reading must not grow the daemon's memory: stop
                # reading (so its sends stall) until it has taken its answers.
                while outbox.qsize() >= MAX_PENDING_RESPONSES:
                    await asyncio.sleep(0.05)
                # Renewed and answered in its fair turn, in batches: other RPCs are served
                # between two, so a message of 4096 ids holds the event loop for one batch
                # at a time. Encoded at once: a queued answer is its message, not thousands
                # of status objects waiting for a turn of their own (which held 200 MiB
                # more in a flood of 200 streams).
                ids = request.lease_ids
                response = keepalive_response_pb(
                    self.cache.instance_id, (), hand_over=self.cache.handing_over
                )
                async with self.fair.turn(session, len(ids)) as pause:
                    for at in range(0, len(ids), BATCH_IDS):
                        if at:
                            await pause()
                        statuses = self.cache.renew(ids[at : at + BATCH_IDS], session)
                        add_lease_statuses(response, statuses)
                outbox.put_nowait(response)
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the peer went away; the stream's end releases its leases
        finally:
            outbox.put_nowait(None)

    @_unary
    async def Release(self, request: pb.ReleaseRequest, context: Context) -> pb.ReleaseResponse:
        self.cache.release(check_len("lease_id", request.lease_id, MAX_ID_CHARS))
        return pb.ReleaseResponse()

    @_unary
    async def Evict(self, request: pb.EvictRequest, context: Context) -> pb.EvictResponse:
        check_len("name", request.name, MAX_PATH_CHARS)
        evicted = self.cache.evict(request.name, request.force)
        for tensor_format in get_args(TensorFormat):
            self._views.pop((request.name, tensor_format), None)
        return pb.EvictResponse(model=model_pb(evicted))

    @_unary
    async def ListLeases(
        self, request: pb.ListLeasesRequest, context: Context
    ) -> pb.ListLeasesResponse:
        check_len("model", request.model, MAX_PATH_CHARS)
        # Read off the event loop: one readlink and getsockopt per descriptor.
        peers = await asyncio.to_thread(connections, self.socket) if self.socket else []
        # A TCP peer (a fleet daemon, a remote operator) sees only its own transfer
        # leases: the workers' lease ids would let it read or end what they hold.
        own = None if peer_is_unix(context.peer()) else _peer_identity(context)
        holders = self.cache.lease_holders(request.model, peers, only_peer=own)
        return pb.ListLeasesResponse(leases=[lease_holder_pb(h) for h in holders])

    @_unary
    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: Context
    ) -> pb.GetServerInfoResponse:
        return server_info_pb(self.cache.server_info())

    @_unary
    async def BeginSeed(
        self, request: pb.BeginSeedRequest, context: Context
    ) -> pb.BeginSeedResponse:
        if len(request.components) > MAX_COMPONENTS:
            raise InvalidArgumentError(
                f"more than {MAX_COMPONENTS} components", metadata={"field": "components"}
            )
        components = {c.name: c.digest for c in request.components}
        who = _peer_identity(context)
        lease_id, entry = self.seeds.begin(components, float(request.ttl_seconds), who)
        data_port, data_secrets = 0, []
        if self.data_plane is not None and request.data_connections > 0:
            from weightcache_service.sendfile_serve import peer_address

            address = peer_address(context.peer())
            data_port = self.data_plane.port
            data_secrets = self.data_plane.grant(lease_id, who, address, request.data_connections)
        return pb.BeginSeedResponse(
            data_port=data_port,
            data_secrets=data_secrets,
            lease_id=lease_id,
            model=model_pb(self.cache.info(entry)),
            shards=[
                pb.ShardDigest(name=name, file_sha256=digest)
                for name, digest in sorted(entry.file_sha256.items())
            ],
            arena_size=entry.size,
            tensors=[tensor_view_pb(v) for v in entry.views],
        )

    async def ReadSeedData(
        self, request: pb.ReadSeedDataRequest, context: Context
    ) -> AsyncIterator[pb.ReadSeedDataResponse]:
        async for message in self.read_seed_data_raw(request, context):
            yield pb.ReadSeedDataResponse.FromString(message)

    async def read_seed_data_raw(
        self, request: pb.ReadSeedDataRequest, context: Context
    ) -> AsyncIterator[bytes]:
        """ReadSeedData, each response already serialized (the same bytes on the wire):
        what the daemon registers for the method, with no response serializer
        (:func:`register_raw_seed_data`), to spare two copies of every chunk."""
        try:
            check_len("lease_id", request.lease_id, MAX_ID_CHARS)
            chunks = self.seeds.read(
                request.lease_id,
                request.offset,
                request.length,
                request.chunk_bytes,
                _peer_identity(context),
            )
            async for _offset, message in chunks:
                yield message
        except WeightCacheError as err:
            self.refusals.refused("ReadSeedData", err.reason, err.detail)
            await abort(context, err)

    @_unary
    async def EndSeed(self, request: pb.EndSeedRequest, context: Context) -> pb.EndSeedResponse:
        check_len("lease_id", request.lease_id, MAX_ID_CHARS)
        who = _peer_identity(context)
        self.seeds.end(request.lease_id, who)
        if self.data_plane is not None:
            self.data_plane.forget(request.lease_id, who)
        return pb.EndSeedResponse()


def register_raw_seed_data(server: grpc.aio.Server, servicer: WeightCacheServicer) -> None:
    """Serve ReadSeedData through :meth:`WeightCacheServicer.read_seed_data_raw` (the
    responses serialized by the servicer itself; the wire is the same). Call it after
    ``add_WeightCacheServiceServicer_to_server``: the later registration of the method
    is the one served."""
    handler = grpc.unary_stream_rpc_method_handler(
        servicer.read_seed_data_raw,
        request_deserializer=pb.ReadSeedDataRequest.FromString,
        response_serializer=None,
    )
    # grpc's type stubs lack the method (grpcio >= 1.62 has it).
    server.add_registered_method_handlers(  # type: ignore[attr-defined]
        "weightcache.v1.WeightCacheService", {"ReadSeedData": handler}
    )


#: Refusals of an Acquire by file identity that the SDK follows with one by fingerprint.
_PROBE_MISSES = frozenset({ModelNotFoundError.reason, FingerprintMismatchError.reason})


def _asked_again(request: pb.AcquireRequest, err: WeightCacheError) -> str:
    """``probe_missed`` or ``waiting`` for a refusal the worker asks again after (see
    :mod:`.metrics`), else empty: a final refusal."""
    if request.files and err.reason in _PROBE_MISSES:
        return "probe_missed"
    if request.asks_again_if_loading and isinstance(err, ModelLoadingError):
        return "waiting"
    return ""


def _peer_identity(context: Context) -> str:
    """Who a seeding peer is, for its transfer leases: its verified certificate's names
    (sorted, comma-joined); a Unix-socket client (no certificate), ``context.peer()``."""
    return ",".join(sorted(certificate_names(context))) or context.peer()


def _subject(request: Any) -> dict[str, Any]:
    """What a request names, for a refusal's log line: a model's ``name`` or a ``path``."""
    fields = {"name": "model", "path": "path", "repo_id": "repo_id", "revision": "revision"}
    return {
        key: clip(value)
        for field_name, key in fields.items()
        if isinstance(value := getattr(request, field_name, None), str) and value
    }


def _preload_response(entry: Entry) -> pb.PreloadResponse:
    return pb.PreloadResponse(
        model=entry.name, state=model_state_pb(entry.state), progress=progress_pb(entry.progress())
    )


class _TokenBucket:
    """``rate`` events per second on average, ``burst`` at once (a token bucket)."""

    def __init__(self, rate: float, burst: float) -> None:
        self._rate = rate
        self._burst = burst
        self._tokens = burst
        self._at = time.monotonic()

    async def take(self, cost: float = 1.0) -> None:
        """Wait until an event of ``cost`` tokens (at most ``burst``) is allowed, and
        count it."""
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < cost:
            await asyncio.sleep((cost - self._tokens) / self._rate)
            self._tokens = cost
            self._at = time.monotonic()
        self._tokens -= cost
