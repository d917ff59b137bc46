"""``load()``: attach to the daemon's weights, or load from disk with the same recipe.

What falls back to disk (with ``fallback=True``) and the reason code it records, one of
``FallbackReason.CODES``:

- ``DAEMON_UNAVAILABLE``: no socket, or the daemon does not answer;
- ``MODEL_NOT_FOUND``: the daemon holds nothing like this checkpoint;
- ``FINGERPRINT_MISMATCH``: it holds a model that differs (``detail`` names where; also
  what a ``fingerprint_level`` other than the daemon's gives);
- ``MODEL_LOADING``: the daemon was still loading it after ``wait_timeout`` seconds;
- ``MODEL_FAILED``, ``DRAINING``, ``RESOURCE_EXHAUSTED``: the daemon cannot serve it;
- ``UNTRUSTED_SOCKET``: the socket, its folder or a segment is a symlink or belongs to a
  user this process does not trust;
- ``INVALID_HANDLE``: the daemon's storage handle cannot be opened or does not fit;
- ``DEVICE_NOT_VISIBLE``: the GPU is not visible to this process: the daemon's (its
  ``CUDA_VISIBLE_DEVICES`` hides it), or the one ``device=`` names, whose UUID names its
  daemon's socket (torch sees no CUDA device, or too few);
- ``CUDA_ERROR``: a CUDA (HIP) runtime call to map the daemon's memory failed.

What is an error either way: a malformed checkpoint (:class:`InvalidCheckpointError`) and
a bad recipe (:class:`RecipeError`); loading from disk cannot fix those.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import os
import socket
import time
import uuid
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal, Union, Unpack

import torch

from weightcache import _sharing
from weightcache._disk import fingerprint_later, read_tensors
from weightcache._handles import (
    MappedArena,
    SegmentGoneError,
    open_cuda_ipc,
    open_shared_memory,
)
from weightcache._lease import (
    ClientLease,
    LostCallback,
    Policy,
    RevokePolicy,
    default_policy,
    live_session,
    session_for,
)
from weightcache._log import get_logger
from weightcache._options import LoadKeywords, LoadOptions, Mode, resolve
from weightcache._trust import check_socket, trusted_uids
from weightcache.core import hub
from weightcache.core.checkpoint import (
    Checkpoint,
    FileIdentity,
    file_identities,
    open_checkpoint,
)
from weightcache.core.errors import (
    DaemonUnavailableError,
    FingerprintMismatchError,
    HandleError,
    LeaseLostError,
    ModelLoadingError,
    WeightCacheError,
)
from weightcache.core.fingerprint import (
    DEFAULT_LEVEL,
    Fingerprint,
    Level,
    compute_fingerprint,
    request_components,
)
from weightcache.core.protocol import (
    MAX_HOSTNAME_CHARS,
    MAX_ID_CHARS,
    acquire_request_pb,
    fingerprint_from_pb,
    lease_from_pb,
    storage_from_pb,
    view_columns_from_pb,
    worker_pb,
)
from weightcache.core.recipe import Pipeline, Placement, Recipe, parse_dtype
from weightcache.core.records import (
    Acquisition,
    CudaIpcHandle,
    Environment,
    SharedMemoryHandle,
    StorageHandle,
    ViewColumns,
    WorkerDescription,
)
from weightcache.core.rpc import call_shared
from weightcache.core.sockets import default_socket, no_socket, socket_denied
from weightcache.core.timestamps import stamps_every_write
from weightcache.core.version import __version__
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1.weight_cache_service_pb2_grpc import WeightCacheServiceStub

# grpc imports its channel module on a process's first insecure_channel (about 4 ms here,
# bench/README.md): imported with the SDK instead, a worker's first load() does not pay it.
# Here, not in core.rpc: the daemon, which serves through grpc.aio and opens no such
# channel, would pay it at every start (issue 39).
with contextlib.suppress(ImportError):  # a private module: a later grpcio may move it
    importlib.import_module("grpc._channel")

log = get_logger("weightcache")

Source = Literal["cache", "disk"]
#: Seconds between Acquire attempts while the model loads or the daemon starts.
RETRY_INTERVAL = 0.1
#: Seconds one Acquire call may take.
RPC_TIMEOUT = 10.0
#: Every code of FallbackReason, in the order the module's docstring explains them.
_CODES = (
    "DAEMON_UNAVAILABLE",
    "MODEL_NOT_FOUND",
    "FINGERPRINT_MISMATCH",
    "MODEL_LOADING",
    "MODEL_FAILED",
    "DRAINING",
    "RESOURCE_EXHAUSTED",
    "UNTRUSTED_SOCKET",
    "INVALID_HANDLE",
    "DEVICE_NOT_VISIBLE",
    "CUDA_ERROR",
)
_FALLBACK_REASONS = frozenset(_CODES)


@dataclass(frozen=True)
class FallbackReason:
    """Why weights came from disk instead of the daemon.

    Attributes:
        code: one of :attr:`CODES`: ``DAEMON_UNAVAILABLE``, ``MODEL_NOT_FOUND``,
            ``FINGERPRINT_MISMATCH``, ``MODEL_LOADING``, ``MODEL_FAILED``, ``DRAINING``,
            ``RESOURCE_EXHAUSTED``, ``UNTRUSTED_SOCKET``, ``INVALID_HANDLE``,
            ``DEVICE_NOT_VISIBLE`` or ``CUDA_ERROR`` (the module :mod:`weightcache._loader`
            says when each is recorded).
        detail: the daemon's (or client's) explanation.
        components: for ``FINGERPRINT_MISMATCH``, the differing fingerprint components.
    """

    #: Every code a fallback can record.
    CODES: ClassVar[tuple[str, ...]] = _CODES

    code: str
    detail: str
    components: tuple[str, ...] = ()


class LoadedWeights:
    """Weights ready to use, from the daemon (``source == "cache"``) or from disk.

    Use as a context manager, or call :meth:`close` when done: that ends the lease.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        source: Source,
        fingerprint: Fingerprint | Callable[[], Fingerprint],
        checkpoint: Checkpoint | Path,
        fallback_reason: FallbackReason | None = None,
        lease: ClientLease | None = None,
        socket: str | None = None,
        model: str | None = None,
        arena: MappedArena | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self._tensors = tensors
        self._arena = arena
        self._checkpoint = checkpoint
        self._metadata = metadata
        self.source: Source = source
        self._fingerprint = fingerprint
        self.fallback_reason = fallback_reason
        self.lease = lease
        self.socket = socket
        self.model = model
        # The lease's sharing among this process's loads, for a shared-memory lease.
        self._shared: _sharing.SharedLease | None = None

    @property
    def fingerprint(self) -> Fingerprint:
        """The model's fingerprint: the daemon's for weights from the cache; for weights
        loaded from disk without a daemon's answer, computed from the files at first
        access (:func:`weightcache._disk.fingerprint_later`: a load from disk does not
        pay for a fingerprint nobody reads).

        Raises:
            InvalidCheckpointError: computed at first access, a file of the checkpoint
                changed since the load (or no longer validates).
        """
        if not isinstance(self._fingerprint, Fingerprint):
            self._fingerprint = self._fingerprint()
        return self._fingerprint

    @property
    def checkpoint(self) -> Checkpoint:
        """The checkpoint's headers (its files closed). Weights attached by file identity
        never read them: they are read from the folder at first access.

        Raises:
            InvalidCheckpointError: read at first access, the checkpoint is malformed.
        """
        if isinstance(self._checkpoint, Path):
            with open_checkpoint(self._checkpoint) as checkpoint:
                self._checkpoint = checkpoint
        return self._checkpoint

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> tensor, in checkpoint order.

        Raises:
            LeaseLostError: the lease was lost and its policy is ``"raise"``.
        """
        if self.lease is not None:
            self.lease.check()
        return self._tensors

    @property
    def metadata(self) -> dict[str, str]:
        """The checkpoint's safetensors ``__metadata__`` (of its first shard)."""
        if self._metadata is None:
            self._metadata = self.checkpoint.metadata
        return self._metadata

    @property
    def lease_lost(self) -> LeaseLostError | None:
        """The lease's loss, if it was lost; ``None`` while live or without a lease."""
        return self.lease.lost if self.lease is not None else None

    def track(self, tensor: torch.Tensor) -> None:
        """Register another tensor object viewing these weights (an ``nn.Parameter`` made
        from one), so that a revoke with ``on_revoke="copy"`` re-points it too."""
        if self._arena is not None:
            self._arena.track(tensor)

    def close(self) -> None:
        """Be done with the weights (idempotent): end the lease, if any, unless other
        loads of this process still share it (the last of them to close ends it).
        Zero-copy tensors stay readable on CPU. In a forked child, weights inherited from
        the parent only drop the lease: it is the parent's to renew and release."""
        lease, self.lease = self.lease, None
        if lease is None or self.socket is None or lease.pid != os.getpid():
            return
        # A lease other loads of this process still share is ended by the last of them.
        if self._shared is None or self._shared.leave(self._arena):
            end_lease(self.socket, lease)

    def __enter__(self) -> LoadedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def end_lease(socket: str, lease: ClientLease) -> None:
    """Stop renewing a lease and release it, unless it was lost or revoked and copied
    (then the daemon has ended it). A revoked lease kept (``on_revoke="keep"``) is
    released: the daemon counts its unlinked arena as mapped until then."""
    session = live_session(socket)
    if session is not None:
        session.remove(lease.lease_id)
    if lease.lost is None and (lease.kept or not lease.revoked):
        release(socket, lease.lease_id)


def release(socket: str, lease_id: str) -> None:
    """Release a lease; a daemon that is gone has released it already."""
    request = pb.ReleaseRequest(lease_id=lease_id)
    with contextlib.suppress(DaemonUnavailableError):
        call_shared(socket, lambda stub: stub.Release(request, timeout=RPC_TIMEOUT))


def load(
    model_dir: str | os.PathLike[str],
    *,
    options: LoadOptions | None = None,
    **keywords: Unpack[LoadKeywords],
) -> LoadedWeights:
    """Get a checkpoint's weights from the daemon, or from disk.

    ``model_dir`` may also be a Hugging Face Hub repo id, ``org/name`` or
    ``org/name@REVISION``, when no such path exists: its snapshot in the local Hub cache
    (``$HF_HUB_CACHE``), found as the daemon finds it (:mod:`weightcache.core.hub`), never
    downloaded.

    ``load(path, options=LoadOptions(device="cuda:0", ttl=30.0))`` and
    ``load(path, device="cuda:0", ttl=30.0)`` are the same call; giving both ``options`` and
    keywords is a ``TypeError``. With neither, every option has its default: the daemon
    of the CPU at its default socket (:func:`weightcache.default_socket`).

    When the checkpoint's files are the very files the daemon loaded (same device, inode,
    size, mtime and ctime), nothing of them is read: the daemon is asked for the model by
    file identity (``docs/protocol.md``); not on tmpfs, where identity cannot vouch for
    bytes (:func:`weightcache.core.timestamps.stamps_every_write`). Otherwise, or when it
    answers that it holds no such model, the headers are validated and the fingerprint
    computed from the files.

    Args:
        model_dir: checkpoint folder (``model.safetensors`` or a sharded index), or a Hub
            repo id in the local Hub cache.
        options: every option, field by field in :class:`LoadOptions` (socket, device,
            dtype, recipe, mode, fallback, fingerprint_level, tp_rank, tp_size, ttl,
            wait_timeout, lease_policy, on_lease_lost, on_revoke, trusted_uid).
        **keywords: the same fields as keywords, instead of ``options``.

    Returns:
        The weights; ``source`` says where they came from and ``fallback_reason`` why.

    Raises:
        TypeError: both ``options`` and keywords are given, ``options`` is not a
            :class:`LoadOptions`, or a keyword names no option.
        ValueError: an option is invalid (see :class:`LoadOptions`).
        InvalidCheckpointError: the checkpoint is malformed (either path), a shard
            changed (dev, inode, size, mtime or ctime) while it was being read, or
            ``model_dir`` is neither a path nor a repo id in the local Hub cache.
        RecipeError: the dtype or placement is invalid.
        DaemonUnavailableError, ModelNotFoundError, FingerprintMismatchError,
        ModelLoadingError, ModelFailedError, DrainingError, ResourceExhaustedError,
        HandleError, UntrustedSocketError, DeviceNotVisibleError, CudaError: only with
            ``fallback=False``: the daemon cannot serve the weights, for the reason of
            :attr:`FallbackReason.CODES` the class names (``DeviceNotVisibleError`` also
            when ``device`` is a GPU this process cannot see, so its daemon's socket
            cannot be named). With ``fallback=True`` these load from disk instead.
        NotSameHostError, PermissionDeniedError, UnauthenticatedError,
        InvalidArgumentError, InternalError, RemoteError: whatever ``fallback``: the
            daemon refused the request for a reason that loading from disk would hide.
    """
    opts = resolve(options, keywords)
    model_dir = local_folder(model_dir)
    with _gc_paused():
        placement = Placement(opts.tp_rank, opts.tp_size)
        recipe = _recipe_of(opts)
        attach = _attach_of(opts)
        attempt = _attach_by_files(model_dir, recipe, placement, opts, attach)
        if isinstance(attempt, LoadedWeights):
            return attempt
        with open_checkpoint(model_dir) as checkpoint:
            return _load_checkpoint(
                model_dir, checkpoint, recipe, placement, opts, attach=attach, refusal=attempt
            )


def local_folder(model_dir: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """``model_dir`` itself when it is a path that exists (or not a string), else the
    snapshot folder of the Hub repo id it names in the local Hub cache
    (:func:`weightcache.core.hub.resolve_model`).

    Raises:
        InvalidCheckpointError: ``model_dir`` names neither a path nor a cached repo.
    """
    if not isinstance(model_dir, str) or os.path.exists(model_dir):
        return model_dir
    return hub.resolve_model(model_dir)


#: How to attach, or why the options name no daemon: a ``ValueError`` (no such device),
#: raised once the checkpoint is known to be valid, or a ``WeightCacheError``
#: (``DeviceNotVisibleError``), the attach's refusal.
_AttachOrError = Union["_Attach", ValueError, WeightCacheError]


def _attach_of(opts: LoadOptions) -> _AttachOrError:
    try:
        return _Attach.of(opts)
    except (ValueError, WeightCacheError) as err:
        return err


def _load_checkpoint(
    path: str | os.PathLike[str],
    checkpoint: Checkpoint,
    recipe: Recipe,
    placement: Placement,
    opts: LoadOptions,
    *,
    attach: _AttachOrError,
    refusal: WeightCacheError | None,
) -> LoadedWeights:
    """Attach by fingerprint, or load from disk; ``refusal`` is the daemon's final answer
    to an Acquire by file identity (or the socket's absence), which is not asked again:
    then no fingerprint is computed unless the weights' is read
    (:func:`weightcache._disk.fingerprint_later`).

    A recipe whose plugin builds the model (a ``ModelPlugin``: its build runs an engine's
    export, seconds to minutes) is built only for the disk path: the fingerprint needs
    only its identity (``Recipe.identity``), so a refusal costs no export."""
    builds_model = recipe.builds_model()
    if builds_model:
        pipeline = Pipeline(nodes={}, identity=recipe.identity(checkpoint.root, placement))
    else:
        pipeline = recipe.build(checkpoint, placement)
    level = opts.fingerprint_level
    fp: Fingerprint | Callable[[], Fingerprint]
    try:
        if refusal is not None:
            fp = fingerprint_later(path, checkpoint, recipe, placement, level)
            raise refusal
        fp = compute_fingerprint(checkpoint, pipeline, placement, level)
        checkpoint.check_unchanged()  # else the fingerprint may mix two versions
        if not isinstance(attach, _Attach):
            raise attach
        return attach.run(checkpoint, fp)
    except WeightCacheError as err:
        if not opts.fallback or err.reason not in _FALLBACK_REASONS:
            raise
        components = tuple(err.components) if isinstance(err, FingerprintMismatchError) else ()
        reason = FallbackReason(err.reason, err.detail, components)
    log.warning(
        "loading from disk", reason=reason.code, detail=reason.detail, path=str(checkpoint.root)
    )
    if builds_model:
        pipeline = recipe.build(checkpoint, placement)
    return _from_disk(checkpoint, pipeline, fp, reason, opts.mode)


#: Answers to an Acquire by file identity that the whole fingerprint may change: the
#: daemon knows no model loaded from these files (or, an older daemon, no such request).
_ASK_BY_FINGERPRINT = frozenset({"MODEL_NOT_FOUND", "FINGERPRINT_MISMATCH", "INVALID_ARGUMENT"})


def _attach_by_files(
    model_dir: str | os.PathLike[str],
    recipe: Recipe,
    placement: Placement,
    opts: LoadOptions,
    attach: _AttachOrError,
) -> LoadedWeights | WeightCacheError | None:
    """Attach without reading the checkpoint: ask for the model loaded from these very
    files (same dev, inode, size, mtime, ctime), whose headers and content the daemon has
    validated and fingerprinted. Per tensor, only its view is built.

    Returns:
        The weights; or the daemon's final refusal (unavailable, loading past
        ``wait_timeout``, failed, draining, a handle that cannot be opened...), which
        loading by fingerprint would meet again; or None when the fingerprint is to be
        computed and sent (no model from these files, a recipe or option the slow path
        reports, a folder that cannot be listed).
    """
    if isinstance(attach, WeightCacheError):  # DeviceNotVisibleError: no socket to ask
        return attach
    if isinstance(attach, ValueError):
        return None
    try:
        # The socket first: without a daemon, its absence is the answer, and listing
        # the files and hashing the request (about 0.3 ms) would be for nothing.
        attach.socket_owner()
    except WeightCacheError as err:
        return err
    found = file_identities(model_dir)
    if found is None:
        return None
    root, files = found
    if not all(stamps_every_write(f.dev) for f in files.values()):
        return None  # tmpfs: identity never vouches, the daemon would refuse
    try:
        identity = recipe.identity(root, placement)
        components = request_components(identity, placement, opts.fingerprint_level)
    except ValueError:  # RecipeError included: building the recipe raises it again
        return None
    try:
        return attach.run_by_files(root, components, files, opts.fingerprint_level, Path(model_dir))
    except WeightCacheError as err:
        return None if err.reason in _ASK_BY_FINGERPRINT else err


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Keep Python's cyclic garbage collector from running inside: a load allocates a few
    objects per tensor (headers, recipe nodes, protobuf views, tensors) that all outlive
    it, and every few hundred allocations the collector would traverse them again (at 10k
    tensors, 105 of 289 ms). Restores the collector's previous state (another thread may
    have disabled it: then it stays disabled); cycles made inside are collected later."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def load_from_disk(
    model_dir: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    recipe: Recipe | None = None,
    fingerprint_level: Level = DEFAULT_LEVEL,
    tp_rank: int = 0,
    tp_size: int = 1,
    mode: Mode = "zero_copy",
) -> LoadedWeights:
    """Load a checkpoint from disk with the recipe ``load()`` would apply; no daemon.

    The same headers are validated and the same recipe applied as by :func:`load`, whose
    disk fallback this is (:mod:`weightcache._disk`). The same fingerprint is computed
    when the result's ``fingerprint`` is first read, not before: a load reads no byte of
    the checkpoint for it.

    Args:
        model_dir: checkpoint folder (``model.safetensors`` or a sharded index), one
            ``.safetensors`` file, or a Hub repo id in the local Hub cache (as
            :func:`load`).
        dtype, recipe, fingerprint_level, tp_rank, tp_size: as :class:`LoadOptions`.
        mode: ``"zero_copy"`` (default): the shard files are mapped private and
            copy-on-write, as ``safetensors.torch.load_file`` maps them, and each tensor
            the recipe leaves as stored is a view of them (read when used; a shard
            rewritten in place or truncated *after* the load changes those pages or
            makes reading them fail with ``SIGBUS``, as with ``load_file``). ``"copy"``:
            every tensor is read into private memory.

    Returns:
        The weights, ``source == "disk"``: CPU tensors, by name in checkpoint order.

    Raises:
        ValueError: ``recipe`` and ``dtype`` are both given, or ``fingerprint_level`` or
            ``mode`` is unknown (the checks of :class:`LoadOptions`).
        InvalidCheckpointError: the checkpoint is malformed, a shard changed (dev,
            inode, size, mtime or ctime; a truncation included) while it was being
            loaded, or ``model_dir`` names neither a path nor a cached Hub repo.
        RecipeError: the dtype or placement is invalid.
    """
    options = LoadOptions(
        dtype=dtype,
        recipe=recipe,
        mode=mode,
        fingerprint_level=fingerprint_level,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    path = local_folder(model_dir)
    with _gc_paused(), open_checkpoint(path) as checkpoint:
        placement = Placement(tp_rank, tp_size)
        recipe = _recipe_of(options)
        pipeline = recipe.build(checkpoint, placement)
        fp = fingerprint_later(path, checkpoint, recipe, placement, fingerprint_level)
        return _from_disk(checkpoint, pipeline, fp, None, mode)


def _recipe_of(options: LoadOptions) -> Recipe:
    # LoadOptions has refused a recipe and a dtype together.
    return options.recipe if options.recipe is not None else Recipe(parse_dtype(options.dtype))


def _from_disk(
    checkpoint: Checkpoint,
    pipeline: Pipeline,
    fp: Fingerprint | Callable[[], Fingerprint],
    reason: FallbackReason | None,
    mode: Mode,
) -> LoadedWeights:
    tensors = read_tensors(checkpoint, pipeline.nodes, copy=mode == "copy")
    return LoadedWeights(
        tensors, source="disk", fingerprint=fp, checkpoint=checkpoint, fallback_reason=reason
    )


@dataclass
class _Wait:
    """One wait of ``timeout`` seconds, shared by the steps of a load that wait: it starts
    when the first of them sleeps (:meth:`start`), and ends once for all."""

    timeout: float
    ends_at: float | None = None

    def left(self) -> float:
        """Seconds left to wait: all of ``timeout`` until the wait has started."""
        return self.timeout if self.ends_at is None else self.ends_at - time.monotonic()

    def start(self) -> None:
        """Start the clock, unless it runs already (a step that is about to sleep)."""
        if self.ends_at is None:
            self.ends_at = time.monotonic() + self.timeout


@dataclass(frozen=True)
class _Attach:
    """How to attach: the options of :func:`load` that concern the daemon."""

    socket: str
    mode: Mode
    ttl: float | None
    wait_timeout: float
    wait_for_daemon: bool
    policy: Policy | None
    on_lost: LostCallback | None
    on_revoke: RevokePolicy
    trusted: frozenset[int]
    #: The load's one wait: the socket's wait and the Acquire's share ``wait_timeout``,
    #: from the first of them (not in the sharing key); None: each waits its own.
    wait: _Wait | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def of(cls, options: LoadOptions) -> _Attach:
        """The attach ``options`` ask for.

        Raises:
            DeviceNotVisibleError: no socket is given and ``options.device`` is a GPU whose
                UUID cannot be read (it names the daemon's socket).
            ValueError: no socket is given and ``options.device`` names no device.
        """
        return cls(
            socket=options.socket or default_socket(options.device),
            mode=options.mode,
            ttl=options.ttl,
            wait_timeout=options.wait_timeout,
            wait_for_daemon=not options.fallback,
            policy=options.lease_policy,
            on_lost=options.on_lease_lost,
            on_revoke=options.on_revoke,
            trusted=trusted_uids(options.trusted_uid),
            wait=_Wait(options.wait_timeout),
        )

    def _wait(self) -> _Wait:
        """The load's wait (a fresh one for an attach made without it)."""
        return self.wait if self.wait is not None else _Wait(self.wait_timeout)

    def run(self, checkpoint: Checkpoint, fp: Fingerprint) -> LoadedWeights:
        """Acquire the model whose fingerprint is ``fp`` and map it.

        Raises:
            WeightCacheError: the daemon refuses, or its storage cannot be mapped.
        """
        request = _acquire_request(checkpoint.root, fp, self.ttl)
        return self._acquire(request, lambda _: fp, checkpoint)

    def run_by_files(
        self,
        root: Path,
        components: dict[str, str],
        files: dict[str, FileIdentity],
        level: Level,
        given: Path,
    ) -> LoadedWeights:
        """Acquire the model loaded from ``files`` (in the folder ``root``) with the request
        ``components`` and map it; the weights carry the daemon's fingerprint of it, and
        read their checkpoint from ``given`` (the folder or file ``load`` was given) at
        first access.

        Raises:
            WeightCacheError: the daemon refuses (MODEL_NOT_FOUND: nothing was loaded from
                these files), its fingerprint disagrees with ``components``
                (FingerprintMismatchError), or its storage cannot be mapped.
        """
        request = _acquire_request(root, Fingerprint("", level, components), self.ttl, files)

        def held(reply: pb.AcquireResponse) -> Fingerprint:
            fp = fingerprint_from_pb(reply.model.fingerprint)
            differing = [n for n in components if fp.components.get(n) != components[n]]
            if differing:
                raise FingerprintMismatchError(
                    f"the daemon answered with model {reply.model.name!r}, which differs in "
                    f"{', '.join(differing)}",
                    metadata={"model": reply.model.name, "components": ",".join(differing)},
                )
            return fp

        return self._acquire(request, held, given)

    def _acquire(
        self,
        request: pb.AcquireRequest,
        fingerprint_of: Callable[[pb.AcquireResponse], Fingerprint],
        checkpoint: Checkpoint | Path,
    ) -> LoadedWeights:
        """Acquire and map, asking again once when the granted segment was unlinked
        before this process opened it (an evict or revocation racing the grant): the
        second answer is the daemon's word on it (MODEL_NOT_FOUND, or a new grant).

        Raises:
            WeightCacheError: as :meth:`_acquire_once`.
        """
        try:
            return self._acquire_once(request, fingerprint_of, checkpoint, share=True)
        except SegmentGoneError:
            # A shared lease whose segment is gone is being revoked: ask the daemon afresh.
            request.ClearField("request_id")
            return self._acquire_once(request, fingerprint_of, checkpoint, share=False)

    def _acquire_once(
        self,
        request: pb.AcquireRequest,
        fingerprint_of: Callable[[pb.AcquireResponse], Fingerprint],
        checkpoint: Checkpoint | Path,
        *,
        share: bool,
    ) -> LoadedWeights:
        owner = self.socket_owner()
        request.worker.CopyFrom(worker_pb(describe_worker(self.mode)))
        # Copy mode keeps no lease to share: no key is made for it.
        key = self._sharing_key(request) if self.mode == "zero_copy" else None
        if share and key is not None and (held := _sharing.take(key)) is not None:
            return self._join(held, owner, checkpoint)
        request.request_id = uuid.uuid4().hex
        reply = _acquire_with_wait(
            self.socket, request, self._wait(), wait_for_daemon=self.wait_for_daemon
        )
        lease = lease_from_pb(reply.lease)
        lease_id = lease.lease_id
        try:
            fp = fingerprint_of(reply)
            arena, storage, views = self._map(reply, owner)
        except BaseException:
            # Any failure to map gives the lease back at once (not after its TTL); a failed
            # release must not hide why the mapping failed.
            with contextlib.suppress(WeightCacheError):
                release(self.socket, lease_id)
            raise
        weights = LoadedWeights(
            arena.tensors,
            arena=arena,
            source="cache",
            fingerprint=fp,
            checkpoint=checkpoint,
            socket=self.socket,
            model=reply.model.name,
            # The daemon's copy of the same header's: by fingerprint, the layout component
            # covers every header; by file identity, the headers are the same files'. Over
            # MAX_METADATA_BYTES the daemon sends none: read from the checkpoint then.
            metadata=_metadata(reply.model),
        )
        if self.mode == "copy":
            release(self.socket, lease_id)
            return weights
        weights.lease = ClientLease(
            lease_id=lease_id,
            instance_id=lease.instance_id,
            ttl=lease.ttl,
            policy=self.policy or default_policy(arena.base.device.type),
            on_lost=self.on_lost,
            last_ack=time.monotonic(),
            on_revoke=self.on_revoke,
            privatize=arena.privatize,
        )
        session_for(self.socket).add(weights.lease)
        if key is not None and isinstance(storage, SharedMemoryHandle):
            metadata = _metadata(reply.model)
            answer = _sharing.Answer(storage, views, owner, fp, reply.model.name, metadata)
            weights._shared = _sharing.share(key, weights.lease, answer, arena)
        return weights

    def _sharing_key(self, request: pb.AcquireRequest) -> Hashable:
        """Which shared lease would answer ``request`` (its ``request_id`` not yet set)
        under these options: the request's bytes and the options, ``on_lost`` by identity
        (a callable need not be hashable, and two equal callbacks are two to call; the
        lease holds it, so its id is not reused while the lease is shared)."""
        options = dataclasses.replace(self, on_lost=None)
        return options, id(self.on_lost), request.SerializeToString(deterministic=True)

    def _join(
        self, held: _sharing.SharedLease, owner: int, checkpoint: Checkpoint | Path
    ) -> LoadedWeights:
        """Map the arena of a lease this process holds for the same request, and share
        the lease (:mod:`weightcache._sharing`).

        Raises:
            HandleError: the segment cannot be mapped (:func:`open_shared_memory`), the
                socket's owner is not the one the lease was granted by, or the lease is
                being revoked and copying the weights out failed.
        """
        answer = held.answer
        try:
            if owner != answer.owner:
                raise HandleError(
                    f"the daemon socket {self.socket} now belongs to uid {owner}, not "
                    f"{answer.owner}, which granted this process's lease"
                )
            arena = open_shared_memory(answer.storage, answer.views, copy=False, owner=owner)
        except BaseException:
            self._give_back(held)
            raise
        try:
            held.join(arena)
        except (RuntimeError, OSError) as exc:  # joined as the lease is being revoked
            self._give_back(held)
            raise HandleError(
                f"copying the weights of a lease being revoked failed: {exc}"
            ) from None
        weights = LoadedWeights(
            arena.tensors,
            arena=arena,
            source="cache",
            fingerprint=answer.fingerprint,
            checkpoint=checkpoint,
            socket=self.socket,
            model=answer.model,
            metadata=None if answer.metadata is None else dict(answer.metadata),
            lease=held.lease,
        )
        weights._shared = held
        return weights

    def _give_back(self, held: _sharing.SharedLease) -> None:
        """A load that took a share of ``held`` and made nothing of it gives it back."""
        if held.leave(None):
            end_lease(self.socket, held.lease)

    def socket_owner(self) -> int:
        """The uid that owns the daemon's socket, once it is there and trusted; with
        ``wait_for_daemon``, waiting up to ``wait_timeout`` for it to appear.

        Raises:
            DaemonUnavailableError: no socket there (in time), or not one this process
                may connect to.
            UntrustedSocketError: the socket's owner is not trusted.
        """
        wait = self._wait()
        while True:
            try:
                return check_socket(self.socket, self.trusted)
            except PermissionError as exc:
                raise DaemonUnavailableError(socket_denied(self.socket, exc.strerror)) from None
            except FileNotFoundError:
                if not self.wait_for_daemon or wait.left() < RETRY_INTERVAL:
                    raise DaemonUnavailableError(no_socket(self.socket)) from None
                wait.start()
                time.sleep(RETRY_INTERVAL)

    def _map(
        self, reply: pb.AcquireResponse, owner: int
    ) -> tuple[MappedArena, StorageHandle, ViewColumns]:
        """The reply's arena mapped, with its handle and views as decoded.

        Raises:
            HandleError, DeviceNotVisibleError, CudaError: the handle or a view cannot be
                decoded or opened here.
        """
        # Decoded here, inside the caller's release-on-failure: a handle this SDK cannot
        # read (HandleError) must give the lease back, not leave it to expire.
        storage = storage_from_pb(reply.storage)
        views = view_columns_from_pb(reply)  # columns: no tuple or record per tensor
        copy = self.mode == "copy"
        if isinstance(storage, CudaIpcHandle):
            return open_cuda_ipc(storage, views, copy=copy), storage, views
        return open_shared_memory(storage, views, copy=copy, owner=owner), storage, views


#: The environment variable whose value a worker sends as its label (ListLeases).
ENV_LABEL = "WEIGHTCACHE_LABEL"


def describe_worker(mode: str) -> WorkerDescription:
    """This process as it describes itself in an Acquire: its pid, host name, label
    (``$WEIGHTCACHE_LABEL``, cut to 128 characters), pid namespace and ``mode``."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0  # not Linux, or no procfs
    return WorkerDescription(
        pid=os.getpid(),
        hostname=socket.gethostname()[:MAX_HOSTNAME_CHARS],
        label=os.environ.get(ENV_LABEL, "")[:MAX_ID_CHARS],
        pid_namespace=namespace,
        mode=mode,
    )


def _acquire_request(
    root: Path, fp: Fingerprint, ttl: float | None, files: dict[str, FileIdentity] | None = None
) -> pb.AcquireRequest:
    return acquire_request_pb(
        Acquisition(
            request_id="",  # set by _Attach._acquire, after the sharing key
            fingerprint=fp,
            checkpoint_path=str(root),
            files=files or {},
            ttl=ttl,
            environment=Environment(
                weightcache_version=__version__, torch_version=torch.__version__
            ),
            pid=os.getpid(),
            tensor_format="table",
        )
    )


def _acquire_with_wait(
    socket: str, request: pb.AcquireRequest, wait: _Wait, *, wait_for_daemon: bool
) -> pb.AcquireResponse:
    logged = False
    while True:
        # The daemon counts a MODEL_LOADING this attempt will wait out as "waiting", not
        # as a refusal (weightcache_acquires_total): false for the last attempt.
        request.asks_again_if_loading = wait.left() >= RETRY_INTERVAL
        try:
            return _acquire_once(socket, request)
        except (ModelLoadingError, DaemonUnavailableError) as err:
            waiting = isinstance(err, ModelLoadingError) or wait_for_daemon
            if not waiting or wait.left() < RETRY_INTERVAL:
                raise
            wait.start()
            if not logged:
                log.info("waiting", reason=err.reason, detail=err.detail)
                logged = True
            time.sleep(RETRY_INTERVAL)


def _acquire_once(socket: str, request: pb.AcquireRequest) -> pb.AcquireResponse:
    def acquire(stub: WeightCacheServiceStub) -> pb.AcquireResponse:
        reply: pb.AcquireResponse = stub.Acquire(request, timeout=RPC_TIMEOUT, wait_for_ready=False)
        return reply

    return call_shared(socket, acquire)


def _metadata(model: pb.Model) -> dict[str, str] | None:
    """The ``__metadata__`` a Model message echoes, or None when the daemon omitted it
    (over ``core.protocol.MAX_METADATA_BYTES``): ``LoadedWeights.metadata`` then reads the
    checkpoint's header."""
    return None if model.metadata_omitted else dict(model.metadata)
