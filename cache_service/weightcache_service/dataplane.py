"""The data plane of seeding: how a seeding daemon pulls a peer's arena bytes.

One small interface, :class:`DataPlane`, so that another transfer engine (Mooncake's
transfer engine, NIXL) can be added beside the one implemented here,
:class:`GrpcStreamPlane`: ``ReadSeedData`` server-streaming calls over the same
mutual-TLS gRPC channel as ``BeginSeed``, several in parallel over contiguous ranges.

Why not Mooncake's transfer engine today (docs/seeding.md, "Data plane"): over TCP it
authenticates no reader (whoever reaches its port reads a registered region), and on this
machine it was not faster than gRPC streaming.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from weightcache.v1 import weight_cache_service_pb2 as pb

#: Default chunk of one ReadSeedData message, in bytes.
DEFAULT_CHUNK_BYTES = 4 << 20
#: Default number of parallel ReadSeedData streams.
DEFAULT_STREAMS = 4

#: ``write(offset, data)``: put ``data`` at byte ``offset`` of the local arena.
Writer = Callable[[int, memoryview], None]
#: The method's full name (the generated stub's, whose responses are parsed messages).
READ_METHOD = "/weightcache.v1.WeightCacheService/ReadSeedData"


class TransferError(Exception):
    """The transfer failed: the peer died, refused the lease, or sent a bad chunk."""


class DataPlane(Protocol):
    """Moves a byte range of a peer's arena into the local one, under a transfer lease."""

    def pull(self, lease_id: str, size: int, write: Writer, cancelled: Callable[[], bool]) -> None:
        """Pull bytes ``[0, size)`` of the arena the lease names, calling ``write`` for
        each piece (possibly from several threads, never twice for one byte).

        Raises:
            TransferError: the transfer did not complete (``cancelled()`` turned true
                included).
        """


class GrpcStreamPlane:
    """``ReadSeedData`` streams over a gRPC channel.

    Args:
        channel: a channel to the peer (mutual TLS in production).
        streams: parallel streams (contiguous ranges of about ``size / streams`` bytes).
        chunk_bytes: bytes per message asked of the peer (it caps them at 16 MiB).
    """

    def __init__(
        self,
        channel: grpc.Channel,
        streams: int = DEFAULT_STREAMS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
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

    def pull(self, lease_id: str, size: int, write: Writer, cancelled: Callable[[], bool]) -> None:
        """See :meth:`DataPlane.pull`.

        Raises:
            TransferError: a stream failed (its gRPC status is named), a chunk fell
                outside its range, a range ended short, or ``cancelled()``.
        """
        step = -(-size // self.streams)
        step = -(-step // self.chunk_bytes) * self.chunk_bytes  # whole chunks per range
        ranges = [(lo, min(step, size - lo)) for lo in range(0, size, step)]
        errors: list[str] = []
        calls: list[Any] = []
        lock = threading.Lock()

        def one(offset: int, length: int) -> None:
            request = pb.ReadSeedDataRequest(
                lease_id=lease_id, offset=offset, length=length, chunk_bytes=self.chunk_bytes
            )
            cursor = offset
            try:
                call: Any = self._read(request)
                with lock:
                    calls.append(call)
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
                if cursor != offset + length:
                    raise TransferError(f"range ended at {cursor}, not {offset + length}")
            except grpc.RpcError as exc:
                with lock:
                    errors.append(f"ReadSeedData: {exc.code().name}: {exc.details()}")
            except TransferError as exc:
                with lock:
                    errors.append(str(exc))

        threads = [threading.Thread(target=one, args=r, daemon=True) for r in ranges]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if cancelled():
            raise TransferError("cancelled at shutdown")
        real = [e for e in errors if e != "cancelled"] or errors
        if real:
            raise TransferError(real[0])


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
