"""What the daemon reports about itself, its models and leases, as plain values.

These are the domain side of the wire messages that are not already a domain object
elsewhere (``Fingerprint``, ``Recipe``, ``Placement``): the daemon builds them, the SDK and
the CLI read them, and :mod:`weightcache.core.protocol` alone turns them into protobuf
messages and back. Times are wall-clock seconds since the Unix epoch; durations seconds.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from weightcache.core.checkpoint import FileIdentity
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.recipe import Placement, Recipe

#: Lifecycle of a model in the daemon (the wire's ``ModelState``).
ModelState = Literal["loading", "ready", "failed", "evicting"]
#: What a KeepAlive says of one lease (the wire's ``LeaseState``).
LeaseState = Literal["active", "revoking", "not_found"]


@dataclass(frozen=True)
class LoadProgress:
    """How far a load has come: bytes and tensors written into the arena of their totals."""

    bytes_done: int = 0
    bytes_total: int = 0
    tensors_done: int = 0
    tensors_total: int = 0


@dataclass(frozen=True)
class TensorView:
    """One tensor of an arena: safetensors ``dtype``, ``shape`` and ``stride`` in elements,
    ``byte_offset`` from the arena's start in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    byte_offset: int

    def row(self, nbytes: int = 0) -> ViewRow:
        """The view as a :data:`ViewRow` tuple, with the byte length ``nbytes`` a daemon
        sent for it (0: none to check)."""
        return (self.name, self.dtype, self.shape, self.stride, self.byte_offset, nbytes)


#: A tensor view as a plain tuple ``(name, dtype, shape, stride, byte_offset, nbytes)``, the
#: fields of :class:`TensorView` in order and the byte length the daemon sent (the wire's
#: ``nbytes``; 0 when it sent none): one row of :class:`ViewColumns`, what the attach path
#: checks one at a time to name a view at fault.
ViewRow = tuple[str, str, tuple[int, ...], tuple[int, ...], int, int]


@dataclass(frozen=True)
class ViewColumns:
    """Tensor views as columns, as the wire's ``TensorTable`` holds them: entry ``i`` of
    each per-tensor column describes tensor ``i``, and its sizes and strides are the next
    ``ranks[i]`` entries of ``shape`` and ``stride``. The attach path builds its tensors
    column by column (:func:`weightcache._handles.build_views`), without a tuple or record
    per tensor.

    Attributes:
        names: tensor names.
        dtypes: safetensors dtype names (``"BF16"``, ``"F32"``...).
        ranks: each tensor's number of dimensions.
        shape: every tensor's sizes, in elements, one after the other.
        stride: every tensor's strides, in elements, one after the other.
        byte_offsets: each tensor's first element, in bytes from the arena's start.
        nbytes: each tensor's byte length as the daemon sent it (0: none to check).
    """

    names: Sequence[str]
    dtypes: Sequence[str]
    ranks: Sequence[int]
    shape: Sequence[int]
    stride: Sequence[int]
    byte_offsets: Sequence[int]
    nbytes: Sequence[int]

    def __len__(self) -> int:
        return len(self.names)

    def cuts(self) -> Iterator[slice]:
        """Each tensor's slice of ``shape`` and ``stride``, in order."""
        starts = itertools.chain((0,), itertools.accumulate(self.ranks))
        return map(slice, starts, itertools.accumulate(self.ranks))

    def rows(self) -> Iterator[ViewRow]:
        """The views one :data:`ViewRow` at a time, in order."""
        per_tensor = zip(
            self.names, self.dtypes, self.cuts(), self.byte_offsets, self.nbytes, strict=True
        )
        for name, dtype, cut, offset, nbytes in per_tensor:
            yield name, dtype, tuple(self.shape[cut]), tuple(self.stride[cut]), offset, nbytes

    @classmethod
    def of_rows(cls, rows: Iterable[ViewRow]) -> ViewColumns:
        """The columns of ``rows``."""
        listed = list(rows)
        return cls(
            names=[row[0] for row in listed],
            dtypes=[row[1] for row in listed],
            ranks=[len(row[2]) for row in listed],
            shape=[size for row in listed for size in row[2]],
            stride=[step for row in listed for step in row[3]],
            byte_offsets=[row[4] for row in listed],
            nbytes=[row[5] for row in listed],
        )


#: How an Acquire response lists its tensors (the wire's ``TensorFormat``).
TensorFormat = Literal["views", "table"]


@dataclass(frozen=True)
class SharedMemoryHandle:
    """A CPU arena: a file under ``/dev/shm`` of ``size`` bytes."""

    path: str
    size: int


@dataclass(frozen=True)
class CudaIpcHandle:
    """A GPU arena: the 64-byte ``cudaIpcMemHandle_t`` of ``size`` bytes on the device
    with UUID ``device_uuid``."""

    device_uuid: str
    ipc_handle: bytes
    size: int


#: Where a model's arena lives, as a worker opens it.
StorageHandle = SharedMemoryHandle | CudaIpcHandle


@dataclass(frozen=True)
class Environment:
    """Versions a side runs with (kept out of the fingerprint; reported to explain a miss).

    ``backend`` and ``device_uuid`` are empty when a worker sends it.
    """

    weightcache_version: str = ""
    torch_version: str = ""
    backend: str = ""
    device_uuid: str = ""


@dataclass(frozen=True)
class ModelInfo:
    """A snapshot of one model the daemon holds or loads.

    Attributes:
        recipe: the recipe as resolved for the model (its plan and plugins as applied).
        size_bytes: arena size in bytes.
        create_time: when the load was registered (epoch seconds).
        load_seconds: how long the load took; None unless ``state`` is ``ready``.
        error: why the load failed; empty otherwise.
    """

    name: str
    state: ModelState
    fingerprint: Fingerprint
    path: str
    recipe: Recipe
    placement: Placement
    size_bytes: int
    tensor_count: int
    lease_count: int
    create_time: float
    progress: LoadProgress
    error: str = ""
    load_seconds: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    #: On the wire: the metadata was over ``core.protocol.MAX_METADATA_BYTES`` and not sent.
    metadata_omitted: bool = False
    #: Where the bytes came from: ``"checkpoint"``, or ``"peer NAME"`` when seeded from
    #: the daemon at NAME (docs/seeding.md).
    source: str = "checkpoint"


@dataclass(frozen=True)
class LeaseInfo:
    """A lease as granted: ``ttl`` seconds, ending at ``expire_time`` (epoch seconds)
    unless renewed; ``instance_id`` names the daemon process that granted it."""

    lease_id: str
    model: str
    ttl: float
    expire_time: float
    instance_id: str


@dataclass(frozen=True)
class LeaseStatus:
    """One lease's state in a KeepAlive answer; times are epoch seconds, None when the
    state has none (``not_found``; ``revoke_deadline`` unless ``revoking``)."""

    lease_id: str
    state: LeaseState
    expire_time: float | None = None
    revoke_deadline: float | None = None


@dataclass(frozen=True)
class WorkerDescription:
    """A worker's description of itself, sent with each Acquire and never trusted for a
    decision: ``pid`` in its own pid namespace, ``hostname``, an optional ``label``
    (``$WEIGHTCACHE_LABEL``), the inode of its pid namespace (0: unknown) and the
    attach ``mode`` (``zero_copy`` or ``copy``; empty: not said)."""

    pid: int = 0
    hostname: str = ""
    label: str = ""
    pid_namespace: int = 0
    mode: str = ""


@dataclass(frozen=True)
class PeerCredentials:
    """The credentials of a connection on the daemon's Unix socket as the kernel reports
    them (``SO_PEERCRED``): ``pid`` in the daemon's pid namespace (0: not visible there),
    effective ``uid`` and ``gid``."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class LeaseHolder:
    """One live lease and who holds it: ``create_time`` and ``revoke_deadline`` (None
    unless revoking) in epoch seconds; ``peer`` None when the daemon cannot tell which of
    its connections is the worker's."""

    lease: LeaseInfo
    state: LeaseState
    create_time: float
    worker: WorkerDescription
    peer: PeerCredentials | None = None
    revoke_deadline: float | None = None


@dataclass(frozen=True)
class Acquisition:
    """What a worker asks for in an Acquire: the lease's ``ttl`` in seconds (None: the
    daemon's default), and ``request_id`` for idempotent retries.

    With ``files`` (file name -> identity), an Acquire by file identity: ``fingerprint``
    then has no digest and only the components of
    :data:`weightcache.core.fingerprint.REQUEST_COMPONENTS`, and the model must have been
    loaded from these very files (docs/protocol.md). ``tensor_format`` is how the
    response is to list the tensors.
    """

    request_id: str
    fingerprint: Fingerprint
    checkpoint_path: str
    ttl: float | None
    environment: Environment
    pid: int
    files: dict[str, FileIdentity] = field(default_factory=dict)
    tensor_format: TensorFormat = "views"
    worker: WorkerDescription = field(default_factory=WorkerDescription)


@dataclass(frozen=True)
class Grant:
    """What an Acquire returns: the lease, the model, its arena and tensors in it."""

    lease: LeaseInfo
    model: ModelInfo
    storage: StorageHandle
    tensors: tuple[TensorView, ...]
    environment: Environment


@dataclass(frozen=True)
class ServerInfo:
    """A daemon's versions, backend and memory (bytes; ``memory_budget_bytes`` 0: none)."""

    version: str
    protocol_version: str
    torch_version: str
    backend: str
    device: str
    device_uuid: str
    memory_held_bytes: int
    memory_budget_bytes: int
    instance_id: str
    start_time: float
    memory_unlinked_bytes: int = 0


@dataclass(frozen=True)
class UnlinkedArena:
    """A revoked model's arena that the daemon unlinked and workers still map.

    Attributes:
        model: the name the model had.
        size_bytes: the arena's size, in bytes.
        lease_count: revoked leases on it not yet ended (how the daemon knows it is mapped).
        unlink_time: when the daemon unlinked it, in epoch seconds.
    """

    model: str
    size_bytes: int
    lease_count: int
    unlink_time: float
