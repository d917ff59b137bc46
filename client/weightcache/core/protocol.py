"""Every conversion between domain objects and the ``weightcache.v1`` protobuf messages.

The SDK, the CLI and the daemon convert here and nowhere else: ``*_pb`` builds a message
from a domain object, ``*_from_pb`` reads one back (the two round-trip to an equal value).
The checks a request must pass before it means anything (string lengths, digest format,
list sizes) run while decoding and raise :class:`InvalidArgumentError` with
``metadata["field"]`` naming the field. Errors cross the wire as a gRPC status carrying one
``google.rpc.ErrorInfo`` (AIP-193): :func:`~weightcache.core.status.to_grpc_status` and
:func:`~weightcache.core.status.from_rpc_error`, in the torch-free
:mod:`weightcache.core.status`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from google.protobuf import duration_pb2, timestamp_pb2

# MAX_FILES bounds an Acquire by file identity: as many files as a worker lists.
from weightcache.core.checkpoint import MAX_FILES, FileIdentity
from weightcache.core.dtypes import itemsize
from weightcache.core.errors import HandleError, InvalidArgumentError
from weightcache.core.fingerprint import DEFAULT_LEVEL, Fingerprint, Level
from weightcache.core.plugins import PluginStep
from weightcache.core.recipe import Placement, Recipe, parse_dtype
from weightcache.core.records import (
    Acquisition,
    CudaIpcHandle,
    Environment,
    Grant,
    LeaseHolder,
    LeaseInfo,
    LeaseState,
    LeaseStatus,
    LoadProgress,
    ModelInfo,
    ModelState,
    PeerCredentials,
    ServerInfo,
    SharedMemoryHandle,
    StorageHandle,
    TensorFormat,
    TensorView,
    UnlinkedArena,
    ViewColumns,
    WorkerDescription,
)
from weightcache.core.tp import TPPlan, over_bounds
from weightcache.v1 import weight_cache_service_pb2 as pb

#: Bounds on request fields: a request names ids, paths and a fingerprint, never data.
MAX_ID_CHARS = 128
MAX_PATH_CHARS = 4096
MAX_COMPONENTS = 10_000
MAX_LEASES_PER_REQUEST = 4096
MAX_RECIPE_ITEMS = 256
#: A host name (RFC 1035: 253 characters and a final dot).
MAX_HOSTNAME_CHARS = 255

_HEX = frozenset("0123456789abcdef")


def check_len(field_name: str, value: str, limit: int) -> str:
    """``value``, if it is at most ``limit`` characters.

    Raises:
        InvalidArgumentError: it is longer (``metadata["field"]`` is ``field_name``).
    """
    if len(value) > limit:
        raise InvalidArgumentError(
            f"{field_name} is {len(value)} characters, over the limit of {limit}",
            metadata={"field": field_name},
        )
    return value


# -- times ------------------------------------------------------------------------------


def timestamp_pb(seconds: float) -> timestamp_pb2.Timestamp:
    """Epoch seconds as a Timestamp (nanosecond resolution)."""
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def timestamp_from_pb(ts: timestamp_pb2.Timestamp) -> float:
    """A Timestamp as epoch seconds."""
    return ts.ToNanoseconds() / 1e9


def duration_pb(seconds: float) -> duration_pb2.Duration:
    """Seconds as a Duration (nanosecond resolution)."""
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def duration_from_pb(d: duration_pb2.Duration) -> float:
    """A Duration as seconds."""
    return d.ToNanoseconds() / 1e9


# -- fingerprints -----------------------------------------------------------------------

_LEVEL_TO_PB = {
    "layout": pb.FINGERPRINT_LEVEL_LAYOUT,
    "sampled": pb.FINGERPRINT_LEVEL_SAMPLED,
    "full": pb.FINGERPRINT_LEVEL_FULL,
}
_LEVEL_FROM_PB: dict[int, Level] = {
    pb.FINGERPRINT_LEVEL_UNSPECIFIED: DEFAULT_LEVEL,
    pb.FINGERPRINT_LEVEL_LAYOUT: "layout",
    pb.FINGERPRINT_LEVEL_SAMPLED: "sampled",
    pb.FINGERPRINT_LEVEL_FULL: "full",
}


def level_pb(level: Level) -> pb.FingerprintLevel:
    """A content level as its wire enum value."""
    return _LEVEL_TO_PB[level]


def level_from_pb(value: int) -> Level:
    """The level a wire enum value names (unspecified: the default, ``full``).

    Raises:
        InvalidArgumentError: the value names no level (``field=fingerprint_level``).
    """
    level = _LEVEL_FROM_PB.get(value)
    if level is None:
        raise InvalidArgumentError(
            "unsupported fingerprint_level", metadata={"field": "fingerprint_level"}
        )
    return level


def fingerprint_pb(fp: Fingerprint) -> pb.Fingerprint:
    """A fingerprint as its wire message."""
    return pb.Fingerprint(
        digest=fp.digest,
        level=_LEVEL_TO_PB[fp.level],
        components=[pb.FingerprintComponent(name=n, digest=d) for n, d in fp.components.items()],
    )


def fingerprint_from_pb(message: pb.Fingerprint) -> Fingerprint:
    """A wire fingerprint as a :class:`Fingerprint` (components sorted by name).

    The level only describes how the digest was made, so a level this side does not know
    reads as the default (``full``) rather than refusing a digest that may match.

    Raises:
        InvalidArgumentError: the digest is not 64 lowercase hex characters
            (``field=fingerprint.digest``), or there are more than
            :data:`MAX_COMPONENTS` components (``field=fingerprint.components``).
    """
    digest = message.digest
    if len(digest) != 64 or not _HEX.issuperset(digest):
        raise InvalidArgumentError(
            "fingerprint.digest must be 64 lowercase hex characters",
            metadata={"field": "fingerprint.digest"},
        )
    return _fingerprint(message)


def _fingerprint(message: pb.Fingerprint) -> Fingerprint:
    if len(message.components) > MAX_COMPONENTS:
        raise InvalidArgumentError(
            f"more than {MAX_COMPONENTS} fingerprint components",
            metadata={"field": "fingerprint.components"},
        )
    components = {c.name: c.digest for c in message.components}
    return Fingerprint(
        digest=message.digest,
        level=_LEVEL_FROM_PB.get(message.level, DEFAULT_LEVEL),
        components=dict(sorted(components.items())),
    )


# -- recipes and placements -------------------------------------------------------------


def recipe_pb(recipe: Recipe) -> pb.Recipe:
    """A recipe as its wire message (no dtype: empty; no plan: no rules)."""
    rules = recipe.tp_plan.rules if recipe.tp_plan is not None else ()
    return pb.Recipe(
        dtype=recipe.dtype or "",
        plugins=[
            pb.RecipePlugin(name=s.name, params=dict(s.params), version=s.version)
            for s in recipe.plugins
        ],
        tp_rules=[pb.TensorParallelRule(pattern=p, style=s) for p, s in rules],
    )


def recipe_from_pb(message: pb.Recipe, admit: Callable[[str], None] | None = None) -> Recipe:
    """A wire recipe as a :class:`Recipe`; an empty dtype or rule list means none.

    Args:
        admit: called with each plugin name before anything is built; raises to refuse
            it (the daemon's ``--allow-recipe`` list).

    Raises:
        InvalidArgumentError: over :data:`MAX_RECIPE_ITEMS` plugins
            (``field=recipe.plugins``), or rules over the plan bounds of
            :func:`weightcache.core.tp.over_bounds` (``field=recipe.tp_rules``).
        RecipeError: an unsupported dtype or tensor-parallel style.
        Exception: whatever ``admit`` raises.
    """
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
        if admit is not None:
            admit(plugin.name)
        # The version is kept (a Model's recipe reports it) but never decides anything.
        steps.append(PluginStep(plugin.name, tuple(sorted(plugin.params.items())), plugin.version))
    rules = tuple((r.pattern, r.style) for r in message.tp_rules)
    return Recipe(
        dtype=parse_dtype(message.dtype or None),
        tp_plan=TPPlan(rules) if rules else None,
        plugins=tuple(steps),
    )


def placement_pb(placement: Placement) -> pb.Placement:
    """A placement as its wire message."""
    return pb.Placement(tp_rank=placement.tp_rank, tp_size=placement.tp_size)


def placement_from_pb(message: pb.Placement) -> Placement:
    """A wire placement (``tp_size`` 0: 1) as a :class:`Placement`.

    Raises:
        RecipeError: the rank is outside ``[0, tp_size)``, or ``tp_size`` is negative.
    """
    return Placement(message.tp_rank, message.tp_size or 1)


# -- models -----------------------------------------------------------------------------

_STATE_TO_PB: dict[ModelState, pb.ModelState] = {
    "loading": pb.MODEL_STATE_LOADING,
    "ready": pb.MODEL_STATE_READY,
    "failed": pb.MODEL_STATE_FAILED,
    "evicting": pb.MODEL_STATE_EVICTING,
}
_STATE_FROM_PB = {value: state for state, value in _STATE_TO_PB.items()}


def model_state_pb(state: ModelState) -> pb.ModelState:
    """A model state as its wire enum value."""
    return _STATE_TO_PB[state]


def progress_pb(progress: LoadProgress) -> pb.LoadProgress:
    """Load progress as its wire message."""
    return pb.LoadProgress(
        bytes_done=progress.bytes_done,
        bytes_total=progress.bytes_total,
        tensors_done=progress.tensors_done,
        tensors_total=progress.tensors_total,
    )


def progress_from_pb(message: pb.LoadProgress) -> LoadProgress:
    """Wire load progress as a :class:`LoadProgress`."""
    return LoadProgress(
        message.bytes_done, message.bytes_total, message.tensors_done, message.tensors_total
    )


#: Most bytes of ``__metadata__`` (keys and values in UTF-8) a Model message echoes: a
#: header may hold 100 MB of it, and every Model of a ListModels reply, or of a Preload
#: stream's messages, would carry it (one such model broke listing for everyone).
MAX_METADATA_BYTES = 65536


def metadata_bytes(metadata: dict[str, str]) -> int:
    """Bytes of ``metadata``'s keys and values in UTF-8 (what :data:`MAX_METADATA_BYTES`
    bounds)."""
    return sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items())


def model_pb(model: ModelInfo) -> pb.Model:
    """A model snapshot as its wire message (``load_duration`` set only when known; the
    metadata only when within :data:`MAX_METADATA_BYTES`, else ``metadata_omitted``)."""
    omitted = model.metadata_omitted or metadata_bytes(model.metadata) > MAX_METADATA_BYTES
    message = pb.Model(
        name=model.name,
        state=_STATE_TO_PB[model.state],
        fingerprint=fingerprint_pb(model.fingerprint),
        path=model.path,
        recipe=recipe_pb(model.recipe),
        placement=placement_pb(model.placement),
        size_bytes=model.size_bytes,
        tensor_count=model.tensor_count,
        lease_count=model.lease_count,
        create_time=timestamp_pb(model.create_time),
        error=model.error,
        progress=progress_pb(model.progress),
        metadata={} if omitted else model.metadata,
        metadata_omitted=omitted,
        source=model.source,
    )
    if model.load_seconds is not None:
        message.load_duration.CopyFrom(duration_pb(model.load_seconds))
    return message


def model_from_pb(message: pb.Model) -> ModelInfo:
    """A wire model as a :class:`ModelInfo`.

    A model LOADING (or FAILED while loading) at level ``full`` may have a pending
    fingerprint: an empty digest and no ``checkpoint/<shard>`` components, while the daemon
    hashes the shards it copies (:attr:`Fingerprint.pending`).

    Raises:
        InvalidArgumentError: the state is unspecified or unknown (``field=model.state``),
            or the fingerprint is malformed (:func:`fingerprint_from_pb`; an empty digest
            is malformed for a model READY or EVICTING).
        RecipeError: the recipe or placement is invalid.
    """
    state = _STATE_FROM_PB.get(message.state)
    if state is None:
        raise InvalidArgumentError(
            f"unknown model state {message.state}", metadata={"field": "model.state"}
        )
    pending = not message.fingerprint.digest and state in ("loading", "failed")
    return ModelInfo(
        name=message.name,
        state=state,
        fingerprint=(_fingerprint if pending else fingerprint_from_pb)(message.fingerprint),
        path=message.path,
        recipe=recipe_from_pb(message.recipe),
        placement=placement_from_pb(message.placement),
        size_bytes=message.size_bytes,
        tensor_count=message.tensor_count,
        lease_count=message.lease_count,
        create_time=timestamp_from_pb(message.create_time),
        progress=progress_from_pb(message.progress),
        error=message.error,
        load_seconds=(
            duration_from_pb(message.load_duration) if message.HasField("load_duration") else None
        ),
        metadata=dict(message.metadata),
        metadata_omitted=message.metadata_omitted,
        source=message.source or "checkpoint",
    )


# -- leases -----------------------------------------------------------------------------


def lease_pb(lease: LeaseInfo) -> pb.Lease:
    """A granted lease as its wire message."""
    return pb.Lease(
        lease_id=lease.lease_id,
        model=lease.model,
        ttl=duration_pb(lease.ttl),
        expire_time=timestamp_pb(lease.expire_time),
        instance_id=lease.instance_id,
    )


def lease_from_pb(message: pb.Lease) -> LeaseInfo:
    """A wire lease as a :class:`LeaseInfo`."""
    return LeaseInfo(
        lease_id=message.lease_id,
        model=message.model,
        ttl=duration_from_pb(message.ttl),
        expire_time=timestamp_from_pb(message.expire_time),
        instance_id=message.instance_id,
    )


_LEASE_STATE_TO_PB: dict[LeaseState, pb.LeaseState] = {
    "active": pb.LEASE_STATE_ACTIVE,
    "revoking": pb.LEASE_STATE_REVOKING,
    "not_found": pb.LEASE_STATE_NOT_FOUND,
}
_LEASE_STATE_FROM_PB = {value: state for state, value in _LEASE_STATE_TO_PB.items()}


def lease_status_pb(status: LeaseStatus) -> pb.LeaseStatus:
    """One lease's KeepAlive status as its wire message."""
    message = pb.LeaseStatus(lease_id=status.lease_id, state=_LEASE_STATE_TO_PB[status.state])
    if status.expire_time is not None:
        message.expire_time.CopyFrom(timestamp_pb(status.expire_time))
    if status.revoke_deadline is not None:
        message.revoke_deadline.CopyFrom(timestamp_pb(status.revoke_deadline))
    return message


def lease_status_from_pb(message: pb.LeaseStatus) -> LeaseStatus:
    """A wire lease status as a :class:`LeaseStatus` (an unknown state reads ``not_found``:
    the lease cannot be counted on)."""
    return LeaseStatus(
        lease_id=message.lease_id,
        state=_LEASE_STATE_FROM_PB.get(message.state, "not_found"),
        expire_time=(
            timestamp_from_pb(message.expire_time) if message.HasField("expire_time") else None
        ),
        revoke_deadline=(
            timestamp_from_pb(message.revoke_deadline)
            if message.HasField("revoke_deadline")
            else None
        ),
    )


def worker_pb(worker: WorkerDescription) -> pb.WorkerDescription:
    """A worker's description of itself as its wire message."""
    return pb.WorkerDescription(
        pid=worker.pid,
        hostname=worker.hostname,
        label=worker.label,
        pid_namespace=worker.pid_namespace,
        mode=worker.mode,
    )


def worker_from_pb(message: pb.WorkerDescription) -> WorkerDescription:
    """A wire worker description, checked.

    Raises:
        InvalidArgumentError: ``hostname`` over :data:`MAX_HOSTNAME_CHARS`, ``label`` or
            ``mode`` over :data:`MAX_ID_CHARS` characters (``field`` names which).
    """
    check_len("worker.hostname", message.hostname, MAX_HOSTNAME_CHARS)
    check_len("worker.label", message.label, MAX_ID_CHARS)
    check_len("worker.mode", message.mode, MAX_ID_CHARS)
    return WorkerDescription(
        pid=message.pid,
        hostname=message.hostname,
        label=message.label,
        pid_namespace=message.pid_namespace,
        mode=message.mode,
    )


def peer_pb(peer: PeerCredentials) -> pb.PeerCredentials:
    """Peer credentials as their wire message."""
    return pb.PeerCredentials(pid=peer.pid, uid=peer.uid, gid=peer.gid)


def lease_holder_pb(holder: LeaseHolder) -> pb.LeaseHolder:
    """A live lease and who holds it as its wire message."""
    message = pb.LeaseHolder(
        lease=lease_pb(holder.lease),
        state=_LEASE_STATE_TO_PB[holder.state],
        create_time=timestamp_pb(holder.create_time),
        worker=worker_pb(holder.worker),
    )
    if holder.peer is not None:
        message.peer.CopyFrom(peer_pb(holder.peer))
    if holder.revoke_deadline is not None:
        message.revoke_deadline.CopyFrom(timestamp_pb(holder.revoke_deadline))
    return message


def keepalive_response_pb(
    instance_id: str, statuses: Iterable[LeaseStatus], *, hand_over: bool = False
) -> pb.KeepAliveResponse:
    """A KeepAlive answer of daemon ``instance_id`` about some leases (``hand_over``: the
    daemon stops to hand its leases over to its successor)."""
    response = pb.KeepAliveResponse(instance_id=instance_id, hand_over=hand_over)
    add_lease_statuses(response, statuses)
    return response


def add_lease_statuses(response: pb.KeepAliveResponse, statuses: Iterable[LeaseStatus]) -> None:
    """Append lease statuses to a KeepAlive answer, each as :func:`lease_status_pb` encodes
    it (added in place: about 4x faster per status than building each message apart)."""
    add = response.leases.add
    for status in statuses:
        message = add(lease_id=status.lease_id, state=_LEASE_STATE_TO_PB[status.state])
        if status.expire_time is not None:
            message.expire_time.CopyFrom(timestamp_pb(status.expire_time))
        if status.revoke_deadline is not None:
            message.revoke_deadline.CopyFrom(timestamp_pb(status.revoke_deadline))


# -- arenas -----------------------------------------------------------------------------


def view_nbytes(view: TensorView) -> int:
    """Bytes of a view's elements: ``prod(shape) * itemsize`` (the wire's ``nbytes``).

    Raises:
        KeyError: the view's dtype is not a supported safetensors dtype name.
    """
    return math.prod(view.shape) * itemsize(view.dtype)


def tensor_view_pb(view: TensorView) -> pb.TensorView:
    """A tensor view as its wire message, with its ``nbytes``."""
    return pb.TensorView(
        name=view.name,
        dtype=view.dtype,
        shape=list(view.shape),
        stride=list(view.stride),
        byte_offset=view.byte_offset,
        nbytes=view_nbytes(view),
    )


def tensor_view_from_pb(message: pb.TensorView) -> TensorView:
    """A wire tensor view as a :class:`TensorView` (checked against the arena when used)."""
    return TensorView(
        name=message.name,
        dtype=message.dtype,
        shape=tuple(message.shape),
        stride=tuple(message.stride),
        byte_offset=message.byte_offset,
    )


def tensor_table_pb(views: Iterable[TensorView]) -> pb.TensorTable:
    """Tensor views as the columns of a wire ``TensorTable`` (in the same order)."""
    table = pb.TensorTable()
    dtypes: dict[str, int] = {}
    for view in views:
        table.names.append(view.name)
        table.dtype_index.append(dtypes.setdefault(view.dtype, len(dtypes)))
        table.ranks.append(len(view.shape))
        table.shape.extend(view.shape)
        table.stride.extend(view.stride)
        table.byte_offsets.append(view.byte_offset)
        table.nbytes.append(view_nbytes(view))
    table.dtypes.extend(dtypes)
    return table


def view_columns_from_pb(response: pb.AcquireResponse) -> ViewColumns:
    """The tensor views of an Acquire response, from its ``tensor_table`` when set, else
    from its ``tensors``, as columns (each view checked against the arena, and against its
    ``nbytes``, when used: :func:`weightcache._handles.build_views`).

    The table's columns are copied out in bulk and its shape checked here, before any
    view: no object is made per tensor but its name.

    Raises:
        HandleError: the table's per-tensor columns differ in length (``nbytes`` may also
            be empty), ``shape`` or ``stride`` does not hold ``sum(ranks)`` entries, or a
            ``dtype_index`` is past the end of ``dtypes``; in the ``views`` format, a
            view's stride list is of another length than its shape.
    """
    if not response.HasField("tensor_table"):
        return _columns_of_views(response.tensors)
    table = response.tensor_table
    names, index, ranks = list(table.names), list(table.dtype_index), list(table.ranks)
    offsets, shape, stride = list(table.byte_offsets), list(table.shape), list(table.stride)
    if not len(names) == len(index) == len(ranks) == len(offsets):
        raise HandleError(
            "tensor table: names, dtype_index, ranks and byte_offsets differ in length"
        )
    # A daemon older than the column sends none: nothing to check then.
    nbytes = list(table.nbytes) or [0] * len(names)
    if len(nbytes) != len(names):
        raise HandleError("tensor table: nbytes does not hold one entry per tensor")
    if not sum(ranks) == len(shape) == len(stride):
        raise HandleError("tensor table: shape and stride do not hold sum(ranks) entries")
    dtypes = list(table.dtypes)
    if index and max(index) >= len(dtypes):
        raise HandleError(f"tensor table: a dtype_index is past the {len(dtypes)} dtypes")
    return ViewColumns(
        names, list(map(dtypes.__getitem__, index)), ranks, shape, stride, offsets, nbytes
    )


def _columns_of_views(views: Iterable[pb.TensorView]) -> ViewColumns:
    """The columns of a list of TensorView messages (the ``views`` format).

    Raises:
        HandleError: a view's stride list is of another length than its shape.
    """
    for view in views:
        if len(view.stride) != len(view.shape):
            raise HandleError(
                f"tensor {view.name!r}: shape {tuple(view.shape)} and stride "
                f"{tuple(view.stride)} disagree"
            )
    return ViewColumns.of_rows(
        (v.name, v.dtype, tuple(v.shape), tuple(v.stride), v.byte_offset, v.nbytes) for v in views
    )


def storage_pb(handle: StorageHandle) -> pb.StorageHandle:
    """An arena handle as its wire message."""
    if isinstance(handle, SharedMemoryHandle):
        return pb.StorageHandle(
            shared_memory=pb.SharedMemoryHandle(path=handle.path, size=handle.size)
        )
    return pb.StorageHandle(
        cuda_ipc=pb.CudaIpcHandle(
            device_uuid=handle.device_uuid, ipc_handle=handle.ipc_handle, size=handle.size
        )
    )


def storage_from_pb(message: pb.StorageHandle) -> StorageHandle:
    """A wire arena handle as a :class:`SharedMemoryHandle` or :class:`CudaIpcHandle`.

    Raises:
        HandleError: the handle is of a kind this side does not know (or none).
    """
    kind = message.WhichOneof("handle")
    if kind == "shared_memory":
        return SharedMemoryHandle(message.shared_memory.path, message.shared_memory.size)
    if kind == "cuda_ipc":
        ipc = message.cuda_ipc
        return CudaIpcHandle(ipc.device_uuid, ipc.ipc_handle, ipc.size)
    raise HandleError(f"the daemon offers a handle this client does not know: {kind}")


# -- acquiring --------------------------------------------------------------------------


def environment_pb(env: Environment) -> pb.Environment:
    """An environment stamp as its wire message."""
    return pb.Environment(
        weightcache_version=env.weightcache_version,
        torch_version=env.torch_version,
        backend=env.backend,
        device_uuid=env.device_uuid,
    )


def environment_from_pb(message: pb.Environment) -> Environment:
    """A wire environment stamp as an :class:`Environment`."""
    return Environment(
        message.weightcache_version, message.torch_version, message.backend, message.device_uuid
    )


def acquire_request_pb(acquisition: Acquisition) -> pb.AcquireRequest:
    """An Acquire as its request message (no ttl: the daemon's default)."""
    request = pb.AcquireRequest(
        request_id=acquisition.request_id,
        fingerprint=fingerprint_pb(acquisition.fingerprint),
        checkpoint_path=acquisition.checkpoint_path,
        environment=environment_pb(acquisition.environment),
        pid=acquisition.pid,
        files=[checkpoint_file_pb(name, i) for name, i in acquisition.files.items()],
        tensor_format=_FORMAT_PB[acquisition.tensor_format],
        worker=worker_pb(acquisition.worker),
    )
    if acquisition.ttl is not None:
        request.ttl.CopyFrom(duration_pb(acquisition.ttl))
    return request


def acquisition_from_pb(request: pb.AcquireRequest) -> Acquisition:
    """An Acquire request as an :class:`Acquisition`, checked in field order.

    Raises:
        InvalidArgumentError: ``request_id`` over :data:`MAX_ID_CHARS` or
            ``checkpoint_path`` over :data:`MAX_PATH_CHARS` characters, a malformed
            fingerprint (:func:`fingerprint_from_pb`; by file identity, only its
            component count is checked), a negative ``ttl``, over :data:`MAX_FILES` files
            (``field=files``) or a file name over :data:`MAX_PATH_CHARS` characters
            (``field=files.name``), a worker description over its bounds
            (:func:`worker_from_pb`); ``field`` names which.
    """
    check_len("request_id", request.request_id, MAX_ID_CHARS)
    check_len("checkpoint_path", request.checkpoint_path, MAX_PATH_CHARS)
    files = _files_from_pb(request.files)
    fingerprint = (_fingerprint if files else fingerprint_from_pb)(request.fingerprint)
    ttl = duration_from_pb(request.ttl) if request.HasField("ttl") else None
    if ttl is not None and ttl < 0:
        raise InvalidArgumentError("ttl must not be negative", metadata={"field": "ttl"})
    return Acquisition(
        request_id=request.request_id,
        fingerprint=fingerprint,
        checkpoint_path=request.checkpoint_path,
        ttl=ttl,
        environment=environment_from_pb(request.environment),
        pid=request.pid,
        files=files,
        tensor_format=_FORMAT_FROM_PB.get(request.tensor_format, "views"),
        worker=(
            worker_from_pb(request.worker)
            if request.HasField("worker")
            else WorkerDescription(pid=request.pid)  # a worker older than the field
        ),
    )


_FORMAT_PB: dict[TensorFormat, pb.TensorFormat] = {
    "views": pb.TENSOR_FORMAT_VIEWS,
    "table": pb.TENSOR_FORMAT_TABLE,
}
# Unspecified, or a format this side does not know: the list every client reads.
_FORMAT_FROM_PB: dict[int, TensorFormat] = {v: k for k, v in _FORMAT_PB.items()}


def checkpoint_file_pb(name: str, identity: FileIdentity) -> pb.CheckpointFile:
    """One file of an Acquire by file identity as its wire message."""
    return pb.CheckpointFile(
        name=name,
        dev=identity.dev,
        ino=identity.ino,
        size=identity.size,
        mtime_ns=identity.mtime_ns,
        ctime_ns=identity.ctime_ns,
    )


def _files_from_pb(files: Iterable[pb.CheckpointFile]) -> dict[str, FileIdentity]:
    listed = list(files)
    if len(listed) > MAX_FILES:
        raise InvalidArgumentError(f"over {MAX_FILES} files", metadata={"field": "files"})
    return {
        check_len("files.name", f.name, MAX_PATH_CHARS): FileIdentity(
            f.dev, f.ino, f.size, f.mtime_ns, f.ctime_ns
        )
        for f in listed
    }


def tensor_views_pb(
    views: Iterable[TensorView], tensor_format: TensorFormat = "views"
) -> pb.AcquireResponse:
    """An AcquireResponse holding only ``views`` encoded in ``tensor_format``: what every
    Acquire of one model repeats, for :func:`acquire_response_pb` to copy in."""
    if tensor_format == "table":
        return pb.AcquireResponse(tensor_table=tensor_table_pb(views))
    return pb.AcquireResponse(tensors=[tensor_view_pb(v) for v in views])


def acquire_response_pb(
    grant: Grant, views: pb.AcquireResponse | None = None
) -> pb.AcquireResponse:
    """A granted Acquire as its response message.

    Args:
        grant: what the Acquire returns.
        views: ``grant.tensors`` already encoded (:func:`tensor_views_pb`), or None to
            encode them now. Copying an encoded list is one C-level copy; encoding costs
            about 1.5 µs per tensor, on every Acquire of a model with tens of thousands.
    """
    response = pb.AcquireResponse()
    if views is None:
        response.tensors.extend(tensor_view_pb(v) for v in grant.tensors)
    else:
        response.CopyFrom(views)
    response.lease.CopyFrom(lease_pb(grant.lease))
    response.model.CopyFrom(model_pb(grant.model))
    response.storage.CopyFrom(storage_pb(grant.storage))
    response.environment.CopyFrom(environment_pb(grant.environment))
    return response


def grant_from_pb(response: pb.AcquireResponse) -> Grant:
    """An Acquire response as a :class:`Grant` (its views from either format).

    Raises:
        HandleError: the storage handle is of an unknown kind, or the tensor table is
            malformed (:func:`view_columns_from_pb`).
        InvalidArgumentError: the model is malformed (:func:`model_from_pb`).
        RecipeError: the model's recipe or placement is invalid.
    """
    return Grant(
        lease=lease_from_pb(response.lease),
        model=model_from_pb(response.model),
        storage=storage_from_pb(response.storage),
        tensors=tuple(TensorView(*row[:5]) for row in view_columns_from_pb(response).rows()),
        environment=environment_from_pb(response.environment),
    )


# -- server info ------------------------------------------------------------------------


def server_info_pb(info: ServerInfo) -> pb.GetServerInfoResponse:
    """A daemon's info as the GetServerInfo response."""
    return pb.GetServerInfoResponse(
        version=info.version,
        protocol_version=info.protocol_version,
        torch_version=info.torch_version,
        backend=info.backend,
        device=info.device,
        device_uuid=info.device_uuid,
        memory_held_bytes=info.memory_held_bytes,
        memory_budget_bytes=info.memory_budget_bytes,
        instance_id=info.instance_id,
        start_time=timestamp_pb(info.start_time),
        memory_unlinked_bytes=info.memory_unlinked_bytes,
    )


def server_info_from_pb(message: pb.GetServerInfoResponse) -> ServerInfo:
    """A GetServerInfo response as a :class:`ServerInfo`."""
    return ServerInfo(
        version=message.version,
        protocol_version=message.protocol_version,
        torch_version=message.torch_version,
        backend=message.backend,
        device=message.device,
        device_uuid=message.device_uuid,
        memory_held_bytes=message.memory_held_bytes,
        memory_budget_bytes=message.memory_budget_bytes,
        instance_id=message.instance_id,
        start_time=timestamp_from_pb(message.start_time),
        memory_unlinked_bytes=message.memory_unlinked_bytes,
    )


def unlinked_arena_pb(arena: UnlinkedArena) -> pb.UnlinkedArena:
    """An unlinked, still mapped arena as its wire message (in ListModels)."""
    return pb.UnlinkedArena(
        model=arena.model,
        size_bytes=arena.size_bytes,
        lease_count=arena.lease_count,
        unlink_time=timestamp_pb(arena.unlink_time),
    )


def unlinked_arena_from_pb(message: pb.UnlinkedArena) -> UnlinkedArena:
    """A wire unlinked arena as an :class:`UnlinkedArena`."""
    return UnlinkedArena(
        model=message.model,
        size_bytes=message.size_bytes,
        lease_count=message.lease_count,
        unlink_time=timestamp_from_pb(message.unlink_time),
    )
