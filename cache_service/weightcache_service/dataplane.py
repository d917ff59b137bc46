"""The data plane of seeding: how a seeding daemon pulls a peer's arena bytes.

One small interface, :class:`DataPlane`, with two implementations: the sendfile data
plane (:class:`.sendfile_plane.SendfilePlane`, the default: the kernel moves the bytes,
plaintext, authorized per connection) and :class:`GrpcStreamPlane`: ``ReadSeedData``
server-streaming calls over the same mutual-TLS gRPC channel as ``BeginSeed``, several
in parallel over contiguous ranges. Mooncake's transfer engine (``--seed-plane
mooncake``, for RDMA fabrics) is a third, as a :class:`.seed_sources.Reader`
(:class:`.mooncake_plane.MooncakeReader`), registering staging buffers, never an arena.

Why Mooncake's engine is not the default (docs/seeding.md, "Data plane", with the figures
of ``bench/seed_mooncake_ceiling.py``): over TCP it authenticates no peer, listens on
every interface, and lets whoever reaches it read and write a registered region; and
between two network namespaces here it moved a bare 2 GiB buffer at 0.24x to 0.40x of the
link (median), before any hashing and before the staging copies.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc

from weightcache.v1 import weight_cache_service_pb2 as pb

#: Default chunk of one ReadSeedData message, in bytes.
DEFAULT_CHUNK_BYTES = 4 << 20
#: Default number of parallel ReadSeedData streams.
DEFAULT_STREAMS = 4
#: Default progress bound of one stream, in seconds (``--seed-stall-timeout``): a stream
#: must receive a whole chunk (or the rest of its piece) within every such interval, or
#: the seed is abandoned as stalled. A peer that sends nothing, a byte at a time or empty
#: chunks cannot keep a model LOADING longer than this.
DEFAULT_STALL_TIMEOUT = 30.0
#: How often the streams are checked for a stall and for a cancelled seed, in seconds.
WATCH_INTERVAL = 0.1

#: ``write(offset, data)``: put ``data`` at byte ``offset`` of the local arena.
Writer = Callable[[int, memoryview], None]
#: The method's full name (the generated stub's, whose responses are parsed messages).
READ_METHOD = "/weightcache.v1.WeightCacheService/ReadSeedData"


class TransferError(Exception):
    """The transfer failed: the peer died, refused the lease, or sent a bad chunk."""


class StalledError(TransferError):
    """A stream made less progress than the bound (:data:`DEFAULT_STALL_TIMEOUT`)."""


class DataPlane(Protocol):
    """Moves a byte range of a peer's arena into the local one, under a transfer lease."""

    def pull(
        self,
        lease_id: str,
        ranges: Sequence[tuple[int, int]],
        write: Writer,
        cancelled: Callable[[], bool],
        done: Callable[[int], None] = lambda _index: None,
    ) -> None:
        """Pull the ``(offset, length)`` byte ranges of the arena the lease names, calling
        ``write`` for each piece (possibly from several threads, never twice for one
        byte) and ``done(i)`` once range ``i`` has been written whole (the caller may then
        read it, e.g. hash it, while the others arrive).

        Raises:
            TransferError: the transfer did not complete (``cancelled()`` turned true
                included).
        """


class GrpcStreamPlane:
    """``ReadSeedData`` streams over a gRPC channel.

    Args:
        channel: a channel to the peer (mutual TLS in production).
        streams: parallel streams.
        chunk_bytes: bytes per message asked of the peer (it caps them at 4 MiB).
        stall_timeout: seconds within which each stream must receive ``chunk_bytes``
            (or the rest of its piece), again and again, or the pull fails with
            :class:`StalledError`.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        streams: int = DEFAULT_STREAMS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    ) -> None:
        # Responses unparsed: parse_response finds the data in place (no copy), where a
        # parsed message would copy it twice (into the message, out of its field).
        self._read = channel.unary_stream(
            READ_METHOD,
            request_serializer=pb.ReadSeedDataRequest.SerializeToString,
            response_deserializer=None,
        )
        self.streams = max(1, streams)
        self.chunk_bytes = chunk_bytes
        self.stall_timeout = stall_timeout

    def pull(
        self,
        lease_id: str,
        ranges: Sequence[tuple[int, int]],
        write: Writer,
        cancelled: Callable[[], bool],
        done: Callable[[int], None] = lambda _index: None,
    ) -> None:
        """See :meth:`DataPlane.pull`: ``streams`` threads, each calling ReadSeedData for
        one piece after another; a range is cut into pieces of about a ``streams``-th of
        the total (whole chunks), so that few large ranges still use every stream.

        The calling thread watches the streams every :data:`WATCH_INTERVAL`: a stream
        that did not receive ``chunk_bytes`` bytes (or the rest of its piece) within
        ``stall_timeout`` seconds, and every stream once ``cancelled()`` turns true, is
        cancelled at once, whatever the peer sends or withholds.

        Raises:
            StalledError: a stream stalled.
            TransferError: a stream failed (its gRPC status is named), a chunk fell
                outside its piece, a piece ended short, or ``cancelled()``.
        """
        total = sum(length for _offset, length in ranges)
        step = max(-(-total // self.streams), 1)
        step = -(-step // self.chunk_bytes) * self.chunk_bytes  # whole chunks per piece
        pieces: queue.SimpleQueue[tuple[int, int, int]] = queue.SimpleQueue()
        left = []
        for index, (lo, length) in enumerate(ranges):
            cuts = range(lo, lo + length, step)
            left.append(len(cuts))
            for cut in cuts:
                pieces.put((index, cut, min(step, lo + length - cut)))
        for index, count in enumerate(left):
            if count == 0:
                done(index)  # an empty range
        errors: list[str] = []
        stalls: list[str] = []
        # Per stream thread: its call in flight, and when it last completed a chunk's
        # worth of bytes (or began its piece), and the bytes received since.
        active: dict[int, _Progress] = {}
        lock = threading.Lock()

        def worker() -> None:
            while not errors:
                try:
                    index, offset, length = pieces.get_nowait()
                except queue.Empty:
                    return
                if one(offset, length):
                    with lock:
                        left[index] -= 1
                        finished = left[index] == 0
                    if finished:
                        done(index)

        def one(offset: int, length: int) -> bool:
            request = pb.ReadSeedDataRequest(
                lease_id=lease_id, offset=offset, length=length, chunk_bytes=self.chunk_bytes
            )
            cursor = offset
            me = threading.get_ident()
            try:
                call: Any = self._read(request)
                with lock:
                    progress = active[me] = _Progress(call, time.monotonic())
                    if errors or stalls:
                        call.cancel()  # the watcher may have cancelled the others already
                for raw in call:
                    if cancelled() or errors:
                        call.cancel()
                        raise TransferError("cancelled")
                    at, data = parse_response(raw)
                    if at != cursor or cursor + len(data) > offset + length:
                        raise TransferError(
                            f"chunk at {at} ({len(data)} bytes) outside the range "
                            f"expected from {cursor}"
                        )
                    write(cursor, data)
                    cursor += len(data)
                    with lock:
                        progress.advance(len(data), min(self.chunk_bytes, offset + length - cursor))
                if cursor != offset + length:
                    raise TransferError(f"range ended at {cursor}, not {offset + length}")
                return True
            except grpc.RpcError as exc:
                with lock:
                    errors.append(f"ReadSeedData: {exc.code().name}: {exc.details()}")
            except TransferError as exc:
                with lock:
                    errors.append(str(exc))
            finally:
                with lock:
                    active.pop(me, None)
            return False

        def watch() -> None:
            """Cancel every call once ``cancelled()``, a stalled one (and so the rest)."""
            now = time.monotonic()
            with lock:
                if cancelled() and "cancelled" not in errors:
                    errors.append("cancelled")
                for progress in active.values():
                    if now - progress.since > self.stall_timeout and not stalls:
                        stalls.append(
                            f"stalled: a ReadSeedData stream received {progress.got} bytes "
                            f"in {self.stall_timeout:g} s, less than {self.chunk_bytes} "
                            "(--seed-stall-timeout)"
                        )
                        errors.append("cancelled")
                    if errors:
                        progress.call.cancel()

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(self.streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                watch()
                thread.join(WATCH_INTERVAL)
        if cancelled():
            raise TransferError("cancelled at shutdown")
        if stalls:
            raise StalledError(stalls[0])
        real = [e for e in errors if e != "cancelled"] or errors
        if real:
            raise TransferError(real[0])


class GrpcReader:
    """One ReadSeedData stream at a time, one range each: what a seed from several peers
    uses (:class:`.seed_sources.Reader`), with :class:`GrpcStreamPlane`'s stall bound.

    Args:
        channel: a channel to the peer.
        lease_id: the transfer lease.
        write: as :meth:`DataPlane.pull`'s.
        chunk_bytes, stall_timeout: as :class:`GrpcStreamPlane`'s.
        cancelled: turns true when the seed must stop.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        lease_id: str,
        write: Writer,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        self._plane = GrpcStreamPlane(channel, 1, chunk_bytes, stall_timeout)
        self.lease_id = lease_id
        self.write = write
        self.cancelled = cancelled
        self._aborted = False

    def read(self, offset: int, length: int) -> None:
        """Pull ``[offset, offset + length)``.

        Raises:
            StalledError, TransferError: as :meth:`GrpcStreamPlane.pull`; :meth:`abort`
                counts as cancelled.
        """
        self._plane.pull(
            self.lease_id,
            [(offset, length)],
            self.write,
            lambda: self._aborted or self.cancelled(),
        )

    def abort(self) -> None:
        """Make a :meth:`read` in flight fail within :data:`WATCH_INTERVAL`."""
        self._aborted = True

    def close(self) -> None:
        """Nothing to close: each read is its own call on the shared channel."""


class _Progress:
    """One stream's progress: its call, when it last received a whole chunk's worth of
    bytes (or began), and the bytes received since."""

    def __init__(self, call: Any, since: float) -> None:
        self.call = call
        self.since = since
        self.got = 0

    def advance(self, nbytes: int, need: int) -> None:
        """Count ``nbytes`` received; once a chunk's worth (``need``: at most the rest of
        the piece) is in, the interval starts again."""
        self.got += nbytes
        if self.got >= need:
            self.got = 0
            self.since = time.monotonic()


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise TransferError("malformed ReadSeedDataResponse: bad varint")
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def parse_response(raw: bytes) -> tuple[int, memoryview]:
    """A serialized ``ReadSeedDataResponse`` as ``(offset, data)``, ``data`` a view of
    ``raw`` (not copied). Fields in any order; unknown varint and length-delimited
    fields skipped; a repeated field's last value wins, as protobuf parsers do.

    Raises:
        TransferError: the bytes are not such a message.
    """
    view = memoryview(raw)
    offset, data, pos = 0, view[0:0], 0
    while pos < len(raw):
        key, pos = _varint(raw, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(raw, pos)
            if field == 1:
                offset = value
        elif wire == 2:
            size, pos = _varint(raw, pos)
            if pos + size > len(raw):
                raise TransferError("malformed ReadSeedDataResponse: field past the end")
            if field == 2:
                data = view[pos : pos + size]
            pos += size
        else:
            raise TransferError(f"malformed ReadSeedDataResponse: wire type {wire}")
    return offset, data
