"""The sendfile data plane of seeding: the kernel moves the arena's bytes (issue 40).

The mutual-TLS gRPC channel stays the control plane: ``BeginSeed`` (asked with
``data_connections``) grants a transfer lease and, where this daemon offers the plane
(``--seed-plane tcp``, the default), answers ``data_port`` and one secret per connection
(:meth:`.sendfile_serve.SendfileServer.grant`). The seeder then opens plain TCP
connections to that port; each one sends, within
:data:`.sendfile_serve.HELLO_TIMEOUT` seconds, a hello::

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

Bounds (:mod:`.sendfile_serve`): connections awaiting their hello (:data:`MAX_PENDING`,
:data:`MAX_PENDING_PER_ADDRESS` from one address), streams per peer and in all (shared
with ReadSeedData: :data:`.seed_serve.MAX_STREAMS_PER_PEER`, :data:`.seed_serve.MAX_STREAMS`),
each :data:`SEND_CHUNK` that does not leave within :data:`SEND_STALL_TIMEOUT` seconds, and
the lease checked (and renewed) before every :data:`SEND_CHUNK` bytes, so an evict or a
drain ends a transfer within one chunk. On ``--listen [::]:P`` the data port is
dual-stack, as gRPC's listener is.

This module is the seeding side (:class:`SendfilePlane`) and the wire format; the serving
side is :mod:`.sendfile_serve`, so that the seeder imports nothing of the server.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import structlog

from weightcache_service.dataplane import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_STALL_TIMEOUT,
    WATCH_INTERVAL,
    StalledError,
    TransferError,
    Writer,
)

log = structlog.get_logger("weightcache.daemon")

#: Bytes of one secret (``secrets.token_bytes``).
SECRET_BYTES = 32
#: Seconds the seeder waits for the TCP connection.
CONNECT_TIMEOUT = 10.0

#: A data connection's hello: the secret and the count of ranges that follow.
HELLO = struct.Struct(">32sI")
#: One range of the hello: offset and length in bytes, from the arena's start.
RANGE = struct.Struct(">QQ")
#: The hello's count with this bit set: the seeder keeps the connection, and once it has
#: received every byte asked, it may ask more on it: ``count`` (:data:`MORE`) and that
#: many ranges, again and again; a count of 0, or a close, ends it (seeding from several
#: peers, :mod:`.seed_sources`).
KEEP_OPEN = 1 << 31
#: The count of a next batch of ranges on a kept connection.
MORE = struct.Struct(">I")


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


class SendfileReader:
    """One kept data connection (:data:`KEEP_OPEN`), asked one range at a time: what a
    seed from several peers uses (:class:`.seed_sources.Reader`). Connects at the first
    :meth:`read` (the secret's single use).

    Args:
        address, port, secret: as :class:`SendfilePlane`'s, one secret.
        into: ``into(offset, length, fill)``, as :class:`SendfilePlane`'s.
        progress: called with the byte count of each receive.
        chunk_bytes, stall_timeout: the stall bound, as :class:`SendfilePlane`'s.
        cancelled: turns true when the seed must stop (checked every
            :data:`.dataplane.WATCH_INTERVAL`).
    """

    def __init__(
        self,
        address: str,
        port: int,
        secret: bytes,
        into: Callable[[int, int, Callable[[memoryview], None]], None],
        *,
        progress: Callable[[int], None] = lambda _n: None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        self.address, self.port, self.secret = address, port, secret
        self.into = into
        self.progress = progress
        self.chunk_bytes = chunk_bytes
        self.stall_timeout = stall_timeout
        self.cancelled = cancelled
        self._sock: socket.socket | None = None
        self._aborted = False

    def read(self, offset: int, length: int) -> None:
        """Ask ``[offset, offset + length)`` and receive it in place.

        Raises:
            StalledError: less than ``chunk_bytes`` (or the rest) arrived within
                ``stall_timeout`` seconds.
            TransferError: the connection failed, the peer closed it early (a refused
                secret included), :meth:`abort` or ``cancelled()``.
        """
        try:
            if self._sock is None:
                self._sock = socket.create_connection((self.address, self.port), CONNECT_TIMEOUT)
                self._sock.settimeout(WATCH_INTERVAL)
                head = HELLO.pack(self.secret, 1 | KEEP_OPEN)
            else:
                head = MORE.pack(1)
            if self._aborted:
                raise TransferError("cancelled")
            self._sock.sendall(head + RANGE.pack(offset, length))
        except OSError as exc:
            raise TransferError(f"data connection to {self.address}:{self.port}: {exc}") from None
        self.into(offset, length, self._fill)

    def _fill(self, view: memoryview) -> None:
        assert self._sock is not None
        got, mark, since, need = 0, time.monotonic(), 0, min(self.chunk_bytes, len(view))
        while got < len(view):
            if self._aborted or self.cancelled():
                raise TransferError("cancelled")
            try:
                n = self._sock.recv_into(view[got:])
            except TimeoutError:
                n = -1  # nothing within the watch interval
            except OSError as exc:
                raise TransferError(f"data connection: {exc}") from None
            if n == 0:
                raise TransferError(
                    f"data connection: the peer closed the data connection "
                    f"{len(view) - got} bytes early"
                )
            now = time.monotonic()
            if n > 0:
                got, since = got + n, since + n
                self.progress(n)
                if since >= need:
                    mark, since, need = now, 0, min(self.chunk_bytes, len(view) - got)
            if now - mark > self.stall_timeout and got < len(view):
                raise StalledError(
                    f"stalled: a data connection received {since} bytes in "
                    f"{self.stall_timeout:g} s, less than {self.chunk_bytes} "
                    "(--seed-stall-timeout)"
                )

    def abort(self) -> None:
        """Make a :meth:`read` in flight fail within :data:`.dataplane.WATCH_INTERVAL`."""
        self._aborted = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the connection (the peer then ends it)."""
        if self._sock is not None:
            self._sock.close()


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
