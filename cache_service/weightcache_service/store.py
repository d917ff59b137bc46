"""The models a daemon holds: loading into arenas, lookup by fingerprint, eviction.

Loading streams one tensor at a time from the checkpoint through the recipe into the
arena, so the daemon's peak memory is about the arena plus the largest tensor. The store
itself is not thread-safe: the server calls it from its event loop, and runs only
:meth:`Store.load` in a worker thread; a load touches nothing but its own entry, except to
compare its final fingerprint with the other entries' (under a lock, so that of two loads
of one content that end at once, one is refused).

At level ``full``, shards whose sha256 the hash cache does not hold are hashed while they
are copied into the arena (threads reading the same descriptors), not before: the files are
read once from disk, and a first load takes about the longer of the two, not their sum.
Until then the entry's fingerprint is pending (:func:`pending_fingerprint`); a second load
of the very same files is refused at once by file identity (when that identity vouches for
their bytes: :meth:`Checkpoint.identities_vouch`), and one of the same content from other
files when the hashes are known.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from weightcache.core.checkpoint import Checkpoint, FileIdentity
from weightcache.core.errors import (
    FingerprintMismatchError,
    ModelExistsError,
    ModelFailedError,
    ModelLoadingError,
    ModelNotFoundError,
    ResourceExhaustedError,
    WeightCacheError,
)
from weightcache.core.fingerprint import (
    REQUEST_COMPONENTS,
    Fingerprint,
    Level,
    compute_fingerprint,
)
from weightcache.core.pipeline import CheckpointReader, materialize
from weightcache.core.recipe import Pipeline, Placement, Recipe
from weightcache.core.records import LoadProgress, ModelInfo, ModelState, StorageHandle, TensorView
from weightcache.core.timestamps import fs_type, stamps_every_write
from weightcache_service.arena import Arena, SharedMemoryArena, Slot, plan_slots, tail
from weightcache_service.budget import MemoryBudget
from weightcache_service.hashing import ShardHashes


@dataclass
class Entry:
    """One model held or being loaded."""

    name: str
    checkpoint: Checkpoint
    recipe: Recipe
    placement: Placement
    pipeline: Pipeline
    fingerprint: Fingerprint
    state: ModelState = "loading"
    slots: list[Slot] = field(default_factory=list)
    size: int = 0
    arena: Arena | None = None
    bytes_done: int = 0
    data_bytes: int = 0
    tensors_done: int = 0
    error: str = ""
    failure: WeightCacheError | None = None
    cancelled: bool = False
    finished: threading.Event = field(default_factory=threading.Event)
    create_time: float = field(default_factory=time.time)
    load_seconds: float = 0.0
    views: tuple[TensorView, ...] = ()
    handle: StorageHandle | None = None
    #: Where the bytes come from: ``"checkpoint"`` or ``"peer NAME"`` (:mod:`.seeding`).
    source: str = "checkpoint"
    #: At level ``full``: shard name -> sha256 of the file, once known (what a peer
    #: seeding from this daemon is given: :mod:`.seed_serve`).
    file_sha256: dict[str, str] = field(default_factory=dict)
    #: Whether the bytes held are known to be those of the checkpoint's files (an Acquire
    #: by file identity may then be answered). False for a model seeded from a peer whose
    #: digests the local hash cache did not confirm: a worker must send its fingerprint.
    files_confirmed: bool = True
    #: The recipe as applied (plan found, plugin steps): what the model is reported with.
    resolved: Recipe = field(init=False)

    def __post_init__(self) -> None:
        self.resolved = self.pipeline.resolved()

    def loaded_from(self, components: dict[str, str], files: dict[str, FileIdentity]) -> bool:
        """Whether this model has the request components ``components`` (format, placement,
        recipe) and was loaded from ``files``: each file it read is there, by name, with the
        same identity (dev, inode, size, mtime, ctime), so it is the same file, unchanged
        (that it proves so: :meth:`Checkpoint.identities_vouch`, checked by callers that
        hand out the model's bytes for it)."""
        if not self.files_confirmed:
            return False
        held = self.fingerprint.components
        if any(held.get(name) != components.get(name) for name in REQUEST_COMPONENTS):
            return False
        # Every file the load read (shards, index), as it was when opened.
        read = self.checkpoint.file_identities()
        return bool(read) and all(files.get(n) == i for n, i in read.items())

    def progress(self) -> LoadProgress:
        """How far the load has come."""
        return LoadProgress(
            bytes_done=self.bytes_done,
            bytes_total=self.data_bytes,
            tensors_done=self.tensors_done,
            tensors_total=len(self.slots),
        )

    def info(self, lease_count: int) -> ModelInfo:
        """A snapshot of the model, with ``lease_count`` live leases on it."""
        return ModelInfo(
            name=self.name,
            state=self.state,
            fingerprint=self.fingerprint,
            path=str(self.checkpoint.root),
            recipe=self.resolved,
            placement=self.placement,
            size_bytes=self.size,
            tensor_count=len(self.slots),
            lease_count=lease_count,
            create_time=self.create_time,
            progress=self.progress(),
            error=self.error,
            load_seconds=self.load_seconds if self.state == "ready" else None,
            metadata=dict(self.checkpoint.metadata),
            source=self.source,
        )


@dataclass
class Refusal:
    """A start-up model refused before it held anything: its path names no checkpoint, a
    header is malformed, its recipe cannot be built. Kept so that ``ls``, ``health`` and
    the metrics show it FAILED with its reason (there is no checkpoint, hence no
    fingerprint), until it is evicted or preloaded again.

    Attributes:
        name: its name among the models (the path's basename, made unique).
        path: the model argument as given (a path, or a Hub repo id not found).
        failure: why it was refused.
    """

    name: str
    path: str
    recipe: Recipe
    placement: Placement
    level: Level
    failure: WeightCacheError
    create_time: float = field(default_factory=time.time)

    def info(self) -> ModelInfo:
        """The refusal as a FAILED model without fingerprint, bytes or tensors."""
        return ModelInfo(
            name=self.name,
            state="failed",
            fingerprint=Fingerprint("", self.level, {}),
            path=self.path,
            recipe=self.recipe,
            placement=self.placement,
            size_bytes=0,
            tensor_count=0,
            lease_count=0,
            create_time=self.create_time,
            progress=LoadProgress(),
            error=f"{self.failure.reason}: {self.failure.detail}",
        )


class Store:
    """Every model of one daemon, by name.

    Args:
        make_arena: allocates an arena of a size in bytes (the backend).
        budget: admission control for new arenas; none by default.
    """

    def __init__(
        self, make_arena: Callable[[int], Arena], budget: MemoryBudget | None = None
    ) -> None:
        self._make_arena = make_arena
        self.budget = budget
        self._entries: dict[str, Entry] = {}
        #: Start-up models refused before they held anything, by name (listed FAILED).
        self.refusals: dict[str, Refusal] = {}
        #: Names of FAILED models evicted since (readiness no longer requires them), until
        #: a model takes the name again.
        self.given_up: set[str] = set()
        # Taken by a load thread to compare its completed fingerprint and turn READY.
        self._settling = threading.Lock()

    def entries(self) -> list[Entry]:
        """Every entry, sorted by name."""
        return [self._entries[k] for k in sorted(self._entries)]

    def get(self, name: str) -> Entry:
        """The entry called ``name``.

        Raises:
            ModelNotFoundError: no such model.
        """
        entry = self._entries.get(name)
        if entry is None:
            raise ModelNotFoundError(
                f"no model named {clip(name)!r}", metadata={"model": clip(name)}
            )
        return entry

    def add(
        self,
        checkpoint: Checkpoint,
        recipe: Recipe,
        placement: Placement,
        pipeline: Pipeline,
        fp: Fingerprint,
        *,
        unlinked: int = 0,
        name: str | None = None,
    ) -> Entry:
        """Register a model in state LOADING and size its arena from the planned specs.

        A model refused for lack of memory stays registered as FAILED (no arena), so that
        a worker asking for it learns why (:meth:`find`); unless its fingerprint is
        pending: the caller is to complete it and add it again (it may be a copy of a
        model held or loading, then refused as such).

        Args:
            fp: the fingerprint, or at level ``full`` a pending one
                (:func:`~weightcache.core.fingerprint.pending_fingerprint`): the load then
                hashes the shards and completes it.
            unlinked: bytes of revoked arenas workers still map, counted against the
                budget (:meth:`MemoryBudget.check`).
            name: the name before its suffixes (a Hub repo id's); None: the checkpoint
                folder's basename.

        Raises:
            ModelExistsError: a model with the same fingerprint is already held, or one
                loaded (or loading) from the very same files with the same format, recipe
                and placement.
            ResourceExhaustedError: the arena would not fit the memory budget.
        """
        files = checkpoint.file_identities()
        for entry in list(self._entries.values()):
            if entry.state == "failed" and _same_request(entry, checkpoint, recipe, placement):
                # A retry replaces a failed load (the files may have been fixed since), and
                # takes its name: readiness requires that name (health.Readiness).
                del self._entries[entry.name]
                continue
            if not _same_model(entry, fp, files):
                continue
            if entry.state == "failed":
                del self._entries[entry.name]  # a retry replaces a failed load
            else:
                raise ModelExistsError(
                    f"model {entry.name!r} already holds this fingerprint",
                    metadata={"model": entry.name},
                )
        self.drop_refusals(str(checkpoint.root))
        self._forget_failed(MAX_FAILED - 1)
        unique = self._unique_name(str(checkpoint.root), recipe, placement, name)
        entry = Entry(unique, checkpoint, recipe, placement, pipeline, fp)
        _plan(entry)
        if self.budget is not None:
            try:
                held, pending = self.held_bytes(), self.pending_bytes()
                self.budget.check(entry.name, entry.size, held, pending, unlinked)
            except ResourceExhaustedError as err:
                if fp.pending:
                    raise  # not kept: the caller hashes it and adds it again
                _fail(entry, ResourceExhaustedError(err.detail, metadata=dict(err.metadata)))
                entry.finished.set()  # no load will run: nothing to wait for at shutdown
                self._entries[entry.name] = entry
                raise
        self._entries[entry.name] = entry
        self.given_up.discard(entry.name)
        return entry

    def adopt(  # noqa: PLR0917 (each argument is one part of the entry)
        self,
        name: str,
        checkpoint: Checkpoint,
        recipe: Recipe,
        placement: Placement,
        pipeline: Pipeline,
        fp: Fingerprint,
        arena_of: Callable[[int], Arena],
        load_seconds: float,
    ) -> Entry:
        """Register as READY a model whose arena a predecessor handed over
        (:mod:`weightcache_service.handover`): its layout is planned from the checkpoint's
        headers, as a load plans it, and ``arena_of(size)`` adopts the segment, which must
        be of that size. Named ``name`` if free. No budget check: the memory is held already.

        Raises:
            ValueError: the planned size is not the segment's (``arena_of`` raises it, or
                anything it raises).
        """
        if name in self._entries:
            name = self._unique_name(str(checkpoint.root), recipe, placement)
        entry = Entry(name, checkpoint, recipe, placement, pipeline, fp)
        _plan(entry)
        entry.arena = arena_of(entry.size)
        entry.views = tuple(slot.view() for slot in entry.slots)
        entry.handle = entry.arena.handle()
        entry.bytes_done, entry.tensors_done = entry.data_bytes, len(entry.slots)
        entry.load_seconds = load_seconds
        entry.state = "ready"
        entry.finished.set()
        self._entries[name] = entry
        return entry

    def detach(self, name: str) -> Entry:
        """Drop a model, leaving its segment in place for a successor (hand-over): the
        daemon's mapping is closed, the segment is not unlinked.

        Raises:
            ModelNotFoundError: no such model.
        """
        entry = self.get(name)
        del self._entries[name]
        entry.handle = None
        if isinstance(entry.arena, SharedMemoryArena):
            entry.arena.close(unlink=False)
        entry.arena = None
        return entry

    def refuse(
        self,
        path: str,
        recipe: Recipe,
        placement: Placement,
        level: Level,
        failure: WeightCacheError,
        *,
        name: str | None = None,
    ) -> Refusal:
        """Keep a start-up model refused before it held anything (:class:`Refusal`),
        named ``name`` (None: the path's basename) with its suffixes."""
        failure.__traceback__ = failure.__context__ = failure.__cause__ = None
        unique = self._unique_name(path.rstrip("/"), recipe, placement, name)
        refusal = Refusal(unique, path, recipe, placement, level, failure)
        self.refusals[unique] = refusal
        self.given_up.discard(unique)
        return refusal

    def _forget_failed(self, keep: int) -> None:
        """Forget the oldest FAILED models beyond ``keep`` (:data:`MAX_FAILED`)."""
        failed = sorted(
            (e for e in self._entries.values() if e.state == "failed"),
            key=lambda e: e.create_time,
        )
        for entry in failed[: max(0, len(failed) - keep)]:
            self.remove(entry.name)

    def drop_refusals(self, root: str) -> None:
        """Forget the refusals of the checkpoint folder ``root`` (it is being loaded)."""
        for name, refusal in list(self.refusals.items()):
            if os.path.realpath(refusal.path) == root:
                del self.refusals[name]

    def _unique_name(
        self, root: str, recipe: Recipe, placement: Placement, name: str | None = None
    ) -> str:
        base = name or os.path.basename(root) or "model"
        if placement.tp_size > 1:
            base += f"-tp{placement.tp_rank}of{placement.tp_size}"
        if recipe.dtype:
            base += f"-{recipe.dtype.lower()}"
        name, n = base, 1
        while name in self._entries or name in self.refusals:
            n += 1
            name = f"{base}-{n}"
        return name

    def load(self, entry: Entry) -> None:
        """Read, process and pin ``entry``'s tensors; sets READY or FAILED (also when a
        shard changed since it was fingerprinted: INVALID_CHECKPOINT). Closes the
        checkpoint's files. Thread-safe with respect to other entries; never raises (the
        failure is kept on the entry)."""
        try:
            self._load(entry)
        finally:
            entry.checkpoint.close()
            entry.finished.set()

    def _load(self, entry: Entry) -> None:
        start = time.monotonic()
        hashing: ShardHashes | None = None
        try:
            if entry.fingerprint.pending:
                hashing = ShardHashes(entry.checkpoint)
            entry.arena = self._make_arena(entry.size)
            with CheckpointReader(entry.checkpoint) as reader:
                for slot in entry.slots:
                    self._load_tensor(entry, entry.arena, reader, slot)
            if hashing is not None:
                digests = hashing.result(lambda: entry.cancelled)
                entry.fingerprint = compute_fingerprint(
                    entry.checkpoint,
                    entry.pipeline,
                    entry.placement,
                    "full",
                    file_sha256=digests,
                )
                entry.file_sha256 = dict(digests)
            # The fingerprint and the arena were both read from these files.
            entry.checkpoint.check_unchanged()
            entry.views = tuple(slot.view() for slot in entry.slots)
            # Built once, in the load thread: for CUDA it waits for every copy to land.
            entry.handle = entry.arena.handle()
            self._make_ready(entry, time.monotonic() - start)
        except WeightCacheError as exc:
            _fail(entry, exc)
        except Exception as exc:
            # Plugin code and torch raise anything; whatever it is, the load has failed
            # and must say so, not leave the model LOADING with its arena held.
            _fail(entry, ModelFailedError(f"{entry.name}: {type(exc).__name__}: {exc}"))
        finally:
            if hashing is not None:
                hashing.stop()  # before the checkpoint's descriptors close
            # Every way out but success frees the arena at once, whatever escaped.
            if entry.state != "ready":
                if entry.failure is None:
                    _fail(entry, ModelFailedError(f"load of {entry.name!r} was interrupted"))
                self._free(entry)

    def load_seeded(
        self,
        entry: Entry,
        seed: Callable[[Entry, Arena], None],
        fallback: Callable[[Entry, Exception], None],
    ) -> None:
        """Fill ``entry``'s arena through ``seed`` (which pulls the bytes from a peer and
        verifies them, raising anything on failure); on any failure, free the arena, let
        ``fallback`` log why and reset the entry (its fingerprint, source), and load it from
        its files as :meth:`load` does. Sets READY or FAILED; never raises."""
        try:
            start = time.monotonic()
            try:
                entry.arena = self._make_arena(entry.size)
                seed(entry, entry.arena)
                entry.checkpoint.check_unchanged()
                entry.views = tuple(slot.view() for slot in entry.slots)
                entry.handle = entry.arena.handle()
                self._make_ready(entry, time.monotonic() - start)
                if entry.state != "ready":
                    self._free(entry)  # a copy of a model held (MODEL_EXISTS)
                return
            except Exception as exc:
                exc.__traceback__ = None  # its frames may hold views of the arena
                self._free(entry)
                entry.views, entry.bytes_done, entry.tensors_done = (), 0, 0
                if entry.cancelled:
                    _fail(entry, ModelFailedError(f"load of {entry.name!r} cancelled at shutdown"))
                    return
                fallback(entry, exc)
            self._load(entry)
        finally:
            entry.checkpoint.close()
            entry.finished.set()

    def _make_ready(self, entry: Entry, seconds: float) -> None:
        """READY, unless the load completed a pending fingerprint that another model
        (READY or loading) already has: then FAILED with :class:`ModelExistsError`. Either
        state is set under the lock, so that of two such loads ending at once the second
        sees the first's outcome."""
        with self._settling:
            held = [e for e in list(self._entries.values()) if e is not entry]
            for other in held:
                if other.state in ("loading", "ready") and (
                    other.fingerprint.digest == entry.fingerprint.digest
                ):
                    _fail(
                        entry,
                        ModelExistsError(
                            f"model {other.name!r} already holds this fingerprint "
                            f"(found once {entry.name!r}'s shards were hashed)",
                            metadata={"model": other.name},
                        ),
                    )
                    return
            entry.load_seconds = seconds
            entry.state = "ready"

    @staticmethod
    def _load_tensor(entry: Entry, arena: Arena, reader: CheckpointReader, slot: Slot) -> None:
        if entry.cancelled:
            raise ModelFailedError(f"load of {entry.name!r} cancelled at shutdown")
        node = entry.pipeline.nodes[slot.name]
        stored = node.stored
        if stored is not None:
            done = arena.copy_from_file(slot, entry.checkpoint.fd(stored.shard), stored.begin)
            if done < slot.nbytes:
                # Refused, or the file ended: the read path copies the rest, and raises
                # InvalidCheckpointError for a short or failed read as it always did.
                rest = replace(stored, begin=stored.begin + done, nbytes=stored.nbytes - done)
                arena.read_into(tail(slot, done), lambda out: reader.read_into(rest, out))
        else:
            arena.write(slot, materialize(node, reader))
        entry.bytes_done += slot.nbytes
        entry.tensors_done += 1

    def find(self, fp: Fingerprint, path: str) -> Entry:
        """The READY model whose fingerprint is ``fp``.

        A FAILED model answers for its fingerprint, and for its path before any other
        model is compared.

        Raises:
            ModelLoadingError: the model is still loading (also a load whose fingerprint
                is pending and agrees with every component of ``fp`` it has; a FAILED one
                with a pending fingerprint answers only for its path).
            ResourceExhaustedError: the model was refused or failed for lack of memory.
            ModelFailedError: the model failed to load (``metadata["cause"]`` is the
                failure's reason code).
            FingerprintMismatchError: no exact match, but a held model has the same path or
                the same layout (shard names, sizes, headers); ``metadata["components"]``
                lists what differs.
            ModelNotFoundError: nothing matches or resembles ``fp``.
        """
        candidates = [e for e in self._entries.values() if e.state != "evicting"]
        # READY first: a load refused as a duplicate has the held model's digest until
        # the event loop drops it.
        for entry in sorted(candidates, key=lambda e: e.state != "ready"):
            if entry.fingerprint.digest == fp.digest:
                return _ready(entry)
        # A load still hashing its shards may turn out to be this model: not yet a miss.
        for entry in self.loading_as(fp):
            _ready(entry)
        # A model of this path that the daemon failed to hold explains the miss better than
        # an unrelated held model that happens to share a layout.
        for entry in candidates:
            if entry.state == "failed" and str(entry.checkpoint.root) == path:
                _ready(entry)
        best: tuple[int, Entry, list[str]] | None = None
        for entry in candidates:
            if str(entry.checkpoint.root) != path and not entry.fingerprint.same_layout(fp):
                continue
            differing = entry.fingerprint.differing(fp)
            if best is None or len(differing) < best[0]:
                best = (len(differing), entry, differing)
        if best is None:
            raise ModelNotFoundError(
                f"no held model matches fingerprint {fp.digest[:16]}… of {clip(path)}",
                metadata={"path": clip(path)},
            )
        _, entry, differing = best
        if entry.fingerprint.level != fp.level:
            raise FingerprintMismatchError(
                f"held model {entry.name!r} was fingerprinted at level "
                f"{entry.fingerprint.level!r}, this request at level {fp.level!r}: a "
                "fingerprint at another level differs in every checkpoint file, whether or "
                f"not the files changed; load with fingerprint_level="
                f"{entry.fingerprint.level!r} (the daemon's --fingerprint-level)",
                metadata={
                    "model": entry.name,
                    "components": ",".join(differing),
                    "level": entry.fingerprint.level,
                },
            )
        dtype = entry.recipe.dtype or "as stored"
        held = (
            f"fingerprint level {entry.fingerprint.level}, dtype {dtype}, "
            f"tp rank {entry.placement.tp_rank} of {entry.placement.tp_size}"
        )
        raise FingerprintMismatchError(
            f"held model {entry.name!r} ({held}) differs in {', '.join(differing)}",
            metadata={"model": entry.name, "components": ",".join(differing)},
        )

    def find_by_files(
        self, components: dict[str, str], files: dict[str, FileIdentity], path: str
    ) -> Entry:
        """The READY model loaded from ``files`` with the request ``components`` (format,
        placement, recipe): an Acquire by file identity (:meth:`Entry.loaded_from`).

        Raises:
            ModelLoadingError, ResourceExhaustedError, ModelFailedError: as :meth:`find`,
                for the model that matches when none that matches is READY.
            ModelNotFoundError: no model was loaded from these files with these components
                (the worker then sends its whole fingerprint to :meth:`find`).
        """
        matches = [
            e
            for e in self._entries.values()
            if e.state != "evicting" and e.loaded_from(components, files)
        ]
        vouched = [e for e in matches if e.checkpoint.identities_vouch()]
        for entry in sorted(vouched, key=lambda e: e.state != "ready"):
            return _ready(entry)
        unstamped = _unstamped(matches[0]) if matches else []
        if unstamped:
            # tmpfs: a write through a shared mapping moves no stamp, so equal identities
            # prove nothing; the worker's fingerprint, from the bytes, does.
            kind = fs_type(unstamped[0].dev)
            raise ModelNotFoundError(
                f"model {matches[0].name!r} was loaded from these files, but they are on "
                f"{kind}, where a write through a shared mapping changes a file without a "
                "new mtime or ctime: their identity cannot vouch for their bytes; send the "
                "fingerprint",
                metadata={"path": clip(path), "model": matches[0].name},
            )
        if matches:
            # Same identity, but changed within a timestamp granule of the daemon's read:
            # the identity cannot tell, the worker's own fingerprint can.
            raise ModelNotFoundError(
                f"model {matches[0].name!r} was loaded from these files, but they changed "
                "within their file system's timestamp granule of when the daemon read them: "
                "their identity cannot vouch for their bytes; send the fingerprint",
                metadata={"path": clip(path), "model": matches[0].name},
            )
        raise ModelNotFoundError(
            f"no held model was loaded from the files of {clip(path)} with this recipe, "
            "placement and fingerprint level",
            metadata={"path": clip(path)},
        )

    def remove(self, name: str) -> Entry:
        """Drop a model and free its arena (the caller has checked its leases).

        Raises:
            ModelNotFoundError: no such model.
        """
        entry = self.get(name)
        del self._entries[name]
        self._free(entry)
        return entry

    def held_bytes(self) -> int:
        """Bytes of arenas held or reserved by a load in progress."""
        return sum(e.size for e in self._entries.values() if e.state != "failed")

    def loading_as(self, fp: Fingerprint) -> list[Entry]:
        """The loads whose pending fingerprint may turn out to be ``fp``."""
        return [
            e
            for e in self._entries.values()
            if e.state == "loading" and e.fingerprint.pending and e.fingerprint.may_become(fp)
        ]

    def pending_bytes(self) -> int:
        """Bytes admitted but not yet allocated: loads whose arena does not exist yet, which
        the backend's free space (statvfs, MemAvailable) does not show."""
        return sum(
            e.size for e in self._entries.values() if e.state == "loading" and e.arena is None
        )

    def close(self) -> None:
        """Free every arena (at shutdown)."""
        for entry in list(self._entries.values()):
            self._free(entry)
        self._entries.clear()

    @staticmethod
    def _free(entry: Entry) -> None:
        entry.handle = None
        if entry.arena is not None:
            entry.arena.close()
            entry.arena = None


#: FAILED models kept (listed by ``ls``, ``health`` and the metrics, each with its
#: labelled series); when a new model is added, the oldest FAILED ones beyond are
#: forgotten, so that Preloads failing again and again grow neither ListModels nor
#: ``/metrics`` without end (issue 37, item 10). Loads still in flight may fail on top.
MAX_FAILED = 32

#: Characters of a request string echoed in an error: the status message and ErrorInfo
#: travel in trailers, which gRPC limits to 8-16 KiB in all.
ECHO_CHARS = 200


def clip(text: str) -> str:
    """``text`` cut to :data:`ECHO_CHARS` characters for an error message."""
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "…"


def _plan(entry: Entry) -> None:
    """Lay out ``entry``'s tensors in its arena (slots, size, data bytes), from its
    pipeline's specs."""
    entry.slots, entry.size = plan_slots(
        (name, node.spec.dtype, node.spec.shape) for name, node in entry.pipeline.nodes.items()
    )
    entry.data_bytes = sum(slot.nbytes for slot in entry.slots)


def _fail(entry: Entry, error: WeightCacheError) -> None:
    """Mark ``entry`` FAILED with ``error``, kept without its traceback: the frames of a
    failed read hold views of the arena, which would keep it mapped."""
    error.__traceback__ = error.__context__ = error.__cause__ = None
    entry.failure = error
    entry.error = str(error)
    entry.state = "failed"


def _unstamped(entry: Entry) -> list[FileIdentity]:
    """The files of ``entry`` on file systems that do not stamp every write (tmpfs)."""
    return [i for i in entry.checkpoint.file_identities().values() if not stamps_every_write(i.dev)]


def _same_request(
    entry: Entry, checkpoint: Checkpoint, recipe: Recipe, placement: Placement
) -> bool:
    """Whether ``entry`` was asked for with the same folder, recipe and placement."""
    return (entry.checkpoint.root, entry.recipe, entry.placement) == (
        checkpoint.root,
        recipe,
        placement,
    )


def _same_model(entry: Entry, fp: Fingerprint, files: dict[str, FileIdentity]) -> bool:
    """Whether ``entry`` is the model of fingerprint ``fp`` read from ``files``: the same
    digest, or (either fingerprint may be pending) the same files and request components."""
    if fp.digest and entry.fingerprint.digest == fp.digest:
        return True
    # By identity only where it vouches: files rewritten within a timestamp granule of the
    # held load are loaded again, and refused then only if their digest is the same.
    return entry.loaded_from(fp.components, files) and entry.checkpoint.identities_vouch()


def _ready(entry: Entry) -> Entry:
    if entry.state == "ready":
        return entry
    if entry.state == "loading":
        raise ModelLoadingError(
            f"model {entry.name!r} is loading ({entry.bytes_done}/{entry.data_bytes} bytes)",
            metadata={
                "model": entry.name,
                "bytes_done": str(entry.bytes_done),
                "bytes_total": str(entry.data_bytes),
            },
        )
    failure = entry.failure
    if isinstance(failure, ResourceExhaustedError):
        raise ResourceExhaustedError(
            f"model {entry.name!r} was not loaded: {entry.error}",
            metadata={**failure.metadata, "model": entry.name},
        )
    cause = {"cause": failure.reason} if failure is not None else {}
    # The state is named as on the wire (MODEL_STATE_FAILED), as workers and logs read it.
    raise ModelFailedError(
        f"model {entry.name!r} is MODEL_STATE_{entry.state.upper()}: {entry.error}",
        metadata={"model": entry.name, **cause},
    )
