"""Serving seeds: a peer daemon pulls a READY model's arena from this one (docs/seeding.md).

``BeginSeed`` finds the READY model at level ``full`` whose ``format``, ``layout``,
``recipe`` and ``placement`` components are the caller's, and grants a transfer lease on
it (an ordinary lease of the lease table: ``evict`` waits for it, ``evict --force`` and a
drain revoke it). ``ReadSeedData`` streams ranges of the arena while the lease is live,
renewing it with every chunk; ``EndSeed`` releases it. Who may call them is decided
before (:mod:`.authz`: ``--allow-seeding`` and an authenticated peer).

A transfer lease belongs to the peer identity that began it (``who``: its certificate
names, or the Unix socket): ReadSeedData and EndSeed accept only the caller's own transfer
leases, never a worker's or another peer's (answered as an ended lease). Bounds
(SECURITY.md, "Seeding"): transfer leases per peer and in all
(:data:`.leases.MAX_TRANSFER_LEASES_PER_PEER`, :data:`.leases.MAX_TRANSFER_LEASES`),
their TTL (:data:`MAX_SEED_TTL`), streams at once per peer and in all
(:data:`MAX_STREAMS_PER_PEER`, :data:`MAX_STREAMS`), and a chunk's size
(:data:`MIN_CHUNK_BYTES` to :data:`MAX_CHUNK_BYTES`): what unread streams hold in memory
is at most a few chunks per stream.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

import structlog

from weightcache.core.errors import (
    InvalidArgumentError,
    ModelLoadingError,
    ModelNotFoundError,
    ResourceExhaustedError,
)
from weightcache.core.records import WorkerDescription
from weightcache_service.arena import Arena, Slot
from weightcache_service.cache import WeightCache
from weightcache_service.store import Entry

log = structlog.get_logger("weightcache.daemon")

#: The components that name the model a seeder wants (the rest it cannot know unread).
SEED_COMPONENTS = ("format", "layout", "placement", "recipe")
#: Transfer lease TTL when the request names none, in seconds.
DEFAULT_SEED_TTL = 30.0
#: Longest transfer lease TTL granted, in seconds (a longer request is clamped): a
#: transfer lease a peer stops renewing ends this long after its last chunk.
MAX_SEED_TTL = 60.0
#: Default and largest chunk of a ReadSeedData message, in bytes (a larger request is
#: clamped). gRPC holds about two messages of a stream its peer does not read, so an
#: unread stream costs the daemon at most about ``2 * MAX_CHUNK_BYTES``.
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 4 << 20
#: Smallest chunk a ReadSeedData request may ask (0 asks the default): smaller is
#: INVALID_ARGUMENT (a 1-byte chunk costs a message, a lease check and a renewal per byte).
MIN_CHUNK_BYTES = 64 << 10
#: ReadSeedData streams one peer identity, and all peers together, may have open at once;
#: more is RESOURCE_EXHAUSTED. With :data:`MAX_CHUNK_BYTES`, about 64 MiB held per peer
#: and 256 MiB in all at worst.
MAX_STREAMS_PER_PEER = 8
MAX_STREAMS = 32


class SeedServer:
    """The serving side of seeding, over one daemon's cache.

    Args:
        cache: the daemon's models and leases.
        max_rate: bytes per second one ReadSeedData stream may send (``--seed-max-rate``);
            0: unlimited.
    """

    def __init__(self, cache: WeightCache, max_rate: float = 0.0) -> None:
        self.cache = cache
        self.max_rate = max_rate
        #: Open ReadSeedData streams per peer identity.
        self._streams: Counter[str] = Counter()

    def begin(self, components: dict[str, str], ttl: float, who: str) -> tuple[str, Entry]:
        """Grant a transfer lease on the READY model the ``components`` name.

        Args:
            components: at least :data:`SEED_COMPONENTS`, as the seeder computed them.
            ttl: seconds the lease lives unless renewed (0: :data:`DEFAULT_SEED_TTL`; at
                most :data:`MAX_SEED_TTL`).
            who: the peer's identity: its certificate names, or the Unix socket (kept on
                the lease: only this identity may read through it or end it; logged).

        Returns:
            The lease id and the model's entry.

        Raises:
            InvalidArgumentError: a component of :data:`SEED_COMPONENTS` is missing, or
                this daemon's arenas are not in shared memory.
            ModelLoadingError: the model is still loading.
            ModelNotFoundError: no model with these components is held at level ``full``,
                or it holds no full-level digest of some shard.
            ResourceExhaustedError: this peer, or all peers, hold the most transfer leases
                allowed.
            DrainingError: the daemon is draining.
        """
        self.cache.check_open()
        missing = [n for n in SEED_COMPONENTS if not components.get(n)]
        if missing:
            raise InvalidArgumentError(
                f"BeginSeed needs the components {', '.join(missing)}",
                metadata={"field": "components"},
            )
        if self.cache.backend.name != "cpu_shm":
            raise InvalidArgumentError(
                f"this daemon's arenas are on {self.cache.backend.name}: only shared-memory "
                "arenas are served to seeders",
                metadata={"field": "backend"},
            )
        matches = [
            e
            for e in self.cache.store.entries()
            if e.fingerprint.level == "full"
            and all(e.fingerprint.components.get(n) == components[n] for n in SEED_COMPONENTS)
        ]
        ready = [e for e in matches if e.state == "ready" and e.arena is not None]
        if not ready:
            if any(e.state == "loading" for e in matches):
                raise ModelLoadingError("the model is still loading here; seed once READY")
            raise ModelNotFoundError(
                "no READY model here has this layout, recipe and placement at fingerprint "
                "level full"
            )
        entry = ready[0]
        if set(entry.file_sha256) != {s.name for s in entry.checkpoint.shards}:
            raise ModelNotFoundError(
                f"model {entry.name!r} holds no full-level digest of every shard",
                metadata={"model": entry.name},
            )
        lease = self.cache.leases.grant(
            entry.name,
            min(ttl, MAX_SEED_TTL) if ttl > 0 else DEFAULT_SEED_TTL,
            "",
            0,
            WorkerDescription(hostname=who[:128], label="seed"),
            peer=who,
        )
        log.info("seed begun", model=entry.name, lease=lease.lease_id[:8], peer=who)
        return lease.lease_id, entry

    def entry(self, lease_id: str, who: str) -> Entry:
        """The READY entry a live, unrevoked transfer lease of peer ``who`` holds; renews
        the lease.

        Raises:
            ModelNotFoundError: the lease ended (released, expired, revoked by an evict
                or a drain), is not a transfer lease ``who`` began, or its model is no
                longer READY.
        """
        lease = self.cache.leases.transfer(lease_id, who)
        entry = None
        if lease is not None and not lease.detached and lease.revoke_deadline is None:
            entry = next((e for e in self.cache.store.entries() if e.name == lease.model), None)
        if lease is None or entry is None or entry.state != "ready" or entry.arena is None:
            raise ModelNotFoundError(
                "the transfer lease ended (released, expired, or revoked by an evict or a "
                "drain): begin the seed again"
            )
        self.cache.leases.renew(lease_id, 0)  # session 0: bound to no KeepAlive stream
        return entry

    async def read(
        self, lease_id: str, offset: int, length: int, chunk_bytes: int, who: str
    ) -> AsyncIterator[tuple[int, bytes]]:
        """Yield ``(offset, message)`` per chunk of the leased model's arena over
        ``[offset, offset + length)``: ``message`` is the chunk's ``ReadSeedDataResponse``
        already serialized (:func:`response_bytes`), made with one copy of the arena's
        bytes. Each chunk is copied out on the event loop, between two checks that the
        lease is live, so an evict (which runs on the same loop) never frees the arena
        under a copy.

        Raises:
            ModelNotFoundError: the lease ended before or during the stream, or is not a
                transfer lease ``who`` began.
            InvalidArgumentError: the range is negative or passes the arena's end, or
                ``chunk_bytes`` is below :data:`MIN_CHUNK_BYTES` (0 asks the default).
            ResourceExhaustedError: ``who``, or all peers, have the most streams open.
        """
        entry = self.entry(lease_id, who)
        if offset < 0 or length < 0 or offset + length > entry.size:
            raise InvalidArgumentError(
                f"range [{offset}, {offset + length}) is not within the {entry.size}-byte arena",
                metadata={"field": "offset"},
            )
        if 0 < chunk_bytes < MIN_CHUNK_BYTES or chunk_bytes < 0:
            raise InvalidArgumentError(
                f"chunk_bytes {chunk_bytes} is below the smallest chunk, {MIN_CHUNK_BYTES} "
                "bytes (0 asks the default)",
                metadata={"field": "chunk_bytes"},
            )
        self.open_stream(who)
        try:
            async for item in self._chunks(
                entry, lease_id, offset, length, chunk_bytes=chunk_bytes, who=who
            ):
                yield item
        finally:
            self.close_stream(who)

    def open_stream(self, who: str) -> None:
        """Count a stream of ``who`` (a ReadSeedData call or a data-plane connection).

        Raises:
            ResourceExhaustedError: ``who``, or all peers, have the most streams open.
        """
        if self._streams[who] >= MAX_STREAMS_PER_PEER:
            raise ResourceExhaustedError(
                f"this peer has {MAX_STREAMS_PER_PEER} ReadSeedData streams open already",
                metadata={"field": "streams"},
            )
        if self._streams.total() >= MAX_STREAMS:
            raise ResourceExhaustedError(
                f"the daemon serves {MAX_STREAMS} ReadSeedData streams already; try later",
                metadata={"field": "streams"},
            )
        self._streams[who] += 1

    def close_stream(self, who: str) -> None:
        """Uncount a stream :meth:`open_stream` counted."""
        self._streams[who] -= 1
        if self._streams[who] <= 0:
            del self._streams[who]

    async def _chunks(
        self, entry: Entry, lease_id: str, offset: int, length: int, *, chunk_bytes: int, who: str
    ) -> AsyncIterator[tuple[int, bytes]]:
        """The chunks of :meth:`read`, once its checks passed."""
        chunk = min(chunk_bytes if chunk_bytes > 0 else DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES)
        start = time.monotonic()
        sent = 0
        cursor = offset
        while cursor < offset + length:
            entry = self.entry(lease_id, who)
            arena = entry.arena
            assert arena is not None  # checked by entry()
            n = min(chunk, offset + length - cursor)
            if self.max_rate > 0:
                # Wait until sending this chunk keeps the stream within the rate.
                ahead = (sent + n) / self.max_rate - (time.monotonic() - start)
                if ahead > 0:
                    await asyncio.sleep(ahead)
                entry = self.entry(lease_id, who)  # checked again after the wait
                arena = entry.arena
                assert arena is not None
            yield cursor, response_bytes(arena, cursor, n)
            cursor += n
            sent += n

    def end(self, lease_id: str, who: str) -> None:
        """Release a transfer lease ``who`` began (idempotent); any other lease id (a
        worker's lease, another peer's, an unknown one) is left alone, as an ended one."""
        if self.cache.leases.transfer(lease_id, who) is not None:
            self.cache.release(lease_id)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def response_bytes(arena: Arena, offset: int, length: int) -> bytes:
    """The serialized ``ReadSeedDataResponse`` of ``length`` bytes of ``arena`` from byte
    ``offset`` (field 1 ``offset``, varint; field 2 ``data``), the bytes copied once, out
    of the arena into the message (building the message and serializing it would copy
    them twice more)."""
    header = b"\x08" + _varint(offset) + b"\x12" + _varint(length)
    out: list[bytes] = []
    slot = Slot("seed", "U8", (length,), offset, length)
    arena.read_into(slot, lambda mv: out.append(b"".join((header, mv))))
    return out[0] if out else header
