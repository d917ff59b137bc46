"""Adoption: what a daemon hands over to its successor at a restart (``--hand-over``,
SIGUSR2), and the successor's taking it over: READY models on shared memory, served from
the same segments, with their leases under the same ids (issue 26, docs/leases.md). The
manifest that carries them is :mod:`.handover`; ``server.Daemon`` writes and reads it."""

from __future__ import annotations

import time
from collections.abc import Callable

from weightcache.core.checkpoint import Checkpoint, open_checkpoint
from weightcache.core.fingerprint import (
    Fingerprint,
    cached_digests,
    compute_fingerprint,
    pending_fingerprint,
)
from weightcache.core.recipe import Pipeline
from weightcache.core.records import SharedMemoryHandle
from weightcache_service.arena import Arena
from weightcache_service.handover import HandOverRefusedError, HeldLease, HeldModel
from weightcache_service.leases import LeaseTable
from weightcache_service.store import Entry, Store


def handed_over(store: Store, leases: LeaseTable) -> list[HeldModel]:
    """What a hand-over leaves to the successor: every READY model whose arena is a
    shared-memory segment, with its live leases."""
    held = []
    for entry in store.entries():
        if entry.state != "ready" or not isinstance(entry.handle, SharedMemoryHandle):
            continue
        kept = tuple(
            HeldLease(
                x.lease_id,
                x.ttl,
                x.request_id,
                x.pid,
                create_time=leases.wall(x.granted_at),
                worker=x.worker,
            )
            for x in leases.for_model(entry.name)
            if not x.peer  # a transfer lease is bound to this daemon's seeding peer
        )
        held.append(
            HeldModel(
                name=entry.name,
                path=str(entry.checkpoint.root),
                segment=entry.handle.path,
                size=entry.size,
                files=entry.checkpoint.file_identities(),
                recipe=entry.recipe,
                placement=entry.placement,
                fingerprint=entry.fingerprint,
                load_seconds=entry.load_seconds,
                create_time=entry.create_time,
                leases=kept,
                source=entry.source,
                files_confirmed=entry.files_confirmed,
            )
        )
    return held


def adopt(
    store: Store, leases: LeaseTable, held: HeldModel, arena_of: Callable[[int], Arena]
) -> Entry:
    """Serve a model a predecessor handed over, from its segment, with its leases under
    the same ids. The checkpoint's headers are read again (not its tensors): its files
    must be the very files the predecessor loaded (same identities), its layout must
    need exactly the segment's size, and its fingerprint must be the manifest's
    (recomputed when no file needs reading: levels ``layout``, ``sampled``, and
    ``full`` with every shard's digest in the hash cache; else the components that
    read no file are compared).

    Raises:
        HandOverRefusedError: any of that does not hold.
        WeightCacheError: the checkpoint or the recipe cannot be opened or built.
        OSError: the segment cannot be adopted.
    """
    checkpoint = open_checkpoint(held.path)
    try:
        if checkpoint.file_identities() != held.files:
            raise HandOverRefusedError(f"the files of {held.path} changed since they were loaded")
        pipeline = held.recipe.build(checkpoint, held.placement)
        fp = _adopted_fingerprint(held, checkpoint, pipeline)

        def arena(size: int) -> Arena:
            if size != held.size:
                raise HandOverRefusedError(
                    f"the checkpoint's layout needs {size} bytes; the segment has {held.size}"
                )
            return arena_of(size)

        entry = store.adopt(
            held.name,
            checkpoint,
            held.recipe,
            held.placement,
            pipeline,
            fp,
            arena,
            held.load_seconds,
        )
        entry.source, entry.files_confirmed = held.source, held.files_confirmed
        # What a peer seeding from this daemon is given (seed_serve), when known.
        known = cached_digests(checkpoint) if fp.level == "full" else {}
        if len(known) == len(checkpoint.shards):
            entry.file_sha256 = known
    finally:
        checkpoint.close()
    entry.create_time = held.create_time
    now = time.time()
    for lease in held.leases:
        leases.restore(
            lease.lease_id,
            entry.name,
            lease.ttl,
            lease.request_id,
            lease.pid,
            age=0.0 if lease.create_time is None else now - lease.create_time,
            worker=lease.worker,
        )
    return entry


def _adopted_fingerprint(
    held: HeldModel, checkpoint: Checkpoint, pipeline: Pipeline
) -> Fingerprint:
    level = held.fingerprint.level
    known = cached_digests(checkpoint) if level == "full" else {}
    if level != "full" or len(known) == len(checkpoint.shards):
        fp = compute_fingerprint(checkpoint, pipeline, held.placement, level, file_sha256=known)
        if fp.digest != held.fingerprint.digest:
            raise HandOverRefusedError(f"the fingerprint of {held.path} is not the manifest's")
        return fp
    pending = pending_fingerprint(checkpoint, pipeline, held.placement)
    differing = [
        name
        for name, digest in pending.components.items()
        if held.fingerprint.components.get(name) != digest
    ]
    if differing:
        raise HandOverRefusedError(
            f"the fingerprint of {held.path} differs from the manifest's in {', '.join(differing)}"
        )
    return held.fingerprint
