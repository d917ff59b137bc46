"""The sendfile data plane of seeding: the kernel moves the arena's bytes (issue 40).

The mutual-TLS gRPC channel stays the control plane: ``BeginSeed`` (asked with
``data_connections``) grants a transfer lease and, where this daemon offers the plane
(``--seed-plane tcp``, the default), answers ``data_port`` and one secret per connection
(:meth:`SendfileServer.grant`). The seeder then opens plain TCP connections to that port;
each one sends, within :data:`HELLO_TIMEOUT` seconds, a hello::

    secret (32 bytes) | count (uint32, big-endian) | count x (offset, length) (uint64 each)

and the server ``sendfile(2)``s those ranges of the arena's ``/dev/shm`` segment, back to
back, in order, then closes. A secret works once (single use), only from the address that
called BeginSeed, only while its transfer lease lives, and only for ranges within the
leased arena whose total is at most its size; otherwise the connection is closed before
any byte. The seeder ``recv_into``s its own (populated) arena mapping and hashes each
shard as its range completes, as over gRPC (:mod:`.seeding`).

What it protects: who gets the bytes (the secret comes over mutual TLS, bound to the
lease and the peer's address) and, with the seeder's sha256 check, what is made READY.
What it does not: confidentiality on the wire (plaintext TCP): ``--seed-plane grpc`` keeps
every byte inside TLS (SECURITY.md, "Seeding").

Bounds: connections awaiting their hello (:data:`MAX_PENDING`), streams per peer and in
all (shared with ReadSeedData: :data:`.seed_serve.MAX_STREAMS_PER_PEER`,
:data:`.seed_serve.MAX_STREAMS`), a send that makes no progress for
:data:`SEND_STALL_TIMEOUT` seconds, and the lease checked (and renewed) before every
:data:`SEND_CHUNK` bytes, so an evict or a drain ends a transfer within one chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import unquote

import structlog

from weightcache.core.errors import InvalidArgumentError, WeightCacheError
from weightcache_service.arena import SharedMemoryArena
from weightcache_service.dataplane import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_STALL_TIMEOUT,
    WATCH_INTERVAL,
    StalledError,
    TransferError,
    Writer,
)
from weightcache_service.leases import MAX_TRANSFER_LEASES
from weightcache_service.seed_serve import (
    MAX_SEED_TTL,
    MAX_STREAMS_PER_PEER,
    MIN_CHUNK_BYTES,
    SeedServer,
)

log = structlog.get_logger("weightcache.daemon")

#: Bytes of one secret (``secrets.token_bytes``).
SECRET_BYTES = 32
#: Seconds a data connection has to send its whole hello.
HELLO_TIMEOUT = 5.0
#: Most ranges one hello may name.
MAXRANGES = 4096
#: Data connections at once that have not yet sent a valid hello; more are closed at once.
MAX_PENDING = 32
#: Secrets outstanding at once (those of every transfer lease a daemon may hold); beyond,
#: the oldest are dropped (a peer that begins and ends seeds in a loop grows nothing).
MAX_GRANTS = MAX_TRANSFER_LEASES * MAX_STREAMS_PER_PEER
#: Bytes sent between two checks (and renewals) of the transfer lease.
SEND_CHUNK = 8 << 20
#: Seconds one :data:`SEND_CHUNK` may take to leave (the seeder reads nothing: stalled).
SEND_STALL_TIMEOUT = DEFAULT_STALL_TIMEOUT
#: Seconds the seeder waits for the TCP connection.
CONNECT_TIMEOUT = 10.0

#: A data connection's hello: the secret and the count of ranges that follow.
HELLO = struct.Struct(">32sI")
#: One range of the hello: offset and length in bytes, from the arena's start.
RANGE = struct.Struct(">QQ")


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
    return rest.rpartition(":")[0].strip("[]")


class SendfileServer:
    """The serving side: a plain TCP listener on the ``--listen`` host.

    Args:
        seeds: the daemon's seeding service (its leases and stream counts are shared).
        host: the address to bind (``--listen``'s host).
        port: the port (``--seed-data-port``; 0: any free one, logged and answered in
            BeginSeed).
    """

    def __init__(self, seeds: SeedServer, host: str, port: int = 0) -> None:
        self.seeds = seeds
        self.host = host
        self.port = port
        self._grants: dict[bytes, _Grant] = {}
        self._pending = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> int:
        """Bind and listen; returns the port bound.

        Raises:
            OSError: the address cannot be bound.
        """
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
        address = str(writer.get_extra_info("peername", ("",))[0])
        try:
            if self._pending >= MAX_PENDING:
                log.warning("seed data connection refused", peer=address, why="too many pending")
                return
            self._pending += 1
            try:
                hello = await asyncio.wait_for(self._hello(reader), HELLO_TIMEOUT)
            except (TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                why = "no hello in time" if isinstance(exc, TimeoutError) else "a bad hello"
                log.warning("seed data connection refused", peer=address, why=why)
                return
            finally:
                self._pending -= 1
            secret, ranges = hello
            grant = self._redeem(secret, address)
            if grant is None:
                log.warning("seed data connection refused", peer=address, why="no valid secret")
                return
            await self._send(grant, ranges, reader, writer)
        except WeightCacheError as err:
            log.warning("seed data connection refused", peer=address, why=err.detail)
        except (OSError, TimeoutError) as exc:
            log.warning("seed data connection ended", peer=address, why=str(exc) or "stalled")
        finally:
            self._writers.discard(writer)
            writer.close()  # whatever happened: no byte more

    @staticmethod
    async def _hello(reader: asyncio.StreamReader) -> tuple[bytes, list[tuple[int, int]]]:
        secret, count = HELLO.unpack(await reader.readexactly(HELLO.size))
        if not 0 < count <= MAXRANGES:
            raise ValueError(f"{count} ranges")
        raw = await reader.readexactly(count * RANGE.size)
        return secret, [RANGE.unpack_from(raw, i * RANGE.size) for i in range(count)]

    async def _send(
        self,
        grant: _Grant,
        ranges: list[tuple[int, int]],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Check the ranges and the stream bounds, then sendfile every range.

        Raises:
            ModelNotFoundError: the lease ended.
            InvalidArgumentError: a range passes the arena, or all of them its size.
            ResourceExhaustedError: the peer, or all peers, have the most streams open.
            OSError, TimeoutError: the connection failed or stalled.
        """
        seeds, who = self.seeds, grant.who
        entry = seeds.entry(grant.lease_id, who)
        if any(o + n > entry.size for o, n in ranges) or sum(n for _, n in ranges) > entry.size:
            raise InvalidArgumentError(
                f"the ranges asked pass the {entry.size}-byte arena or its size in all"
            )
        seeds.open_stream(who)
        try:
            arena = entry.arena
            assert isinstance(arena, SharedMemoryArena)  # entry() and begin() checked it
            with arena.reader() as file:  # its own descriptor: an evict cannot close it
                await self._ranges(grant, ranges, file, reader, writer)
        finally:
            seeds.close_stream(who)

    async def _ranges(
        self,
        grant: _Grant,
        ranges: list[tuple[int, int]],
        file: BinaryIO,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
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
                        return
                    self.seeds.entry(grant.lease_id, grant.who)  # live, renewed
                    await asyncio.wait_for(
                        loop.sendfile(writer.transport, file, cursor, n, fallback=False),
                        SEND_STALL_TIMEOUT,
                    )
                    cursor += n
                    sent += n
            await writer.drain()
        finally:
            closed.cancel()


class SendfilePlane:
    """The seeding side: plain TCP connections to the peer's data port, one per secret,
    each ``recv_into`` the local arena.

    Args:
        address: the peer's IP address (the one BeginSeed reached).
        port: its ``data_port``.
        secrets: its ``data_secrets`` (one connection each).
        into: ``into(offset, length, fill)``: call ``fill`` with a writable view of the
            local arena's bytes ``[offset, offset + length)`` (``Arena.read_into``).
        progress: called with the byte count of each receive (from several threads).
        chunk_bytes: the progress unit of the stall bound.
        stall_timeout: seconds within which each connection must receive ``chunk_bytes``
            (or the rest of its ranges), again and again, or the pull fails with
            :class:`~.dataplane.StalledError`.
    """

    def __init__(
        self,
        address: str,
        port: int,
        secrets: Sequence[bytes],
        into: Callable[[int, int, Callable[[memoryview], None]], None],
        *,
        progress: Callable[[int], None] = lambda _n: None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    ) -> None:
        self.address = address
        self.port = port
        self.secrets = list(secrets)
        self.into = into
        self.progress = progress
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
        """See :meth:`.dataplane.DataPlane.pull`; the bytes land in place through
        ``into`` (``write`` is not called: there is nothing to copy). The ranges are cut
        into one list of pieces per connection, about equal in bytes.

        Raises:
            StalledError: a connection stalled.
            TransferError: a connection failed or was closed early (a refused secret
                included), or ``cancelled()``.
        """
        del lease_id, write  # the secrets name the lease; bytes land in place
        if not self.secrets:
            raise TransferError("the peer granted no data connection")
        plans = _plan(ranges, len(self.secrets))
        left = [
            sum(1 for plan in plans for i, _, _ in plan if i == index)
            for index in range(len(ranges))
        ]
        for index, count in enumerate(left):
            if count == 0:
                done(index)
        lock = threading.Lock()
        errors: list[str] = []
        stalls: list[str] = []
        socks: dict[int, socket.socket] = {}
        marks: dict[int, list[float]] = {}  # [since, got] per connection

        def finish(index: int) -> None:
            with lock:
                left[index] -= 1
                last = left[index] == 0
            if last:
                done(index)

        def worker(k: int, secret: bytes, plan: list[tuple[int, int, int]]) -> None:
            try:
                sock = socket.create_connection((self.address, self.port), CONNECT_TIMEOUT)
            except OSError as exc:
                with lock:
                    errors.append(f"data connection to {self.address}:{self.port}: {exc}")
                return
            with sock:
                sock.settimeout(None)  # the watcher shuts it down on a stall or cancel
                with lock:
                    socks[k] = sock
                    marks[k] = [time.monotonic(), 0.0]
                    if errors:
                        sock.shutdown(socket.SHUT_RDWR)
                try:
                    hello = HELLO.pack(secret, len(plan)) + b"".join(
                        RANGE.pack(o, n) for _, o, n in plan
                    )
                    sock.sendall(hello)
                    for index, offset, length in plan:
                        self.into(
                            offset, length, lambda view: self._receive(sock, view, k, marks, lock)
                        )
                        finish(index)
                except (OSError, TransferError) as exc:
                    with lock:
                        errors.append(f"data connection: {exc}")
                finally:
                    with lock:
                        socks.pop(k, None)

        threads = [
            threading.Thread(target=worker, args=(k, s, p), daemon=True)
            for k, (s, p) in enumerate(zip(self.secrets, plans, strict=False))
            if p
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                self._watch(
                    cancelled, lock=lock, errors=errors, stalls=stalls, socks=socks, marks=marks
                )
                thread.join(WATCH_INTERVAL)
        if cancelled():
            raise TransferError("cancelled at shutdown")
        if stalls:
            raise StalledError(stalls[0])
        real = [e for e in errors if e != "cancelled"] or errors
        if real:
            raise TransferError(real[0])

    def _receive(
        self,
        sock: socket.socket,
        view: memoryview,
        k: int,
        marks: dict[int, list[float]],
        lock: threading.Lock,
    ) -> None:
        """Fill ``view`` from ``sock``, counting progress for the stall bound."""
        got = 0
        while got < len(view):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise TransferError(
                    f"the peer closed the data connection {len(view) - got} bytes early"
                )
            got += n
            self.progress(n)
            with lock:
                mark = marks[k]
                mark[1] += n
                if mark[1] >= min(self.chunk_bytes, len(view) - got) or got == len(view):
                    mark[0], mark[1] = time.monotonic(), 0.0

    def _watch(
        self,
        cancelled: Callable[[], bool],
        *,
        lock: threading.Lock,
        errors: list[str],
        stalls: list[str],
        socks: dict[int, socket.socket],
        marks: dict[int, list[float]],
    ) -> None:
        """Shut every connection down once ``cancelled()`` or one stalled."""
        now = time.monotonic()
        with lock:
            if cancelled() and "cancelled" not in errors:
                errors.append("cancelled")
            for k, sock in socks.items():
                since, got = marks[k]
                if now - since > self.stall_timeout and not stalls:
                    stalls.append(
                        f"stalled: a data connection received {int(got)} bytes in "
                        f"{self.stall_timeout:g} s, less than {self.chunk_bytes} "
                        "(--seed-stall-timeout)"
                    )
                    errors.append("cancelled")
                if errors:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)


def _plan(ranges: Sequence[tuple[int, int]], connections: int) -> list[list[tuple[int, int, int]]]:
    """``(range index, offset, length)`` pieces per connection, in arena order, each
    connection about ``total / connections`` bytes (1 MiB multiples)."""
    total = sum(n for _, n in ranges)
    step = max(-(-total // connections), 1)
    step = -(-step // (1 << 20)) * (1 << 20)
    plans: list[list[tuple[int, int, int]]] = [[] for _ in range(connections)]
    k, room = 0, step
    for index, (offset, length) in enumerate(ranges):
        cursor = offset
        while cursor < offset + length:
            n = min(room, offset + length - cursor)
            plans[k].append((index, cursor, n))
            cursor += n
            room -= n
            if room == 0 and k < connections - 1:
                k, room = k + 1, step
            elif room == 0:
                room = step  # the last connection takes the rest
    return plans
