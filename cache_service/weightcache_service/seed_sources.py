"""Seeding from several peers at once (issue 40, Build 2): which peer pulls which bytes.

:class:`Swarm` fills one arena from several *sources* (peers that answered BeginSeed with
this daemon's own plan), each with a few connections (:class:`Source`). The arena's shard
ranges are cut into pieces of at most :data:`PIECE_BYTES` (so that every connection of
every peer has work) and dealt round-robin into one queue per source, in arena order:
source ``i`` gets piece ``i`` first. Each connection takes the next piece of its own
source's queue; when that is empty it takes a piece left by a failed source, else steals
the last piece of the source with the longest queue, provided that one keeps at least one
(so a slow peer ends with less work, never with none, and the first piece of each peer is
its own). A shard is hashed (``verify``) as soon as its last piece lands.

Faults, each bounded:

- A connection that fails or stalls (:class:`~.dataplane.TransferError`, the plane's own
  ``--seed-stall-timeout`` bound) drops its source: the source's queue and its pieces in
  flight go to the others. Its pieces already landed stay (they are verified by content).
- A shard whose sha256 is not the digest: if one source supplied it, that source lied and
  is dropped (no more work); the shard is pulled again, whole, by one connection of another
  source (a *bundle*, so that a second failure names one source). A shard pulled again more
  than once per source fails the seed.
- When every source is dropped with work left, or the seed is cancelled, :meth:`Swarm.run`
  raises; the seeder then loads the files (:mod:`.seeding`).

Bounds: connections per source are what the peer granted (at most
:data:`.seed_serve.MAX_STREAMS_PER_PEER`); bytes in flight per connection are one piece
(:data:`PIECE_BYTES`), written in place into the arena, never buffered.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from weightcache_service.dataplane import WATCH_INTERVAL, StalledError, TransferError

log = structlog.get_logger("weightcache.daemon")

#: Largest piece, in bytes: what one connection pulls at a time, and so the most a slow
#: peer holds up at the end, and the most pulled again after a connection fails.
PIECE_BYTES = 16 << 20
#: Smallest piece, in bytes (a shard smaller is one piece).
MIN_PIECE_BYTES = 1 << 20
#: Pieces per data connection, about, when they are not at their bounds: enough that a
#: slow peer's queue can be stolen from while it works on its first.
PIECES_PER_CONNECTION = 4
#: Hashing threads (each hashes one whole shard).
HASHERS = 2


class Reader(Protocol):
    """One connection to a peer's data plane."""

    def read(self, offset: int, length: int) -> None:
        """Put the peer's arena bytes ``[offset, offset + length)`` at the same place of
        the local arena.

        Raises:
            StalledError: less than a chunk arrived within the stall bound.
            TransferError: the connection failed or was closed early, or the seed was
                cancelled.
        """

    def abort(self) -> None:
        """Make a :meth:`read` in flight (from another thread) fail soon (its source was
        dropped)."""

    def close(self) -> None:
        """Close the connection (idempotent)."""


class Source(Protocol):
    """One peer that holds the model as this daemon plans it.

    Attributes:
        name: how logs and the report name it (``HOST:PORT``).
        connections: how many :class:`Reader` it may open at once.
    """

    name: str
    connections: int

    def open(self, k: int) -> Reader:
        """Open connection ``k`` (``0 <= k < connections``; each at most once).

        Raises:
            TransferError: it cannot be opened.
        """


@dataclass(frozen=True)
class Piece:
    """``length`` bytes at ``offset`` of the arena, part of shard ``shard``."""

    shard: int
    offset: int
    length: int


@dataclass
class SwarmReport:
    """What each source did.

    Attributes:
        pieces: per source, the pieces it supplied that were verified.
        dropped: per source dropped, ``(result, why)``: ``transfer``, ``stalled``,
            ``mismatch``.
    """

    pieces: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, tuple[str, str]] = field(default_factory=dict)


class SwarmFailedError(Exception):
    """No source could finish: ``result`` (``transfer``, ``stalled``, ``mismatch``,
    ``cancelled``) and ``why``."""

    def __init__(self, result: str, why: str) -> None:
        super().__init__(f"{result}: {why}")
        self.result = result
        self.why = why


def pieces_of(ranges: Sequence[tuple[int, int]], connections: int) -> list[Piece]:
    """The shard ranges ``(offset, length)`` cut into pieces, in arena order: about
    :data:`PIECES_PER_CONNECTION` per connection in all, each between
    :data:`MIN_PIECE_BYTES` (1 MiB multiples) and :data:`PIECE_BYTES`, never across two
    shards."""
    total = sum(n for _, n in ranges)
    step = -(-total // max(1, PIECES_PER_CONNECTION * connections))
    step = -(-step // MIN_PIECE_BYTES) * MIN_PIECE_BYTES
    step = min(max(step, MIN_PIECE_BYTES), PIECE_BYTES)
    out = []
    for shard, (offset, length) in enumerate(ranges):
        for cut in range(offset, offset + length, step):
            out.append(Piece(shard, cut, min(step, offset + length - cut)))
    return out


class Swarm:
    """Pulls shard ranges from several sources at once (see the module's docstring).

    Args:
        sources: the agreeing peers, in ``--seed-from`` order.
        ranges: per shard, its arena range ``(offset, length)``.
        names: per shard, its file name (for the logs).
        verify: ``verify(shard)``: whether the local arena's bytes of that shard are the
            digest's (called from hashing threads, once all its pieces landed).
        cancelled: turns true when the seed must stop (a shutdown).
        landed: called with each piece's byte count as it lands (progress).
    """

    def __init__(
        self,
        sources: Sequence[Source],
        ranges: Sequence[tuple[int, int]],
        names: Sequence[str],
        *,
        verify: Callable[[int], bool],
        cancelled: Callable[[], bool],
        landed: Callable[[int], None] = lambda _n: None,
    ) -> None:
        self.sources = list(sources)
        self.ranges = list(ranges)
        self.names = list(names)
        self.verify = verify
        self.cancelled = cancelled
        self.landed = landed
        self.report = SwarmReport()
        self._cond = threading.Condition()
        pieces = pieces_of(ranges, sum(s.connections for s in self.sources))
        #: Per source, its own queue of bundles (a bundle: pieces one connection pulls
        #: in turn); ``orphans``: those of dropped sources and re-pulled shards.
        self._queues: dict[str, collections.deque[list[Piece]]] = {
            s.name: collections.deque() for s in self.sources
        }
        for i, piece in enumerate(pieces):
            self._queues[self.sources[i % len(self.sources)].name].append([piece])
        self._orphans: collections.deque[list[Piece]] = collections.deque()
        self._missing = [0] * len(self.ranges)  # pieces of each shard not landed yet
        for piece in pieces:
            self._missing[piece.shard] += 1
        self._pieces = {i: [p for p in pieces if p.shard == i] for i in range(len(self.ranges))}
        self._by: dict[int, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )  # per shard, the pieces each source supplied
        self._flight: dict[tuple[str, int], list[Piece]] = {}  # per connection, its bundle
        self._readers: dict[tuple[str, int], Reader] = {}
        self._attempts = [0] * len(self.ranges)
        self._verified = 0
        self._workers = 0
        self._failed: SwarmFailedError | None = None
        self._hashers = ThreadPoolExecutor(max_workers=HASHERS)

    def run(self) -> SwarmReport:
        """Pull and verify every shard.

        Raises:
            SwarmFailedError: every source was dropped with work left (``result``: the
                last drop's), a shard failed its digest more than once per source
                (``mismatch``), or ``cancelled()`` (``cancelled``).
        """
        for i, count in enumerate(self._missing):
            if count == 0:
                self._hashers.submit(self._check, i)  # an empty shard: its header alone
        threads = [
            threading.Thread(target=self._worker, args=(s, k), daemon=True)
            for s in self.sources
            for k in range(s.connections)
        ]
        self._workers = len(threads)
        started: list[threading.Thread] = []
        try:
            for thread in threads:
                thread.start()  # may raise (a pids limit): the started ones are joined
                started.append(thread)
            with self._cond:
                while not self._over():
                    self._cond.wait(WATCH_INTERVAL)
                    if self.cancelled() and self._failed is None:
                        self._failed = SwarmFailedError("cancelled", "cancelled at shutdown")
                        self._cond.notify_all()
                if self._failed is not None:
                    for reader in self._readers.values():
                        reader.abort()  # no read runs on past its piece
        except BaseException:
            with self._cond:
                self._failed = self._failed or SwarmFailedError("transfer", "seed aborted")
                self._workers -= len(threads) - len(started)
                for reader in self._readers.values():
                    reader.abort()
                self._cond.notify_all()
            raise
        finally:
            for thread in started:
                thread.join()
            self._hashers.shutdown(wait=True, cancel_futures=True)
        if self._failed is not None:
            raise self._failed
        return self.report

    def _over(self) -> bool:
        return self._failed is not None or self._verified == len(self.ranges)

    # -- a connection ------------------------------------------------------------------

    def _worker(self, source: Source, k: int) -> None:
        reader: Reader | None = None
        try:
            while (bundle := self._take(source, k)) is not None:
                try:
                    if reader is None:
                        reader = self._open(source, k)
                        if reader is None:
                            return  # its bundle went back; the source's others go on
                    for piece in bundle:
                        reader.read(piece.offset, piece.length)
                        if not self._land(source, k, piece):
                            return
                except TransferError as exc:
                    result = "stalled" if isinstance(exc, StalledError) else "transfer"
                    self._drop(source, result, str(exc), k)
                    return
                except Exception as exc:
                    # A fault that is not the transfer's (a malformed answer, a write into
                    # the arena) must still drop the source: a worker that died without it
                    # would strand the source's last piece and hang the others in _take.
                    self._drop(source, "transfer", repr(exc), k)
                    return
        finally:
            if reader is not None:
                reader.close()
            self._exit(source, k)

    def _open(self, source: Source, k: int) -> Reader | None:
        """Connection ``k`` of ``source``, or None when it cannot be opened while another
        of the source's is (a secret left unused too long): its bundle is given back.

        Raises:
            TransferError: it cannot be opened, and no other connection of the source is.
        """
        try:
            reader = source.open(k)
        except TransferError:
            with self._cond:
                if any(key[0] == source.name for key in self._readers):
                    self._requeue(source, k)
                    return None
            raise
        with self._cond:
            self._readers[(source.name, k)] = reader
            if source.name in self.report.dropped:
                reader.abort()
        return reader

    def _exit(self, source: Source, k: int) -> None:
        """A connection is done: if it was the last with work left, the swarm fails."""
        with self._cond:
            self._readers.pop((source.name, k), None)
            self._requeue(source, k)
            self._workers -= 1
            if self._workers == 0 and not self._over():
                name, (result, why) = next(
                    reversed(self.report.dropped.items()),
                    (source.name, ("transfer", "no data connection could be opened")),
                )
                self._failed = SwarmFailedError(result, f"from {name}: {why}")
            self._cond.notify_all()

    def _take(self, source: Source, k: int) -> list[Piece] | None:
        """The next bundle for connection ``k`` of ``source``, waiting while there is
        none yet; None when this connection is done (all verified, failed, or its source
        dropped)."""
        with self._cond:
            while True:
                if self._over() or source.name in self.report.dropped:
                    return None
                bundle = self._next(source)
                if bundle is not None:
                    self._flight[(source.name, k)] = list(bundle)
                    return bundle
                self._cond.wait(WATCH_INTERVAL)

    def _next(self, source: Source) -> list[Piece] | None:
        own = self._queues[source.name]
        if own:
            return own.popleft()
        if self._orphans:
            return self._orphans.popleft()
        victims = [q for name, q in self._queues.items() if name != source.name and len(q) > 1]
        if victims:
            return max(victims, key=len).pop()  # the far end: the victim's own order holds
        return None

    def _land(self, source: Source, k: int, piece: Piece) -> bool:
        """Count ``piece`` landed; False (and the connection's bundle queued for the
        others, this piece included) when its source was dropped meanwhile."""
        with self._cond:
            if source.name in self.report.dropped:
                self._requeue(source, k)
                return False
            self._flight[(source.name, k)].remove(piece)
            self._by[piece.shard][source.name] += 1
            self._missing[piece.shard] -= 1
            whole = self._missing[piece.shard] == 0
        self.landed(piece.length)
        log.debug("seed piece", peer=source.name, offset=piece.offset, bytes=piece.length)
        if whole:
            self._hashers.submit(self._check, piece.shard)
        return True

    # -- faults ------------------------------------------------------------------------

    def _requeue(self, source: Source, k: int) -> None:
        if left := self._flight.pop((source.name, k), None):
            self._orphans.append(left)
        self._cond.notify_all()

    def _drop(self, source: Source, result: str, why: str, k: int | None = None) -> None:
        """Give no more work to ``source``: its queue goes to the others, and so does the
        bundle of its connection ``k`` (a failed one); its other connections are aborted
        and give theirs back as their reads return. Fail the swarm if no source is left."""
        with self._cond:
            if source.name not in self.report.dropped:
                self.report.dropped[source.name] = (result, why)
                log.warning("seed peer dropped", peer=source.name, result=result, why=why)
                for key, reader in self._readers.items():
                    if key[0] == source.name and key[1] != k:
                        reader.abort()
            queue = self._queues[source.name]
            self._orphans.extend(queue)
            queue.clear()
            if k is not None:
                self._requeue(source, k)
            live = [s for s in self.sources if s.name not in self.report.dropped]
            if not live and self._failed is None and self._verified < len(self.ranges):
                self._failed = SwarmFailedError(result, f"from {source.name}: {why}")
            self._cond.notify_all()

    def _check(self, shard: int) -> None:
        """Hash ``shard``; on a mismatch, drop the source that supplied it alone, and
        queue the shard again as one bundle."""
        try:
            ok = self.verify(shard)
        except Exception as exc:  # a hashing thread must report, not vanish
            with self._cond:
                if self._failed is None:
                    self._failed = SwarmFailedError(
                        "transfer", f"hashing shard {self.names[shard]}: {exc!r}"
                    )
                self._cond.notify_all()
            return
        with self._cond:
            by = self._by.pop(shard, collections.Counter())
            if ok:
                for name, count in by.items():
                    self.report.pieces[name] = self.report.pieces.get(name, 0) + count
                self._verified += 1
                self._cond.notify_all()
                return
            self._attempts[shard] += 1
            if len(by) == 1:
                [name] = by
                liar = next(s for s in self.sources if s.name == name)
                why = f"shard {self.names[shard]}: the bytes it sent fail the shard's sha256"
                self._drop(liar, "mismatch", why)  # first: the liar takes no re-pull
            if self._attempts[shard] > len(self.sources) and self._failed is None:
                self._failed = SwarmFailedError(
                    "mismatch",
                    f"shard {self.names[shard]} failed its sha256 {self._attempts[shard]} times",
                )
            self._missing[shard] = len(self._pieces[shard])
            self._orphans.appendleft(list(self._pieces[shard]))
            self._cond.notify_all()
