"""The Mooncake data plane of seeding (issue 40, Build 1): Mooncake's transfer engine moves
the bytes between two **staging buffers**, never an arena (``--seed-plane mooncake``).

Authorization and control reuse the sendfile data plane's connection
(:mod:`.sendfile_plane`): a single-use secret from BeginSeed, bound to the transfer lease,
the peer and its address, in the hello. A hello whose count has :data:`STAGE` set (with
:data:`.sendfile_plane.KEEP_OPEN`) asks for staging instead of ``sendfile``: the serving
daemon, when it offers the plane (``--seed-mooncake``), answers :data:`ENGINE` (status
:data:`OFFERED`, then its engine's session id, ``HOST:PORT``), or status
:data:`NOT_OFFERED` and closes. Then, for each range asked (at most :data:`SLOT_BYTES`;
batches of more ranges as :data:`.sendfile_plane.MORE` asks them), it copies those arena
bytes into the next slot of a **staging ring** (:data:`RING_SLOTS` slots, an anonymous
buffer of its own registered with its engine, one ring per connection) and answers
:data:`STAGED`: the slot's address in its engine and the length. The seeder
``transfer_sync_read``s the slot into its own registered staging buffer, copies that into
its arena (never registered), and asks the next range. The ring is reused in order:
range ``n`` goes to slot ``n % RING_SLOTS``, and the seeder asks range ``n + RING_SLOTS``
only once it has read range ``n``'s slot (the ask is the acknowledgement), so up to
:data:`RING_SLOTS` ranges are staged ahead of the transfer.

Why staging only: a region registered with the engine is readable *and writable* by any
process that reaches the engine's ports, unauthenticated (``bench/seed_mooncake_ceiling.py``
measured a peer's write landing), and the engine listens on every interface. A live arena
is mapped by workers; a staging slot holds, for one transfer, bytes the seeder verifies
anyway: each shard's sha256 is checked once its pieces land (:mod:`.seed_sources`), so a
slot overwritten by a third party fails the digest and the shard is pulled again.

Mooncake (PyPI ``mooncake-transfer-engine-non-cuda``, the ``mooncake`` extra; it loads
Debian's ``libibverbs1`` at import, even over TCP) is imported only when the plane is used
(:func:`transfer_engine`): the daemon stays free of it otherwise. Over TCP (protocol
``tcp``, ``P2PHANDSHAKE``) it is what this module is tested with; on an RDMA fabric the
same code serves with the engine's ``rdma`` protocol (:data:`PROTOCOL`).
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import socket
import struct
import threading
from typing import Any, ClassVar

import structlog

from weightcache_service.dataplane import (
    StalledError,
    TransferError,
)
from weightcache_service.sendfile_plane import (
    CONNECT_TIMEOUT,
    HELLO,
    KEEP_OPEN,
    MORE,
    RANGE,
    SendfileReader,
)

log = structlog.get_logger("weightcache.daemon")

#: The hello's count with this bit set (and :data:`.sendfile_plane.KEEP_OPEN`): stage the
#: ranges for the transfer engine instead of sending them.
STAGE = 1 << 30
#: Bytes of one staging slot: the most one range asked may hold.
SLOT_BYTES = 4 << 20
#: Slots of one connection's staging ring: ranges staged ahead of the transfer.
RING_SLOTS = 4
#: The answer to a staging hello: status, then the length of the session id that follows
#: (``HOST:PORT`` of the serving daemon's engine, ASCII).
ENGINE = struct.Struct(">BH")
#: :data:`ENGINE` status: the plane is offered; the session id follows.
OFFERED = 0
#: :data:`ENGINE` status: this daemon does not offer the plane (no ``--seed-mooncake``).
NOT_OFFERED = 1
#: The answer to each range staged: the slot's address in the engine, and its length.
STAGED = struct.Struct(">QQ")
#: The engine's transport (``tcp`` here; ``rdma`` where the fabric has it).
PROTOCOL = "tcp"
#: Why a seed over this plane fails against a daemon that does not offer it.
NOT_OFFERED_WHY = "the peer does not offer the mooncake data plane (--seed-mooncake)"

#: This process's engine, once made (:func:`transfer_engine`).
_engine: list[Any] = []
_engine_lock = threading.Lock()


def transfer_engine(host: str) -> Any:
    """This process's Mooncake ``TransferEngine`` (made at the first call, advertising
    ``host``; ``P2PHANDSHAKE``: no metadata server), listening on every interface.

    Raises:
        ImportError: Mooncake is not installed (the ``mooncake`` extra), or
            ``libibverbs1`` is missing.
        OSError: the engine did not start.
    """
    with _engine_lock:
        if not _engine:
            from mooncake.engine import TransferEngine  # lazy: the daemon runs without it

            engine = TransferEngine()
            rc = engine.initialize(host, "P2PHANDSHAKE", PROTOCOL, "")
            if rc != 0:
                raise OSError(f"the Mooncake transfer engine did not start (code {rc})")
            _engine.append(engine)
        return _engine[0]


def check_available() -> str | None:
    """Why Mooncake cannot be used here (None when it can): checked at start-up, so that a
    daemon asked for the plane fails then, not at its first seed."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return (
            f"the Mooncake transfer engine cannot be imported ({exc}): install the "
            "`mooncake` extra (mooncake-transfer-engine-non-cuda) and Debian's libibverbs1 "
            "(make seed-deps)"
        )
    return None


def _session(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class StagingBuffer:
    """An anonymous buffer of ``size`` bytes registered with ``engine``; never an arena.
    Get one with :meth:`acquire`, give it back with :meth:`release`.

    Released buffers are unregistered and their pages dropped (``MADV_DONTNEED``), but
    kept mapped for the next :meth:`acquire` rather than unmapped: the engine's own
    threads may still be in a copy from (or a peer's write into) the region when a
    connection ends, and an unmapped region would fault the daemon; a dropped one reads
    zeros. The mappings kept are the most connections ever open at once.

    Attributes:
        address: the buffer's address, as the engine knows it.
        view: a writable view of its bytes.
    """

    _free: ClassVar[dict[int, list[StagingBuffer]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(-1, size)
        self._c = (ctypes.c_char * size).from_buffer(self._map)
        self.address = ctypes.addressof(self._c)
        self.view = memoryview(self._map)
        self.engine: Any = None

    @classmethod
    def acquire(cls, engine: Any, size: int) -> StagingBuffer:
        """A buffer of ``size`` bytes registered with ``engine``.

        Raises:
            OSError: the engine refused to register it.
        """
        with cls._lock:
            free = cls._free.get(size)
            buffer = free.pop() if free else None
        if buffer is None:
            buffer = cls(size)
        if engine.register_memory(buffer.address, size) != 0:
            buffer._back()
            raise OSError(f"the transfer engine refused to register {size} bytes")
        buffer.engine = engine
        return buffer

    def _back(self) -> None:
        self._map.madvise(mmap.MADV_DONTNEED)
        with self._lock:
            self._free.setdefault(self.size, []).append(self)

    def release(self) -> None:
        """Unregister it (a peer's read or write of it fails from then on) and keep it
        for the next :meth:`acquire`."""
        if self.engine is not None:
            self.engine.unregister_memory(self.address)
            self.engine = None
            self._back()


class MooncakeStager:
    """The serving side: stages ranges of an arena into a connection's ring (used by
    :class:`.sendfile_serve.SendfileServer` for a hello with :data:`STAGE`)."""

    async def ring(self, host: str) -> tuple[str, StagingBuffer]:
        """The engine's session id as seen at ``host`` (the address the seeder reached),
        and a new staging ring of :data:`RING_SLOTS` x :data:`SLOT_BYTES` bytes.

        Raises:
            ImportError, OSError: as :func:`transfer_engine`, or the ring could not be
                registered.
        """

        def make() -> tuple[str, StagingBuffer]:
            engine = transfer_engine(host)
            ring = StagingBuffer.acquire(engine, RING_SLOTS * SLOT_BYTES)
            return _session(host, int(engine.get_rpc_port())), ring

        return await asyncio.to_thread(make)

    @staticmethod
    async def stage(ring: StagingBuffer, n: int, fd: int, offset: int, length: int) -> int:
        """Copy ``length`` bytes at ``offset`` of the arena file ``fd`` into slot
        ``n % RING_SLOTS`` of ``ring``; returns the slot's address.

        Raises:
            OSError: the arena file is shorter than the range.
        """
        at = (n % RING_SLOTS) * SLOT_BYTES

        def copy() -> None:
            got = 0
            while got < length:
                k = os.preadv(fd, [ring.view[at + got : at + length]], offset + got)
                if k <= 0:
                    raise OSError(f"the arena ended {length - got} bytes short of a range")
                got += k

        await asyncio.to_thread(copy)
        return ring.address + at


class MooncakeReader(SendfileReader):
    """The seeding side: one kept data connection asking ranges to be staged, and the
    transfer engine reading each slot (:class:`.seed_sources.Reader`). Connects at the
    first :meth:`read` (the secret's single use).

    Args:
        address, port, secret: the peer's address, ``data_port`` and one of its
            ``data_secrets``.
        into: ``into(offset, length, fill)``, as :class:`.sendfile_plane.SendfilePlane`'s.
        progress: called with the byte count of each slot read.
        chunk_bytes: the progress unit of the stall bound (a slot is at most
            :data:`SLOT_BYTES`).
        stall_timeout: seconds within which each staged slot must be answered.
        cancelled: turns true when the seed must stop (checked between slots).

    :meth:`abort` is :class:`.sendfile_plane.SendfileReader`'s: a read in flight fails at
    its next slot (a transfer in flight ends first: the engine's call cannot be
    interrupted).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The connection's state and its abort are SendfileReader's; the staging buffer
        # and the peer's engine session are this plane's own.
        super().__init__(*args, **kwargs)
        self._session = ""
        self._staging: StagingBuffer | None = None

    def read(self, offset: int, length: int) -> None:
        """Have ``[offset, offset + length)`` staged slot by slot, read each slot, and put
        its bytes at the same place of the local arena.

        Raises:
            StalledError: a slot was not answered within ``stall_timeout`` seconds.
            TransferError: the connection failed or the peer closed it (a refused secret
                included), the peer does not offer the plane (:data:`NOT_OFFERED_WHY`),
                a transfer failed, :meth:`abort` or ``cancelled()``.
        """
        if length <= 0:
            return
        pieces = [
            (o, min(SLOT_BYTES, offset + length - o))
            for o in range(offset, offset + length, SLOT_BYTES)
        ]
        first = pieces[:RING_SLOTS]
        ask = b"".join(RANGE.pack(o, n) for o, n in first)
        try:
            if self._sock is None:
                self._sock = socket.create_connection((self.address, self.port), CONNECT_TIMEOUT)
                self._sock.settimeout(self.stall_timeout)
                self._sock.sendall(HELLO.pack(self.secret, len(first) | KEEP_OPEN | STAGE) + ask)
                self._hello()
            else:
                self._sock.sendall(MORE.pack(len(first)) + ask)
            for i, (at, n) in enumerate(pieces):
                if self._aborted or self.cancelled():
                    raise TransferError("cancelled")
                self._slot(at, n)
                if i + RING_SLOTS < len(pieces):  # the slot just read may take the next
                    o, k = pieces[i + RING_SLOTS]
                    self._sock.sendall(MORE.pack(1) + RANGE.pack(o, k))
        except TimeoutError:
            raise StalledError(
                f"stalled: no staged slot answered in {self.stall_timeout:g} s "
                "(--seed-stall-timeout)"
            ) from None
        except OSError as exc:
            raise TransferError(f"data connection to {self.address}:{self.port}: {exc}") from None

    def _recv(self, size: int) -> bytes:
        assert self._sock is not None
        out = b""
        while len(out) < size:
            part = self._sock.recv(size - len(out))
            if not part:
                raise TransferError(
                    "data connection: the peer closed the data connection (a refused "
                    "secret, or a peer that does not know the staging hello)"
                )
            out += part
        return out

    def _hello(self) -> None:
        """The peer's :data:`ENGINE` answer, and this side's staging buffer.

        Raises:
            TransferError: not offered, or the engine could not be started here.
        """
        status, size = ENGINE.unpack(self._recv(ENGINE.size))
        if status != OFFERED:
            raise TransferError(NOT_OFFERED_WHY)
        self._session = self._peer_session(self._recv(size))
        assert self._sock is not None
        local = str(self._sock.getsockname()[0])
        try:
            self._staging = StagingBuffer.acquire(transfer_engine(local), SLOT_BYTES)
        except (ImportError, OSError) as exc:
            raise TransferError(f"the local transfer engine: {exc}") from None

    def _peer_session(self, raw: bytes) -> str:
        """The engine session to read from: the port the peer named, on the address this
        connection reached (the peer must not point this daemon's engine at another host).

        Raises:
            TransferError: the session id is not ``HOST:PORT`` with a port in 1..65535.
        """
        _, _, port = raw.decode("ascii", "replace").rpartition(":")
        if not (port.isdigit() and 0 < int(port) < 65536):
            raise TransferError(f"the peer's engine session {raw[:64]!r} is not HOST:PORT")
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{int(port)}"

    def _slot(self, offset: int, length: int) -> None:
        """Read the next staged slot (``length`` bytes of the arena at ``offset``)."""
        remote, n = STAGED.unpack(self._recv(STAGED.size))
        if n != length:
            raise TransferError(f"the peer staged {n} bytes, not the {length} asked")
        staging = self._staging
        assert staging is not None
        rc = staging.engine.transfer_sync_read(self._session, staging.address, remote, n)
        if rc != 0:
            raise TransferError(f"transfer_sync_read from {self._session} failed (code {rc})")

        def fill(out: memoryview) -> None:
            out[:] = staging.view[:n]

        self.into(offset, n, fill)
        self.progress(n)

    def close(self) -> None:
        """Close the connection (the peer releases its ring) and release the staging
        buffer."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._staging is not None:
            self._staging.release()
            self._staging = None
