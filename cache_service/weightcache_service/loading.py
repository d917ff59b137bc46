"""Loading: a checkpoint validated and fingerprinted off the event loop, then copied into
an arena in a thread (or seeded from a peer daemon first: :mod:`.seeding`), logged and
reported as it ends; start-up models refused before they held anything; the wait for
every load at shutdown. The store (:mod:`.store`) holds the entries and does the copy."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import structlog

from weightcache.core.checkpoint import Checkpoint, open_checkpoint
from weightcache.core.errors import (
    InvalidArgumentError,
    ModelExistsError,
    ModelFailedError,
    ModelNotFoundError,
    ResourceExhaustedError,
    WeightCacheError,
)
from weightcache.core.fingerprint import (
    Fingerprint,
    Level,
    cached_digests,
    compute_fingerprint,
    pending_fingerprint,
)
from weightcache.core.protocol import MAX_ID_CHARS
from weightcache.core.recipe import Pipeline, Placement, Recipe
from weightcache_service.events import CacheEvents
from weightcache_service.options import ServiceOptions
from weightcache_service.store import Entry, Refusal, Store

log = structlog.get_logger("weightcache.daemon")


class Loader:
    """The loads of one daemon's store.

    Args:
        store: the models held (entries are added to it and loaded by it).
        options: the seeding options (``peer_tls``, ``seed_*``).
        events: where loads and refusals are reported (the cache replaces it).
        check_opened: refuses a file opened outside every model root
            (:meth:`.Admission.check_opened`), for a confined (remote) Preload.
        unlinked_bytes: bytes of arenas revoked but still mapped
            (:meth:`.Revocation.unlinked_bytes`), counted against the budget.
    """

    def __init__(
        self,
        store: Store,
        options: ServiceOptions,
        events: CacheEvents,
        check_opened: Callable[[Path], None],
        unlinked_bytes: Callable[[], int],
    ) -> None:
        self.store = store
        self.options = options
        self.events = events
        self._check_opened = check_opened
        self.unlinked_bytes = unlinked_bytes
        self._loads: set[asyncio.Task[None]] = set()

    async def begin_load(
        self,
        path: str,
        recipe: Recipe,
        placement: Placement,
        level: Level,
        *,
        confine: bool = False,
        name: str | None = None,
        seed_from: str = "",
    ) -> tuple[Entry, asyncio.Task[None]]:
        """Validate and fingerprint a checkpoint (off the event loop), then start loading it
        (from the peer daemon ``seed_from`` first, when given: :mod:`.seeding`).

        At level ``full``, shards the hash cache does not know are hashed during the load:
        the entry's fingerprint is pending until then, and a load that then turns out to
        hold a model already held fails with :class:`ModelExistsError` and is dropped (no
        record, not counted as a failed load). When the budget refuses a model whose
        fingerprint is pending, its shards are hashed first after all, and the refusal is
        then :class:`ModelExistsError` for a copy of a held model, as it always was.

        Args:
            confine: every file read must resolve inside a model root (remote Preload).
            name: the model's name before its suffixes (a Hub repo id's), None for the
                checkpoint folder's basename.

        Raises:
            InvalidCheckpointError: the checkpoint is malformed.
            RecipeError: the recipe cannot be built for the checkpoint.
            PermissionDeniedError: ``confine`` and a file resolves outside the roots.
            ModelExistsError: the fingerprint is already held, or a model loaded from the
                very same files with the same recipe, placement and level.
            ResourceExhaustedError: the arena would not fit the memory budget.
            InvalidArgumentError: ``seed_from`` is given and this daemon has no peer TLS
                files (``--peer-tls-*``): no peer would serve it (``field=seed_from``).
        """

        try:
            if seed_from and not self.options.peer_tls:
                raise InvalidArgumentError(
                    f"seeding from {seed_from[:MAX_ID_CHARS]} needs mutual TLS: start the "
                    "daemon with --peer-tls-cert, --peer-tls-key and --peer-tls-ca "
                    "(docs/seeding.md)",
                    metadata={"field": "seed_from"},
                )
            return await self._begin_load(path, recipe, placement, level, confine, name, seed_from)
        except ModelExistsError:
            raise  # nothing to load: not a refusal
        except WeightCacheError as err:
            self.events.preload_refused(err.reason)
            raise
        except Exception:
            self.events.preload_refused(ModelFailedError.reason)
            raise

    async def _begin_load(  # noqa: PLR0917 (begin_load's arguments, passed on)
        self,
        path: str,
        recipe: Recipe,
        placement: Placement,
        level: Level,
        confine: bool,
        name: str | None,
        seed_from: str,
    ) -> tuple[Entry, asyncio.Task[None]]:
        def prepare() -> tuple[Checkpoint, Pipeline, Fingerprint]:
            # Confinement is checked on each file as opened: a path checked before the
            # open could be swapped for a symlink in between.
            check = self._check_opened if confine else None
            checkpoint = open_checkpoint(path, check_file=check)
            try:
                pipeline = recipe.build(checkpoint, placement)
                known = cached_digests(checkpoint) if level == "full" else {}
                if level == "full" and len(known) < len(checkpoint.shards):
                    # Hashed while the load copies them (weightcache_service.hashing).
                    fp = pending_fingerprint(checkpoint, pipeline, placement)
                else:
                    fp = compute_fingerprint(
                        checkpoint, pipeline, placement, level, file_sha256=known
                    )
            except BaseException:
                checkpoint.close()
                raise
            return checkpoint, pipeline, fp

        checkpoint, pipeline, fp = await asyncio.to_thread(prepare)

        def add(fp: Fingerprint) -> Entry:
            # The unlinked bytes are read at each try: a revoked arena may be gone by then.
            return self.store.add(
                checkpoint,
                recipe,
                placement,
                pipeline,
                fp,
                unlinked=self.unlinked_bytes(),
                name=name,
            )

        try:
            try:
                entry = add(fp)
            except ResourceExhaustedError:
                if not fp.pending:
                    raise
                # Refused for memory before its content was known: hash it now, and let
                # the loads it may be a copy of end, so that a copy of a model held is
                # refused as such (MODEL_EXISTS), and a model refused for memory is kept
                # FAILED under the digest its workers ask for.
                fp = await asyncio.to_thread(
                    compute_fingerprint, checkpoint, pipeline, placement, level
                )
                for other in self.store.loading_as(fp):
                    await asyncio.to_thread(other.finished.wait)
                entry = add(fp)
        except BaseException:
            checkpoint.close()
            raise
        if not fp.pending and level == "full":
            entry.file_sha256 = cached_digests(checkpoint)
        log.info(
            "loading",
            model=entry.name,
            path=str(checkpoint.root),
            bytes=entry.size,
            **({"seed_from": seed_from} if seed_from else {}),
        )
        if seed_from:
            from weightcache_service.seeding import PeerTls, Seeder

            tls = PeerTls(*self.options.peer_tls) if self.options.peer_tls else None
            seeder = Seeder(
                seed_from,
                tls,
                self.events,
                streams=self.options.seed_streams,
                chunk_bytes=self.options.seed_chunk_bytes,
                stall_timeout=self.options.seed_stall_timeout,
                plane=self.options.seed_plane,
            )
            load = asyncio.to_thread(self.store.load_seeded, entry, seeder.seed, seeder.fallback)
        else:
            load = asyncio.to_thread(self.store.load, entry)
        task = asyncio.create_task(load)
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)
        task.add_done_callback(lambda _t: self._finished(entry))
        return entry, task

    def _finished(self, entry: Entry) -> None:
        if isinstance(entry.failure, ModelExistsError):
            # Refused like a Preload of a held fingerprint, only later: no FAILED record
            # stays, and it is not a failed load (logged as the server logs a refusal).
            with contextlib.suppress(ModelNotFoundError):
                if self.store.get(entry.name) is entry:
                    self.store.remove(entry.name)
            log.warning("already held", model=entry.name, error=entry.error)
            return
        self._log_loaded(entry)
        self.events.loaded(entry)

    @staticmethod
    def _log_loaded(entry: Entry) -> None:
        if entry.state == "ready":
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

    def refuse(
        self,
        path: str,
        recipe: Recipe,
        placement: Placement,
        level: Level,
        err: Exception,
        *,
        name: str | None = None,
    ) -> Refusal:
        """Keep a start-up model refused before it held anything, listed FAILED with
        ``err`` (anything but a :class:`WeightCacheError` is kept as MODEL_FAILED), named
        ``name`` (None: the path's basename) with its suffixes."""
        failure = (
            err
            if isinstance(err, WeightCacheError)
            else ModelFailedError(f"{type(err).__name__}: {err}")
        )
        return self.store.refuse(path, recipe, placement, level, failure, name=name)

    async def wait_loads(self) -> None:
        """Wait for every load in progress to end (at shutdown)."""
        entries = self.store.entries()
        for entry in entries:
            entry.cancelled = True
        # Wait on the threads themselves: a cancelled asyncio task does not stop its thread,
        # and freeing an arena a thread still writes into would crash the process.
        await asyncio.to_thread(lambda: [entry.finished.wait() for entry in entries])
