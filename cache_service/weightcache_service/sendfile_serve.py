"""The serving side of the sendfile data plane (issue 40): :class:`SendfileServer`, the plain
TCP listener that checks each data connection's hello (single-use secret, the BeginSeed
caller's address, a live transfer lease, ranges within the arena) and ``sendfile(2)``s
the ranges, or, for a hello that asks staging (``--seed-mooncake``), copies them into a
staging ring for Mooncake's transfer engine (:mod:`.mooncake_plane`). The wire format and
the seeding side: :mod:`.sendfile_plane`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import secrets
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO
from urllib.parse import unquote

import structlog

from weightcache.core.errors import InvalidArgumentError, WeightCacheError
from weightcache_service.arena import SharedMemoryArena
from weightcache_service.dataplane import (
    DEFAULT_STALL_TIMEOUT,
)
from weightcache_service.leases import MAX_TRANSFER_LEASES
from weightcache_service.seed_serve import (
    MAX_SEED_TTL,
    MAX_STREAMS_PER_PEER,
    MIN_CHUNK_BYTES,
    SeedServer,
)
from weightcache_service.sendfile_plane import HELLO, KEEP_OPEN, MORE, RANGE, SECRET_BYTES

if TYPE_CHECKING:
    from weightcache_service.mooncake_plane import MooncakeStager, StagingBuffer

#: The hello's count bit that asks staging (:data:`.mooncake_plane.STAGE`; the same value,
#: kept here so that this module imports nothing of Mooncake's plane unless it is used).
STAGE = 1 << 30

log = structlog.get_logger("weightcache.daemon")

#: Seconds a data connection has to send its whole hello.
HELLO_TIMEOUT = 5.0
#: Most ranges one hello may name.
MAX_RANGES = 4096
#: Data connections at once that have not yet sent a valid hello; more are closed at once.
MAX_PENDING = 32
#: The same, from one IP address: one address cannot hold every pending place.
MAX_PENDING_PER_ADDRESS = 8
#: Secrets outstanding at once (those of every transfer lease a daemon may hold); beyond,
#: the oldest are dropped (a peer that begins and ends seeds in a loop grows nothing).
MAX_GRANTS = MAX_TRANSFER_LEASES * MAX_STREAMS_PER_PEER
#: Bytes sent between two checks (and renewals) of the transfer lease.
SEND_CHUNK = 8 << 20
#: Seconds one :data:`SEND_CHUNK` may take to leave (the seeder reads nothing: stalled).
SEND_STALL_TIMEOUT = DEFAULT_STALL_TIMEOUT
#: Seconds a data connection may wait, its ranges sent, for the seeder's next batch (a
#: seeder from several peers keeps its connections while another peer's piece is in
#: flight); it holds one of its peer's streams meanwhile.
MORE_TIMEOUT = MAX_SEED_TTL
#: Bytes one data connection may carry in all, in arenas: a connection pulls part of an
#: arena, and may pull a shard again after another peer lied about it.
MAX_CONNECTION_BYTES = 2


@dataclass(frozen=True)
class _Grant:
    lease_id: str
    who: str
    address: str
    expires: float


def peer_address(grpc_peer: str) -> str:
    """The IP address in a gRPC peer string (``ipv4:10.0.0.2:5000``,
    ``ipv6:%5B::1%5D:5000``); empty for others (a Unix socket)."""
    kind, _, rest = unquote(grpc_peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    return plain_address(rest.rpartition(":")[0].strip("[]"))


def plain_address(address: str) -> str:
    """``address`` with an IPv4-mapped IPv6 address (``::ffff:10.0.0.2``, what a
    dual-stack socket reports for an IPv4 peer) written as the IPv4 address it maps, so
    that gRPC's view of a peer and the data connection's compare equal."""
    with contextlib.suppress(ValueError):
        mapped = ipaddress.IPv6Address(address).ipv4_mapped
        if mapped is not None:
            return str(mapped)
    return address


def _listening_socket(host: str, port: int) -> socket.socket | None:
    """A dual-stack socket bound to ``[::]:port`` when ``host`` is IPv6's unspecified
    address, as gRPC's ``--listen [::]:P`` takes IPv4 peers too (asyncio's own
    ``start_server`` makes an IPv6 socket IPv6-only); None for any other host."""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host) == ipaddress.IPv6Address("::"):
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind(("::", port))
            except OSError:
                sock.close()
                raise
            return sock
    return None


class SendfileServer:
    """The serving side: a plain TCP listener on the ``--listen`` host.

    Args:
        seeds: the daemon's seeding service (its leases and stream counts are shared).
        host: the address to bind (``--listen``'s host).
        port: the port (``--seed-data-port``; 0: any free one, logged and answered in
            BeginSeed).
        stager: stages ranges for Mooncake's transfer engine (``--seed-mooncake``); None:
            a staging hello is answered :data:`.mooncake_plane.NOT_OFFERED`.
    """

    def __init__(
        self, seeds: SeedServer, host: str, port: int = 0, stager: MooncakeStager | None = None
    ) -> None:
        self.seeds = seeds
        self.host = host
        self.port = port
        self.stager = stager
        self._grants: dict[bytes, _Grant] = {}
        self._pending = 0
        #: Connections awaiting their hello, per peer address.
        self._pending_from: dict[str, int] = {}
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> int:
        """Bind and listen; returns the port bound.

        Raises:
            OSError: the address cannot be bound.
        """
        sock = _listening_socket(self.host, self.port)
        if sock is not None:
            self._server = await asyncio.start_server(self._serve, sock=sock)
        else:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Stop listening and cut every data connection (a drain, a shutdown)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()

    def grant(self, lease_id: str, who: str, address: str, count: int) -> list[bytes]:
        """``count`` single-use secrets (at most :data:`.seed_serve.MAX_STREAMS_PER_PEER`)
        for data connections of transfer lease ``lease_id`` of peer ``who`` from IP
        ``address`` (empty: not bound to an address, a Unix-socket caller)."""
        now = time.monotonic()
        for key in [k for k, g in self._grants.items() if g.expires < now]:
            del self._grants[key]
        out = []
        for _ in range(max(0, min(count, MAX_STREAMS_PER_PEER))):
            secret = secrets.token_bytes(SECRET_BYTES)
            digest = hashlib.sha256(secret).digest()
            self._grants[digest] = _Grant(lease_id, who, address, now + MAX_SEED_TTL)
            out.append(secret)
        while len(self._grants) > MAX_GRANTS:
            del self._grants[next(iter(self._grants))]  # the oldest (insertion order)
        return out

    def forget(self, lease_id: str, who: str) -> None:
        """Drop the unused secrets of transfer lease ``lease_id`` that peer ``who`` was
        granted (its EndSeed; another peer's are left alone): a peer that begins and ends
        seeds in a loop pushes no other peer's secrets out."""
        for key in [k for k, g in self._grants.items() if (g.lease_id, g.who) == (lease_id, who)]:
            del self._grants[key]

    def _redeem(self, secret: bytes, address: str) -> _Grant | None:
        """The grant of ``secret``, removed (single use); None if none, expired, or asked
        from another address. Looked up by its sha256, so the lookup's time says nothing
        of the secret's bytes."""
        grant = self._grants.pop(hashlib.sha256(secret).digest(), None)
        if grant is None or grant.expires < time.monotonic():
            return None
        if grant.address and not hmac.compare_digest(grant.address, address):
            return None
        return grant

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        address = plain_address(str(writer.get_extra_info("peername", ("",))[0]))
        try:
            if self._pending >= MAX_PENDING or self._pending_from.get(address, 0) >= (
                MAX_PENDING_PER_ADDRESS
            ):
                log.warning("seed data connection refused", peer=address, why="too many pending")
                return
            self._pending += 1
            self._pending_from[address] = self._pending_from.get(address, 0) + 1
            try:
                hello = await asyncio.wait_for(self._hello(reader), HELLO_TIMEOUT)
            except (TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                why = "no hello in time" if isinstance(exc, TimeoutError) else "a bad hello"
                log.warning("seed data connection refused", peer=address, why=why)
                return
            finally:
                self._pending -= 1
                if (left := self._pending_from.pop(address) - 1) > 0:
                    self._pending_from[address] = left
            secret, ranges, keep, stage = hello
            grant = self._redeem(secret, address)
            if grant is None:
                log.warning("seed data connection refused", peer=address, why="no valid secret")
                return
            if stage:
                await self._stage(grant, ranges, reader, writer)
            else:
                await self._send(grant, ranges, reader, writer, keep=keep)
        except WeightCacheError as err:
            log.warning("seed data connection refused", peer=address, why=err.detail)
        except (OSError, TimeoutError, RuntimeError, ImportError, EOFError) as exc:
            # RuntimeError: asyncio's sendfile on a transport the seeder reset meanwhile
            # ("Transport is closing"); EOFError: asyncio.IncompleteReadError, a seeder
            # gone in the middle of a batch's header.
            log.warning("seed data connection ended", peer=address, why=str(exc) or "stalled")
        finally:
            self._writers.discard(writer)
            writer.close()  # whatever happened: no byte more

    @staticmethod
    async def _hello(
        reader: asyncio.StreamReader,
    ) -> tuple[bytes, list[tuple[int, int]], bool, bool]:
        """The secret, the ranges, whether the seeder keeps the connection open, and
        whether it asks staging (:data:`STAGE`, with :data:`.sendfile_plane.KEEP_OPEN`)."""
        secret, count = HELLO.unpack(await reader.readexactly(HELLO.size))
        keep, stage = bool(count & KEEP_OPEN), bool(count & STAGE)
        count &= ~(KEEP_OPEN | STAGE)
        if not 0 < count <= MAX_RANGES or (stage and not keep):
            raise ValueError(f"{count} ranges")
        raw = await reader.readexactly(count * RANGE.size)
        ranges = [RANGE.unpack_from(raw, i * RANGE.size) for i in range(count)]
        return secret, ranges, keep, stage

    async def _send(
        self,
        grant: _Grant,
        ranges: list[tuple[int, int]],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        keep: bool = False,
    ) -> None:
        """Check the ranges and the stream bounds, then sendfile every range; with
        ``keep`` (:data:`.sendfile_plane.KEEP_OPEN` in the hello), serve the next batch
        of ranges the seeder asks on this connection (:data:`.sendfile_plane.MORE`) until
        it asks none or hangs up.

        Raises:
            ModelNotFoundError: the lease ended.
            InvalidArgumentError: a range passes the arena, or all of them on this
                connection :data:`MAX_CONNECTION_BYTES` arenas.
            ResourceExhaustedError: the peer, or all peers, have the most streams open.
            OSError, TimeoutError: the connection failed or stalled, or no next batch
                came within :data:`MORE_TIMEOUT` seconds.
        """
        seeds, who = self.seeds, grant.who
        entry = seeds.entry(grant.lease_id, who)
        seeds.open_stream(who)
        try:
            arena = entry.arena
            assert isinstance(arena, SharedMemoryArena)  # entry() and begin() checked it
            with arena.reader() as file:  # its own descriptor: an evict cannot close it
                total, count = 0, 0
                while ranges:
                    total += sum(n for _, n in ranges)
                    count += len(ranges)
                    if (
                        any(o + n > entry.size for o, n in ranges)
                        or total > MAX_CONNECTION_BYTES * entry.size
                        or count > _max_ranges(entry.size)
                    ):
                        raise InvalidArgumentError(
                            f"the ranges asked pass the {entry.size}-byte arena, or "
                            f"{MAX_CONNECTION_BYTES} times its size or "
                            f"{_max_ranges(entry.size)} ranges on one connection"
                        )
                    early = await self._ranges(grant, ranges, file, reader, writer)
                    if early is None or not keep:
                        return
                    ranges = await asyncio.wait_for(self._more(reader, early), MORE_TIMEOUT)
                    seeds.entry(grant.lease_id, who)  # still live
        finally:
            seeds.close_stream(who)

    async def _stage(
        self,
        grant: _Grant,
        ranges: list[tuple[int, int]],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Answer a staging hello (:mod:`.mooncake_plane`): not offered, or the engine's
        session id; then stage every range asked into the connection's ring, in order,
        answering each slot, batch after batch, until the seeder asks none or hangs up.
        The ring is released (unregistered) when the connection ends.

        Raises:
            ModelNotFoundError: the lease ended.
            InvalidArgumentError: a range is empty or passes the arena or a slot, or
                the ranges on this connection pass :data:`MAX_CONNECTION_BYTES` arenas or
                :data:`MAX_RANGES` plus one per slot of those bytes.
            ResourceExhaustedError: the peer, or all peers, have the most streams open.
            ImportError, OSError, TimeoutError: the engine could not be used, the
                connection failed, or no next batch came within :data:`MORE_TIMEOUT`.
        """
        from weightcache_service import mooncake_plane as mp  # only when the plane is asked

        if self.stager is None:
            writer.write(mp.ENGINE.pack(mp.NOT_OFFERED, 0))
            await writer.drain()
            log.warning("seed data connection refused", peer=grant.who, why=mp.NOT_OFFERED_WHY)
            return
        seeds, who = self.seeds, grant.who
        entry = seeds.entry(grant.lease_id, who)
        seeds.open_stream(who)
        ring: StagingBuffer | None = None
        try:
            arena = entry.arena
            assert isinstance(arena, SharedMemoryArena)  # entry() and begin() checked it
            host = plain_address(str(writer.get_extra_info("sockname")[0]))
            session, ring = await self.stager.ring(host)
            writer.write(mp.ENGINE.pack(mp.OFFERED, len(session)) + session.encode("ascii"))
            with arena.reader() as file:  # its own descriptor: an evict cannot close it
                total, served = 0, 0
                # As many ranges as the sendfile plane takes, plus one per slot's worth of
                # the bytes it takes: a seeder cuts each piece into slots.
                most = MAX_RANGES + MAX_CONNECTION_BYTES * -(-entry.size // mp.SLOT_BYTES)
                while ranges:
                    total += sum(n for _, n in ranges)
                    if (
                        any(o + n > entry.size or not 0 < n <= mp.SLOT_BYTES for o, n in ranges)
                        or total > MAX_CONNECTION_BYTES * entry.size
                        or served + len(ranges) > most
                    ):
                        raise InvalidArgumentError(
                            f"the ranges asked pass the {entry.size}-byte arena, are empty "
                            f"or pass a {mp.SLOT_BYTES}-byte staging slot, or pass "
                            f"{MAX_CONNECTION_BYTES} times the arena or {most} ranges on "
                            "one connection"
                        )
                    for offset, length in ranges:
                        seeds.entry(grant.lease_id, who)  # live, renewed
                        at = await self.stager.stage(ring, served, file.fileno(), offset, length)
                        served += 1
                        writer.write(mp.STAGED.pack(at, length))
                    await asyncio.wait_for(writer.drain(), SEND_STALL_TIMEOUT)
                    ranges = await asyncio.wait_for(self._more(reader, b""), MORE_TIMEOUT)
        finally:
            seeds.close_stream(who)
            if ring is not None:
                ring.release()

    @staticmethod
    async def _more(reader: asyncio.StreamReader, early: bytes) -> list[tuple[int, int]]:
        """The next batch of ranges (``early``: its first bytes, read already); none when
        the seeder hung up or asked none."""
        head = early or await reader.read(1)
        if head:
            head += await reader.readexactly(MORE.size - len(head))
        if not head:
            return []
        (count,) = MORE.unpack(head)
        if count > MAX_RANGES:
            raise InvalidArgumentError(f"{count} ranges in one batch")
        raw = await reader.readexactly(count * RANGE.size)
        return [RANGE.unpack_from(raw, i * RANGE.size) for i in range(count)]

    async def _ranges(
        self,
        grant: _Grant,
        ranges: list[tuple[int, int]],
        file: BinaryIO,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bytes | None:
        """Send ``ranges``; the first bytes of the seeder's next batch if it sent any
        once they were all out (b"" if not yet), None if it hung up or sent bytes before
        (the connection ends)."""
        loop = asyncio.get_running_loop()
        rate = self.seeds.max_rate
        # Throttled: chunks of a quarter-second's worth, so the stream is even.
        chunk = SEND_CHUNK if rate <= 0 else min(SEND_CHUNK, max(MIN_CHUNK_BYTES, int(rate / 4)))
        closed = asyncio.ensure_future(reader.read(1))  # the seeder hung up (or misbehaved)
        start, sent = time.monotonic(), 0
        try:
            for offset, length in ranges:
                cursor = offset
                while cursor < offset + length:
                    n = min(chunk, offset + length - cursor)
                    if rate > 0:
                        ahead = (sent + n) / rate - (time.monotonic() - start)
                        if ahead > 0:
                            await asyncio.wait({closed}, timeout=ahead)
                    if closed.done():
                        return None
                    self.seeds.entry(grant.lease_id, grant.who)  # live, renewed
                    await asyncio.wait_for(
                        loop.sendfile(writer.transport, file, cursor, n, fallback=False),
                        SEND_STALL_TIMEOUT,
                    )
                    cursor += n
                    sent += n
            await writer.drain()
            if closed.done():  # the seeder had all the bytes, and asks more (or hung up)
                return closed.result() or None
            return b""
        finally:
            closed.cancel()


def _max_ranges(size: int) -> int:
    """How many ranges one connection may ask of a ``size``-byte arena in all:
    :data:`MAX_RANGES`, and one more per MiB of the bytes it may ask (a kept connection
    of a seed from several peers asks a range per piece, 1 to 16 MiB each, so a fixed
    count would stop an honest one on a large arena)."""
    return MAX_RANGES + (MAX_CONNECTION_BYTES * size) // (1 << 20)
