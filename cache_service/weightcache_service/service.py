"""The ``weightcache.v1.WeightCacheService`` servicer: the RPCs over the store and leases."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import structlog
import torch
from google.protobuf import duration_pb2, timestamp_pb2

from weightcache.core.checkpoint import Checkpoint, open_checkpoint
from weightcache.core.errors import (
    DrainingError,
    FingerprintMismatchError,
    InvalidArgumentError,
    LeasesActiveError,
    ModelLoadingError,
    ModelNotFoundError,
    NotSameHostError,
    PermissionDeniedError,
    WeightCacheError,
)
from weightcache.core.fingerprint import (
    Fingerprint,
    Level,
    compute_fingerprint,
    fingerprint_pb,
    level_from_pb,
)
from weightcache.core.plugins import PluginStep
from weightcache.core.recipe import Pipeline, Placement, Recipe, parse_dtype
from weightcache.core.tp import TPPlan, over_bounds
from weightcache.core.version import PROTOCOL_VERSION, __version__
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc
from weightcache_service.access import peer_is_local
from weightcache_service.backend import Backend
from weightcache_service.leases import Lease, LeaseTable
from weightcache_service.status import to_grpc_status
from weightcache_service.store import Entry, Store, clip

log = structlog.get_logger("weightcache.daemon")

MAX_ID_CHARS = 128
MAX_PATH_CHARS = 4096
MAX_COMPONENTS = 10_000
MAX_LEASES_PER_REQUEST = 4096
MAX_RECIPE_ITEMS = 256
MAX_PENDING_RESPONSES = 64
PROGRESS_INTERVAL = 0.25

R = TypeVar("R")


@dataclass
class ServiceOptions:
    """What the operator allowed.

    Attributes:
        allow_remote_preload: accept Preload RPCs at all.
        model_roots: folders (realpath) a remote Preload path must resolve inside.
        drain_timeout: seconds lease holders get after REVOKING (a forced Evict, or a
            drain at SIGTERM) before the memory is freed.
        allowed_plugins: recipe plugins a remote Preload may name.
    """

    allow_remote_preload: bool = False
    model_roots: list[Path] = field(default_factory=list)
    drain_timeout: float = 30.0
    allowed_plugins: frozenset[str] = frozenset()


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: WeightCacheError) -> None:
    """End the RPC with ``error`` as a rich status (always raises)."""
    status = to_grpc_status(error)
    await context.abort(status.code, status.details, status.trailing_metadata)


def _unary(
    fn: Callable[[Any, Any, Any], Awaitable[R]],
) -> Callable[[Any, Any, Any], Awaitable[R]]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Any) -> R:
        try:
            return await fn(self, request, context)
        except WeightCacheError as err:
            await abort(context, err)
            raise AssertionError("unreachable: abort raises") from err

    return wrapper


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def _check_len(field_name: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidArgumentError(
            f"{field_name} is {len(value)} characters, over the limit of {limit}",
            metadata={"field": field_name},
        )


class WeightCacheService(pb_grpc.WeightCacheServiceServicer):
    """Serves one daemon's store.

    Args:
        store: the models held.
        leases: the lease table (its clock drives all lease timing).
        options: operator's permissions.
        instance_id: random id of this daemon process.
        backend: where arenas live (for the environment stamp and server info).
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
        self.starting = False
        self.start_time = time.time()
        self._sessions: dict[int, asyncio.Queue[pb.KeepAliveResponse | None]] = {}
        self._loads: set[asyncio.Task[None]] = set()
        self._environment = pb.Environment(
            weightcache_version=__version__,
            torch_version=torch.__version__,
            backend=backend.name,
            device_uuid=backend.device_uuid,
        )

    # -- loading ---------------------------------------------------------------------

    async def begin_load(
        self,
        path: str,
        recipe: Recipe,
        placement: Placement,
        level: Level,
        *,
        confine: bool = False,
    ) -> tuple[Entry, asyncio.Task[None]]:
        """Validate and fingerprint a checkpoint (off the event loop), then start loading it.

        Args:
            confine: every file read must resolve inside a model root (remote Preload).

        Raises:
            InvalidCheckpointError: the checkpoint is malformed.
            PermissionDeniedError: ``confine`` and a file resolves outside the roots.
            ModelExistsError: the fingerprint is already held.
        """

        def prepare() -> tuple[Checkpoint, Pipeline, Fingerprint]:
            # Confinement is checked on each file as opened: a path checked before the
            # open could be swapped for a symlink in between.
            check = self._check_opened if confine else None
            checkpoint = open_checkpoint(path, check_file=check)
            try:
                pipeline = recipe.build(checkpoint, placement)
                fp = compute_fingerprint(checkpoint, pipeline, placement, level)
            except BaseException:
                checkpoint.close()
                raise
            return checkpoint, pipeline, fp

        checkpoint, pipeline, fp = await asyncio.to_thread(prepare)
        try:
            entry = self.store.add(checkpoint, recipe, placement, pipeline, fp)
        except BaseException:
            checkpoint.close()
            raise
        log.info("loading", model=entry.name, path=str(checkpoint.root), bytes=entry.size)
        task = asyncio.create_task(asyncio.to_thread(self.store.load, entry))
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)
        task.add_done_callback(lambda _t: self._log_loaded(entry))
        return entry, task

    @staticmethod
    def _log_loaded(entry: Entry) -> None:
        if entry.state == pb.MODEL_STATE_READY:
            log.info(
                "loaded",
                model=entry.name,
                bytes=entry.size,
                tensors=len(entry.slots),
                seconds=round(entry.load_seconds, 3),
                fingerprint=entry.fingerprint.digest[:16],
            )
        else:
            log.error("load failed", model=entry.name, error=entry.error)

    async def wait_loads(self) -> None:
        """Wait for every load in progress to end (at shutdown)."""
        entries = self.store.entries()
        for entry in entries:
            entry.cancelled = True
        # Wait on the threads themselves: a cancelled asyncio task does not stop its thread,
        # and freeing an arena a thread still writes into would crash the process.
        await asyncio.to_thread(lambda: [entry.finished.wait() for entry in entries])

    # -- RPCs --------------------------------------------------------------------------

    async def Preload(
        self, request: pb.PreloadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.PreloadResponse]:
        try:
            path = self._allowed_path(request.path)
            recipe = self._allowed_recipe(request.recipe)
            placement = Placement(request.placement.tp_rank, request.placement.tp_size or 1)
            level = level_from_pb(request.fingerprint_level)
            if level is None:
                raise InvalidArgumentError(
                    "unsupported fingerprint_level", metadata={"field": "fingerprint_level"}
                )
            entry, task = await self.begin_load(path, recipe, placement, level, confine=True)
            while not task.done():
                yield pb.PreloadResponse(
                    model=entry.name, state=entry.state, progress=_progress(entry)
                )
                await asyncio.wait([task], timeout=PROGRESS_INTERVAL)
            if entry.failure is not None:
                raise entry.failure
            yield pb.PreloadResponse(model=entry.name, state=entry.state, progress=_progress(entry))
        except WeightCacheError as err:
            await abort(context, err)

    def _allowed_recipe(self, message: pb.Recipe) -> Recipe:
        if len(message.plugins) > MAX_RECIPE_ITEMS:
            raise InvalidArgumentError(
                f"over {MAX_RECIPE_ITEMS} plugins", metadata={"field": "recipe.plugins"}
            )
        # Bounded before anything is compiled: matching a large plan costs daemon CPU.
        too_large = over_bounds(rule.pattern for rule in message.tp_rules)
        if too_large is not None:
            raise InvalidArgumentError(
                f"recipe.tp_rules: {too_large}", metadata={"field": "recipe.tp_rules"}
            )
        steps = []
        for plugin in message.plugins:
            if plugin.name not in self.options.allowed_plugins:
                raise PermissionDeniedError(
                    f"recipe plugin {plugin.name!r} is not allowed; the operator allows "
                    f"{sorted(self.options.allowed_plugins)} (--allow-recipe)",
                    metadata={"plugin": plugin.name[:MAX_ID_CHARS]},
                )
            steps.append(PluginStep(plugin.name, tuple(sorted(plugin.params.items()))))
        rules = tuple((r.pattern, r.style) for r in message.tp_rules)
        return Recipe(
            dtype=parse_dtype(message.dtype or None),
            tp_plan=TPPlan(rules) if rules else None,
            plugins=tuple(steps),
        )

    def _allowed_path(self, path: str) -> str:
        if not self.options.allow_remote_preload:
            raise PermissionDeniedError(
                "remote Preload is disabled; start the daemon with --allow-remote-preload "
                "and --model-root"
            )
        _check_len("path", path, MAX_PATH_CHARS)
        if not path or "\0" in path:
            raise InvalidArgumentError("path is empty or holds NUL", metadata={"field": "path"})
        return self._check_inside(path)

    def _check_inside(self, path: str) -> str:
        """``path`` resolved with realpath, if it lies inside a model root: an early refusal;
        each file is checked again as opened (:meth:`_check_opened`).

        Raises:
            PermissionDeniedError: it resolves outside every ``--model-root``.
        """
        real = Path(os.path.realpath(path))
        for root in self.options.model_roots:
            if real == root or root in real.parents:
                return str(real)
        raise PermissionDeniedError(
            f"{clip(path)} resolves to {clip(str(real))}, outside every --model-root",
            metadata={"path": clip(str(real))},
        )

    def _check_opened(self, real: Path) -> None:
        """Refuse an opened checkpoint file whose real location is outside every model root.

        Raises:
            PermissionDeniedError: ``real`` is outside every ``--model-root``.
        """
        if not any(real == root or root in real.parents for root in self.options.model_roots):
            raise PermissionDeniedError(
                f"{clip(str(real))} is outside every --model-root",
                metadata={"path": clip(str(real))},
            )

    @_unary
    async def GetModel(
        self, request: pb.GetModelRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetModelResponse:
        _check_len("name", request.name, MAX_PATH_CHARS)
        return pb.GetModelResponse(model=self._model_pb(self.store.get(request.name)))

    @_unary
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[self._model_pb(e) for e in self.store.entries()])

    @_unary
    async def Acquire(
        self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AcquireResponse:
        if self.draining:
            raise DrainingError("the daemon is draining; load from disk or retry elsewhere")
        _validate_acquire(request)
        if not peer_is_local(context.peer()):
            raise NotSameHostError(
                "shared-memory handles open only on the daemon's host; connect over its "
                "Unix socket or a loopback address"
            )
        try:
            entry = self.store.find(request.fingerprint, request.checkpoint_path)
        except (FingerprintMismatchError, ModelNotFoundError) as err:
            if self.starting:
                raise ModelLoadingError(
                    "the daemon is starting: its start-up models are not all registered yet",
                    metadata={"bytes_done": "0", "bytes_total": "0"},
                ) from None
            raise self._with_skew(err, request.environment) from None
        if entry.handle is None:
            raise ModelLoadingError(f"model {entry.name!r} is not ready")
        ttl = request.ttl.ToNanoseconds() / 1e9 if request.HasField("ttl") else None
        lease = self.leases.grant(entry.name, ttl, request.request_id, request.pid)
        log.info("acquired", model=entry.name, lease=lease.lease_id[:8], pid=request.pid)
        return pb.AcquireResponse(
            lease=self._lease_pb(lease),
            model=self._model_pb(entry),
            storage=entry.handle,
            tensors=entry.views,
            environment=self._environment,
        )

    def _with_skew(self, err: WeightCacheError, client: pb.Environment) -> WeightCacheError:
        """Say so when a miss comes with a version skew: the environment stamp is kept out
        of the identity, so a skew shows up as a miss that this note explains."""
        mine = self._environment
        skews = [
            f"{key} client {getattr(client, key)} daemon {getattr(mine, key)}"
            for key in ("weightcache_version", "torch_version")
            if getattr(client, key) and getattr(client, key) != getattr(mine, key)
        ]
        if not skews:
            return err
        err.detail = f"{err.detail}; environment differs: {', '.join(skews)}"
        err.args = (err.detail,)
        err.metadata["environment"] = "; ".join(skews)
        return err

    async def KeepAlive(
        self,
        request_iterator: AsyncIterator[pb.KeepAliveRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.KeepAliveResponse]:
        session = self.leases.open_session()
        outbox: asyncio.Queue[pb.KeepAliveResponse | None] = asyncio.Queue()
        self._sessions[session] = outbox
        reader = asyncio.create_task(self._read_keepalives(request_iterator, session, outbox))
        try:
            while (message := await outbox.get()) is not None:
                yield message
        finally:
            reader.cancel()
            del self._sessions[session]
            for lease in self.leases.end_session(session):
                log.info("lease ended: keepalive stream closed", lease=lease.lease_id[:8])
            self._free_evicted()

    async def _read_keepalives(
        self,
        requests: AsyncIterator[pb.KeepAliveRequest],
        session: int,
        outbox: asyncio.Queue[pb.KeepAliveResponse | None],
    ) -> None:
        try:
            async for request in requests:
                if len(request.lease_ids) > MAX_LEASES_PER_REQUEST:
                    break
                # A peer that sends without reading must not grow the daemon's memory: stop
                # reading (so its sends stall) until it has taken its answers.
                while outbox.qsize() >= MAX_PENDING_RESPONSES:
                    await asyncio.sleep(0.05)
                outbox.put_nowait(self._renew(request, session))
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the peer went away; the stream's end releases its leases
        finally:
            outbox.put_nowait(None)

    def _renew(self, request: pb.KeepAliveRequest, session: int) -> pb.KeepAliveResponse:
        statuses = []
        expired = False
        for lease_id in request.lease_ids:
            lease = self.leases.renew(lease_id[:MAX_ID_CHARS], session)
            # Expired since the last reap: gone now (NOT_FOUND), and what only it held is
            # freed now rather than at the next reaper tick.
            expired |= lease is None and self._end_if_expired(lease_id[:MAX_ID_CHARS])
            statuses.append(self._lease_status(lease_id, lease))
        if expired:
            self._free_evicted()
        return pb.KeepAliveResponse(instance_id=self.instance_id, leases=statuses)

    def _end_if_expired(self, lease_id: str) -> bool:
        lease = self.leases.end_if_expired(lease_id)
        if lease is not None:
            log.info("lease expired", model=lease.model, lease=lease.lease_id[:8])
        return lease is not None

    def _lease_status(self, lease_id: str, lease: Lease | None) -> pb.LeaseStatus:
        if lease is None:
            return pb.LeaseStatus(lease_id=lease_id, state=pb.LEASE_STATE_NOT_FOUND)
        status = pb.LeaseStatus(lease_id=lease_id, expire_time=self._wall(lease.expire_at))
        if lease.revoke_deadline is not None:
            status.state = pb.LEASE_STATE_REVOKING
            status.revoke_deadline.CopyFrom(self._wall(lease.revoke_deadline))
        else:
            status.state = pb.LEASE_STATE_ACTIVE
        return status

    @_unary
    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReleaseResponse:
        _check_len("lease_id", request.lease_id, MAX_ID_CHARS)
        expired = self._end_if_expired(request.lease_id)
        lease = self.leases.release(request.lease_id)
        if lease is not None:
            log.info("released", model=lease.model, lease=lease.lease_id[:8])
        if lease is not None or expired:
            self._free_evicted()
        return pb.ReleaseResponse()

    @_unary
    async def Evict(
        self, request: pb.EvictRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EvictResponse:
        _check_len("name", request.name, MAX_PATH_CHARS)
        entry = self.store.get(request.name)
        if entry.state == pb.MODEL_STATE_LOADING:
            raise ModelLoadingError(f"model {entry.name!r} is loading; evict it once loaded")
        holders = self.leases.for_model(entry.name)
        if holders and not request.force:
            raise LeasesActiveError(
                f"model {entry.name!r} has {len(holders)} live lease(s); release them or "
                "evict with force (weightcache evict --force)",
                metadata={"model": entry.name, "leases": str(len(holders))},
            )
        snapshot = self._model_pb(entry)
        if holders:
            self._revoke(entry)
        else:
            self.store.remove(entry.name)
            log.info("evicted", model=entry.name)
        return pb.EvictResponse(model=snapshot)

    def close_sessions(self) -> None:
        """End every KeepAlive stream (at shutdown, so that stopping waits for none)."""
        for outbox in self._sessions.values():
            outbox.put_nowait(None)

    def revoke_all(self) -> int:
        """Revoke every lease (drain); returns how many were live."""
        count = len(self.leases)
        for entry in self.store.entries():
            if self.leases.for_model(entry.name):
                self._revoke(entry)
        return count

    def _revoke(self, entry: Entry) -> None:
        entry.state = pb.MODEL_STATE_EVICTING
        deadline = self.leases.clock() + self.options.drain_timeout
        revoked = self.leases.revoke(entry.name, deadline)
        log.warning("revoking", model=entry.name, leases=len(revoked))
        for lease in revoked:
            outbox = self._sessions.get(lease.session) if lease.session is not None else None
            if outbox is not None:
                outbox.put_nowait(
                    pb.KeepAliveResponse(
                        instance_id=self.instance_id,
                        leases=[self._lease_status(lease.lease_id, lease)],
                    )
                )

    @_unary
    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(
            version=__version__,
            protocol_version=PROTOCOL_VERSION,
            torch_version=torch.__version__,
            backend=self.backend.name,
            device=self.backend.device,
            device_uuid=self.backend.device_uuid,
            memory_held_bytes=self.store.held_bytes(),
            memory_budget_bytes=self._budget_limit(),
            instance_id=self.instance_id,
            start_time=_timestamp(self.start_time),
        )

    def _budget_limit(self) -> int:
        budget = self.store.budget
        limit = budget.limit if budget is not None else None
        return limit or 0

    # -- housekeeping ------------------------------------------------------------------

    def reap(self) -> None:
        """End expired leases and free evicting models nobody holds any more."""
        for lease in self.leases.reap():
            log.info("lease expired", model=lease.model, lease=lease.lease_id[:8])
        self._free_evicted()

    def _free_evicted(self) -> None:
        for entry in self.store.entries():
            if entry.state == pb.MODEL_STATE_EVICTING and not self.leases.for_model(entry.name):
                self.store.remove(entry.name)
                log.info("evicted", model=entry.name)

    def _wall(self, clock_seconds: float) -> timestamp_pb2.Timestamp:
        return _timestamp(time.time() + clock_seconds - self.leases.clock())

    def _lease_pb(self, lease: Lease) -> pb.Lease:
        return pb.Lease(
            lease_id=lease.lease_id,
            model=lease.model,
            ttl=_duration(lease.ttl),
            expire_time=self._wall(lease.expire_at),
            instance_id=self.instance_id,
        )

    def _model_pb(self, entry: Entry) -> pb.Model:
        model = pb.Model(
            name=entry.name,
            state=entry.state,
            fingerprint=fingerprint_pb(entry.fingerprint),
            path=str(entry.checkpoint.root),
            recipe=recipe_pb(entry.pipeline),
            placement=pb.Placement(
                tp_rank=entry.placement.tp_rank, tp_size=entry.placement.tp_size
            ),
            size_bytes=entry.size,
            tensor_count=len(entry.slots),
            lease_count=len(self.leases.for_model(entry.name)),
            create_time=_timestamp(entry.create_time),
            error=entry.error,
            progress=_progress(entry),
            metadata=entry.checkpoint.metadata,
        )
        if entry.state == pb.MODEL_STATE_READY:
            model.load_duration.CopyFrom(_duration(entry.load_seconds))
        return model


def recipe_pb(pipeline: Pipeline) -> pb.Recipe:
    """The recipe as resolved for a model (its plan and plugins as they were applied)."""
    identity = pipeline.identity
    return pb.Recipe(
        dtype=identity["dtype"] or "",
        plugins=[
            pb.RecipePlugin(name=step["name"], params=dict(step["params"]))
            for step in identity["plugins"]
        ],
        tp_rules=[
            pb.TensorParallelRule(pattern=pattern, style=style)
            for pattern, style in identity["tp_plan"] or []
        ],
    )


def _progress(entry: Entry) -> pb.LoadProgress:
    return pb.LoadProgress(
        bytes_done=entry.bytes_done,
        bytes_total=entry.data_bytes,
        tensors_done=entry.tensors_done,
        tensors_total=len(entry.slots),
    )


def _validate_acquire(request: pb.AcquireRequest) -> None:
    _check_len("request_id", request.request_id, MAX_ID_CHARS)
    _check_len("checkpoint_path", request.checkpoint_path, MAX_PATH_CHARS)
    digest = request.fingerprint.digest
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise InvalidArgumentError(
            "fingerprint.digest must be 64 lowercase hex characters",
            metadata={"field": "fingerprint.digest"},
        )
    if len(request.fingerprint.components) > MAX_COMPONENTS:
        raise InvalidArgumentError(
            f"more than {MAX_COMPONENTS} fingerprint components",
            metadata={"field": "fingerprint.components"},
        )
    if request.HasField("ttl") and request.ttl.ToNanoseconds() < 0:
        raise InvalidArgumentError("ttl must not be negative", metadata={"field": "ttl"})
