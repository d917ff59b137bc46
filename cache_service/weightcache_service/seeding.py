"""Receiving seeds: fill a model's arena from a peer daemon's, verified by content.

For a model loaded with ``seed_from`` (``--seed-from PEER``, ``PreloadRequest.seed_from``)
the load thread (:meth:`Store.load_seeded`) runs :meth:`Seeder.seed`:

1. ``BeginSeed`` on the peer, over mutual TLS (``--peer-tls-cert/--peer-tls-key/
   --peer-tls-ca``), naming the model by the ``format``, ``layout``, ``recipe`` and
   ``placement`` components computed from this daemon's own headers; the peer answers
   with its arena layout, the sha256 of every shard file (level ``full``) and a transfer
   lease. A ``PEER`` host that resolves to several addresses (a Kubernetes headless
   Service) is tried address by address, the certificate checked against the host name.
2. The layout must be this daemon's own plan, tensor for tensor; digests the local hash
   cache holds must be the peer's.
3. The data plane pulls the arena: the peer's sendfile plane (:mod:`.sendfile_plane`)
   when it offers one, else ReadSeedData streams (:mod:`.dataplane`); with
   ``--seed-plane mooncake``, Mooncake's transfer engine between staging buffers
   (:mod:`.mooncake_plane`), through :class:`.seed_sources.Swarm` even from one peer.
4. Each shard file is rebuilt from this daemon's own header bytes and the received tensor
   bytes, and its sha256 compared with the peer's digest, before the model turns READY.

Any failure (refusal, unreachable peer, layout, digest mismatch, a transfer cut short)
raises :class:`SeedFailedError`; the store then frees the arena and :meth:`Seeder.fallback`
logs why and the model is loaded from its own files.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from weightcache.core.fingerprint import (
    cached_digests,
    compute_fingerprint,
    pending_fingerprint,
)
from weightcache.core.protocol import fingerprint_pb
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc
from weightcache_service.arena import Arena, SharedMemoryArena, Slot
from weightcache_service.dataplane import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_STALL_TIMEOUT,
    DEFAULT_STREAMS,
    DataPlane,
    GrpcReader,
    GrpcStreamPlane,
    StalledError,
    TransferError,
)
from weightcache_service.events import CacheEvents
from weightcache_service.mooncake_plane import NOT_OFFERED_WHY, MooncakeReader
from weightcache_service.seed_sources import Reader, Swarm, SwarmFailedError
from weightcache_service.sendfile_plane import SendfilePlane, SendfileReader
from weightcache_service.store import Entry

log = structlog.get_logger("weightcache.daemon")

#: Seconds BeginSeed may take per peer address.
BEGIN_TIMEOUT = 10.0
#: Largest message the seeding channel accepts, in bytes (a chunk is at most 4 MiB; room
#: for peers of other versions).
MAX_SEED_MESSAGE = 32 << 20
#: The transfer lease's TTL asked of the peer, in seconds (renewed by every chunk).
SEED_LEASE_TTL = 30
#: The same, seeding from several peers: a peer's connections may wait while another
#: peer's pieces are in flight (up to ``--seed-stall-timeout``), without a chunk to renew
#: it; the peer grants at most 60 s (``seed_serve.MAX_SEED_TTL``).
SWARM_LEASE_TTL = 60

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_SEED_MESSAGE),
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 0),
]


class SeedFailedError(Exception):
    """A seed did not produce verified bytes.

    Attributes:
        result: the metric label (``refused``, ``unsupported``, ``layout``, ``mismatch``,
            ``transfer``, ``stalled``).
        why: the reason, logged.
    """

    def __init__(self, result: str, why: str) -> None:
        super().__init__(f"{result}: {why}")
        self.result = result
        self.why = why


@dataclass(frozen=True)
class PeerTls:
    """The mutual-TLS files this daemon presents to, and checks, a peer (PEM paths).

    Attributes:
        cert, key: this daemon's client certificate chain and private key.
        ca: the CA bundle the peer's server certificate must chain to.
    """

    cert: str
    key: str
    ca: str

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials.

        Raises:
            OSError: a file cannot be read.
        """
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes(),
            private_key=Path(self.key).read_bytes(),
            certificate_chain=Path(self.cert).read_bytes(),
        )


def seedable(entry: Entry) -> str | None:
    """Why ``entry`` cannot be seeded (None when it can): it must be at level ``full``
    and hold every tensor as stored (no cast, no tensor-parallel slice, no plugin), so
    that the shard files can be rebuilt from its arena and checked against their sha256."""
    if entry.fingerprint.level != "full":
        return f"fingerprint level {entry.fingerprint.level}: seeding verifies at level full"
    for name, node in entry.pipeline.nodes.items():
        stored = node.stored
        if stored is None or stored.dtype != node.spec.dtype or stored.shape != node.spec.shape:
            return f"tensor {name!r} is processed by the recipe: only tensors as stored are seeded"
    return None


class Seeder:
    """Seeds models from one peer.

    Args:
        peer: ``HOST:PORT`` of the peer daemon's ``--listen``.
        tls: the mutual-TLS files; None: plaintext (a peer listening ``--insecure`` on
            loopback, which refuses seeding to it: unauthenticated).
        events: where the outcome is counted (the metrics).
        streams: parallel data-plane streams.
        chunk_bytes: bytes per ReadSeedData message.
        stall_timeout: seconds within which every stream must receive a chunk
            (``--seed-stall-timeout``), or the seed is abandoned (result ``stalled``).
        plane: ``tcp``: ask the peer for its sendfile data plane (:mod:`.sendfile_plane`)
            and use it when offered, else ReadSeedData; ``grpc``: ReadSeedData only;
            ``mooncake``: the peer's Mooncake plane (:mod:`.mooncake_plane`) only, a
            peer that does not offer it failing the seed (``--seed-plane``).
    """

    def __init__(
        self,
        peer: str,
        tls: PeerTls | None,
        events: CacheEvents,
        *,
        streams: int = DEFAULT_STREAMS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        plane: str = "tcp",
    ) -> None:
        self.peer = peer
        self.plane = plane
        self.tls = tls
        self.events = events
        self.streams = streams
        self.chunk_bytes = chunk_bytes
        self.stall_timeout = stall_timeout
        self._start = 0.0

    # -- the peer ----------------------------------------------------------------------

    def _targets(self, peer: str | None = None) -> list[tuple[str, str]]:
        """``(target, tls name)`` per address of ``peer``'s host (default: the one peer),
        in resolver order.

        Raises:
            SeedFailedError: ``refused``: it cannot be resolved.
        """
        peer = self.peer if peer is None else peer
        host, _, port = peer.rpartition(":")
        host = host.strip("[]")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as exc:
            raise SeedFailedError("refused", f"cannot resolve peer {peer}: {exc}") from None
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        return [(f"[{a}]:{port}" if ":" in a else f"{a}:{port}", host) for a in addresses]

    def _channel(self, target: str, name: str) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        try:
            creds = self.tls.credentials()
        except OSError as exc:
            raise SeedFailedError("refused", f"cannot read the peer TLS files: {exc}") from None
        options = [*_CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", name)]
        return grpc.secure_channel(target, creds, options=options)

    def _begin(self, entry: Entry) -> tuple[grpc.Channel, pb.BeginSeedResponse, str]:
        """The channel, the answer, and the address (of the peer's host) it came from."""
        request = pb.BeginSeedRequest(
            components=fingerprint_pb(entry.fingerprint).components,
            ttl_seconds=SEED_LEASE_TTL,
            data_connections=self.streams if self.plane != "grpc" else 0,
        )
        errors = []
        for target, name in self._targets():
            channel = self._channel(target, name)
            try:
                stub = pb_grpc.WeightCacheServiceStub(channel)
                begun = stub.BeginSeed(request, timeout=BEGIN_TIMEOUT)
                return channel, begun, target.rpartition(":")[0].strip("[]")
            except grpc.RpcError as exc:
                channel.close()
                errors.append(f"{target}: {exc.code().name}: {exc.details()}")
        raise SeedFailedError("refused", "BeginSeed " + "; ".join(errors))

    # -- the seed ----------------------------------------------------------------------

    def seed(self, entry: Entry, arena: Arena) -> None:
        """Fill ``arena`` with ``entry``'s bytes from the peer and verify them; on success
        the entry's fingerprint is complete, its source ``peer NAME``.

        Raises:
            SeedFailedError: anything went wrong (the arena's content is then undefined).
        """
        self._start = time.monotonic()
        why = seedable(entry)
        if why is not None:
            raise SeedFailedError("unsupported", why)
        if "," in self.peer or len(self._targets()) > 1 or self.plane == "mooncake":
            self._seed_many(entry, arena)
            return
        channel, begun, address = self._begin(entry)
        try:
            digests = self._check_layout(entry, begun)
            plane = self._plane(channel, begun, address, entry, arena)

            def write(offset: int, data: memoryview) -> None:
                write_received(arena, offset, data)
                count_received(entry, len(data))

            pulled = time.monotonic()
            if isinstance(arena, SharedMemoryArena):
                arena.populate()  # every byte is written through the mapping: no faults
            names, ranges = shard_ranges(entry)
            futures: dict[int, Future[str]] = {}
            with ThreadPoolExecutor(max_workers=2) as hashers:

                def done(index: int) -> None:
                    # Hashed as soon as its bytes are in, while the other shards arrive.
                    futures[index] = hashers.submit(shard_sha256, entry, arena, names[index])

                try:
                    plane.pull(begun.lease_id, ranges, write, lambda: entry.cancelled, done)
                except TransferError as exc:
                    for future in futures.values():
                        future.cancel()
                    result = "stalled" if isinstance(exc, StalledError) else "transfer"
                    raise SeedFailedError(result, f"from {self.peer}: {exc}") from None
                verified = time.monotonic()
                got = {names[i]: future.result() for i, future in sorted(futures.items())}
            for name in sorted(digests):
                if got.get(name) != digests[name]:
                    raise SeedFailedError(
                        "mismatch",
                        f"shard {name}: the sha256 of the bytes received, "
                        f"{got.get(name, '')[:16]}…, is not the peer's full-level digest "
                        f"{digests[name][:16]}…",
                    )
            phases = {
                "plane": "tcp" if isinstance(plane, SendfilePlane) else "grpc",
                "begin_seconds": round(pulled - self._start, 3),
                "transfer_seconds": round(verified - pulled, 3),
                "verify_after_seconds": round(time.monotonic() - verified, 3),
            }
        finally:
            try:
                stub = pb_grpc.WeightCacheServiceStub(channel)
                stub.EndSeed(pb.EndSeedRequest(lease_id=begun.lease_id), timeout=2.0)
            except grpc.RpcError:
                pass  # the lease ends with its TTL
            channel.close()
        self._seeded(entry, digests, self.peer, phases)

    def _seeded(
        self, entry: Entry, digests: dict[str, str], source: str, phases: Mapping[str, object]
    ) -> None:
        """Mark ``entry`` seeded (its bytes verified against ``digests``) from ``source``."""
        entry.fingerprint = compute_fingerprint(
            entry.checkpoint, entry.pipeline, entry.placement, "full", file_sha256=digests
        )
        entry.file_sha256 = digests
        entry.source = f"peer {source}"
        entry.tensors_done = len(entry.slots)
        seconds = time.monotonic() - self._start
        log.info(
            "seeded",
            model=entry.name,
            peer=self.peer,
            bytes=entry.size,
            seconds=round(seconds, 3),
            files_confirmed=entry.files_confirmed,
            **phases,
        )
        self.events.seeded("seeded", entry.size, seconds)

    # -- several peers (issue 40, Build 2) --------------------------------------------

    def _peers(self) -> list[tuple[str, str, str]]:
        """``(name, target, tls name)`` per peer: each ``--seed-from`` entry, and each
        address its host resolves to (a headless Service: several peers, each named by
        its address); one that cannot be resolved is logged and left out.

        Raises:
            SeedFailedError: ``refused``: none can be resolved.
        """
        out: dict[str, tuple[str, str, str]] = {}
        errors = []
        for spec in dict.fromkeys(p.strip() for p in self.peer.split(",") if p.strip()):
            try:
                targets = self._targets(spec)
            except SeedFailedError as exc:
                errors.append(exc.why)
                log.warning("seed peer dropped", peer=spec, result="refused", why=exc.why)
                continue
            for target, name in targets:
                out.setdefault(target, (spec if len(targets) == 1 else target, target, name))
        if not out:
            raise SeedFailedError("refused", "; ".join(errors) or "no peer named")
        return list(out.values())

    def _seed_many(self, entry: Entry, arena: Arena) -> None:
        """:meth:`seed` from every peer that holds the model as planned, at once
        (:class:`.seed_sources.Swarm`).

        Raises:
            SeedFailedError: no peer agreed (``refused``, ``layout``, ``mismatch``: the
                first peer's reason), or none could finish (the last drop's result).
        """
        sources: list[PeerSource] = []
        digests: dict[str, str] = {}
        refusals: list[SeedFailedError] = []
        request = pb.BeginSeedRequest(
            components=fingerprint_pb(entry.fingerprint).components,
            ttl_seconds=SWARM_LEASE_TTL,
            data_connections=self.streams if self.plane != "grpc" else 0,
        )
        try:
            for peer in self._peers():
                name = peer[0]
                source = None
                try:
                    source = self._agree(entry, arena, request, peer)
                    theirs = self._check_layout(entry, source.begun)
                    if digests and theirs != digests:
                        raise SeedFailedError(
                            "mismatch", f"its shard digests are not {sources[0].name}'s"
                        )
                except SeedFailedError as exc:
                    if source is not None:
                        source.end()
                    refusals.append(exc)
                    log.warning("seed peer dropped", peer=name, result=exc.result, why=exc.why)
                    continue
                digests = digests or theirs
                sources.append(source)
            if not sources:
                first = refusals[0]
                raise SeedFailedError(first.result, first.why)
            self._swarm(entry, arena, sources, digests)
        finally:
            for source in sources:
                source.end()

    def _agree(
        self,
        entry: Entry,
        arena: Arena,
        request: pb.BeginSeedRequest,
        peer: tuple[str, str, str],
    ) -> PeerSource:
        """BeginSeed on one peer address (``peer``: as :meth:`_peers` gives it).

        Raises:
            SeedFailedError: ``refused``.
        """
        name, target, tls_name = peer
        channel = self._channel(target, tls_name)
        try:
            begun = pb_grpc.WeightCacheServiceStub(channel).BeginSeed(
                request, timeout=BEGIN_TIMEOUT
            )
        except grpc.RpcError as exc:
            channel.close()
            raise SeedFailedError(
                "refused", f"BeginSeed {target}: {exc.code().name}: {exc.details()}"
            ) from None
        address = target.rpartition(":")[0].strip("[]")
        return PeerSource(
            self, name, channel=channel, begun=begun, address=address, entry=entry, arena=arena
        )

    def _swarm(
        self, entry: Entry, arena: Arena, sources: list[PeerSource], digests: dict[str, str]
    ) -> None:
        pulled = time.monotonic()
        if isinstance(arena, SharedMemoryArena):
            arena.populate()  # every byte is written through the mapping: no faults
        names, ranges = shard_ranges(entry)
        swarm = Swarm(
            sources,
            ranges,
            names,
            verify=lambda i: shard_sha256(entry, arena, names[i]) == digests[names[i]],
            cancelled=lambda: entry.cancelled,
        )
        try:
            report = swarm.run()
        except SwarmFailedError as exc:
            result = "transfer" if exc.result == "cancelled" else exc.result
            raise SeedFailedError(result, exc.why) from None
        served = [s.name for s in sources if report.pieces.get(s.name)]
        self._seeded(
            entry,
            digests,
            ",".join(served),
            {
                "plane": self.plane
                if self.plane == "mooncake"
                else ("tcp" if all(s.tcp for s in sources) else "grpc"),
                "begin_seconds": round(pulled - self._start, 3),
                "transfer_seconds": round(time.monotonic() - pulled, 3),
                "pieces": report.pieces,
                "dropped": {name: result for name, (result, _why) in report.dropped.items()},
            },
        )

    def _plane(
        self,
        channel: grpc.Channel,
        begun: pb.BeginSeedResponse,
        address: str,
        entry: Entry,
        arena: Arena,
    ) -> DataPlane:
        """The sendfile plane when the peer offered it (a data port and secrets), else
        ReadSeedData streams over ``channel`` (an older peer, or ``--seed-plane grpc``
        at either end)."""
        if not (begun.data_port and begun.data_secrets):
            return GrpcStreamPlane(channel, self.streams, self.chunk_bytes, self.stall_timeout)

        return SendfilePlane(
            address,
            begun.data_port,
            # The peer decides how many secrets it sends: no more connections than asked.
            list(begun.data_secrets[: self.streams]),
            functools.partial(fill_received, arena),
            progress=functools.partial(count_received, entry),
            chunk_bytes=self.chunk_bytes,
            stall_timeout=self.stall_timeout,
        )

    def _check_layout(self, entry: Entry, begun: pb.BeginSeedResponse) -> dict[str, str]:
        """The peer's shard digests, once its layout is found to be this daemon's plan
        and its digests agree with those the local hash cache holds.

        Raises:
            SeedFailedError: ``layout`` or ``mismatch``.
        """
        mine = [(s.name, s.dtype, tuple(s.shape), s.byte_offset) for s in entry.slots]
        theirs = [(t.name, t.dtype, tuple(t.shape), t.byte_offset) for t in begun.tensors]
        if begun.arena_size != entry.size or sorted(mine) != sorted(theirs):
            raise SeedFailedError(
                "layout",
                f"the peer's arena ({begun.arena_size} bytes, {len(theirs)} tensors) is not "
                f"laid out as this daemon plans it ({entry.size} bytes, {len(mine)} tensors)",
            )
        digests = {s.name: s.file_sha256 for s in begun.shards}
        shards = {s.name for s in entry.checkpoint.shards}
        if set(digests) != shards:
            raise SeedFailedError("layout", "the peer's shard digests name other shards")
        known = cached_digests(entry.checkpoint)
        for name, digest in known.items():
            if digests[name] != digest:
                raise SeedFailedError(
                    "mismatch",
                    f"shard {name}: the peer's sha256 {digests[name][:16]}… is not this "
                    f"node's file's {digest[:16]}… (the local checkpoint is another model)",
                )
        entry.files_confirmed = set(known) == shards
        return digests

    def fallback(self, entry: Entry, exc: Exception) -> None:
        """After a failed seed: log why, count it, and reset ``entry`` to be loaded from
        its files (source ``checkpoint``, fingerprint from the hash cache or pending)."""
        if isinstance(exc, SeedFailedError):
            result, why = exc.result, exc.why
        else:
            result, why = "transfer", f"{type(exc).__name__}: {exc}"
        seconds = time.monotonic() - self._start
        log.warning(
            "seed failed: loading from the checkpoint's files",
            model=entry.name,
            peer=self.peer,
            result=result,
            why=why,
        )
        self.events.seeded(result, 0, seconds)
        entry.source = "checkpoint"
        entry.files_confirmed = True
        known = cached_digests(entry.checkpoint)
        if len(known) == len(entry.checkpoint.shards):
            entry.fingerprint = compute_fingerprint(
                entry.checkpoint, entry.pipeline, entry.placement, "full", file_sha256=known
            )
            entry.file_sha256 = known
        else:
            entry.fingerprint = pending_fingerprint(
                entry.checkpoint, entry.pipeline, entry.placement
            )
            entry.file_sha256 = {}


def fill_received(
    arena: Arena, offset: int, length: int, fill: Callable[[memoryview], None]
) -> None:
    """Let ``fill`` write ``length`` received bytes at ``offset`` of the seeded arena (every
    plane's ``into``)."""
    arena.read_into(Slot("seed", "U8", (length,), offset, length), fill)


def write_received(arena: Arena, offset: int, data: memoryview) -> None:
    """Copy ``data``, received, to ``offset`` of the seeded arena."""

    def fill(out: memoryview) -> None:
        out[:] = data

    fill_received(arena, offset, len(data), fill)


def count_received(entry: Entry, nbytes: int) -> None:
    """Count ``nbytes`` more received in the load's progress (never past its size)."""
    entry.bytes_done = min(entry.bytes_done + nbytes, entry.data_bytes)


def shard_ranges(entry: Entry) -> tuple[list[str], list[tuple[int, int]]]:
    """The shards by name, and the arena range ``(offset, length)`` holding each one's
    tensors (their slots lie together, in checkpoint order; the padding between is not
    pulled: it is zero in both arenas).

    Raises:
        SeedFailedError: ``unsupported``: a shard holds a tensor the arena does not, or
            two shards' ranges overlap.
    """
    slots = {slot.name: slot for slot in entry.slots}
    names, ranges = [], []
    for shard in entry.checkpoint.shards:
        held = [slots[t.name] for t in shard.tensors if t.name in slots]
        if len(held) != len(shard.tensors):
            raise SeedFailedError("unsupported", f"shard {shard.name} is not held whole")
        lo = min((s.byte_offset for s in held), default=0)
        hi = max((s.byte_offset + s.nbytes for s in held), default=0)
        names.append(shard.name)
        ranges.append((lo, hi - lo))
    spans = sorted((lo, lo + n) for lo, n in ranges if n)
    if any(a_hi > b_lo for (_, a_hi), (b_lo, _) in itertools.pairwise(spans)):
        raise SeedFailedError("unsupported", "the shards' tensors interleave in the arena")
    return names, ranges


def shard_sha256(entry: Entry, arena: Arena, name: str) -> str:
    """The sha256 of shard file ``name`` rebuilt from this daemon's own header bytes (the
    file's first bytes, before its tensors) and the tensor bytes in ``arena``."""
    shard = next(s for s in entry.checkpoint.shards if s.name == name)
    slots = {slot.name: slot for slot in entry.slots}
    tensors = sorted(shard.tensors, key=lambda t: t.begin)
    prefix = shard.size - sum(t.nbytes for t in tensors)
    h = hashlib.sha256(os.pread(entry.checkpoint.fd(name), prefix, 0))
    for tensor in tensors:
        arena.read_into(slots[tensor.name], h.update)
    return h.hexdigest()


class PeerSource:
    """One peer of a seed from several (:class:`.seed_sources.Source`): its BeginSeed
    answer, and readers over its sendfile data plane (when offered) or ReadSeedData.

    Attributes:
        name: as ``--seed-from`` names it (or its address, for a host of several).
        begun: its BeginSeed answer.
        tcp: whether it offered the sendfile data plane.
        connections: its data connections (granted secrets), or ``--seed-streams``.
    """

    def __init__(
        self,
        seeder: Seeder,
        name: str,
        *,
        channel: grpc.Channel,
        begun: pb.BeginSeedResponse,
        address: str,
        entry: Entry,
        arena: Arena,
    ) -> None:
        self.seeder = seeder
        self.name = name
        self.channel = channel
        self.begun = begun
        self.address = address
        self.entry = entry
        self.arena = arena
        self.tcp = bool(begun.data_port and begun.data_secrets)
        # A peer's answer must not decide how many threads this daemon starts.
        self.connections = (
            min(len(begun.data_secrets), seeder.streams) if self.tcp else seeder.streams
        )
        self._ended = False

    def _progress(self, nbytes: int) -> None:
        count_received(self.entry, nbytes)

    def _into(self, offset: int, length: int, fill: Callable[[memoryview], None]) -> None:
        fill_received(self.arena, offset, length, fill)

    def _write(self, offset: int, data: memoryview) -> None:
        write_received(self.arena, offset, data)
        count_received(self.entry, len(data))

    def open(self, k: int) -> Reader:
        """Connection ``k``: a kept sendfile data connection (its ``k``-th secret), a
        Mooncake one (``--seed-plane mooncake``), or a ReadSeedData reader.

        Raises:
            TransferError: ``--seed-plane mooncake`` and the peer offers no data port.
        """
        seeder, cancelled = self.seeder, lambda: self.entry.cancelled
        if seeder.plane == "mooncake" and not self.tcp:
            raise TransferError(NOT_OFFERED_WHY)
        if self.tcp:
            kind = MooncakeReader if seeder.plane == "mooncake" else SendfileReader
            return kind(
                self.address,
                self.begun.data_port,
                self.begun.data_secrets[k],
                self._into,
                progress=self._progress,
                chunk_bytes=seeder.chunk_bytes,
                stall_timeout=seeder.stall_timeout,
                cancelled=cancelled,
            )
        return GrpcReader(
            self.channel,
            self.begun.lease_id,
            self._write,
            chunk_bytes=seeder.chunk_bytes,
            stall_timeout=seeder.stall_timeout,
            cancelled=cancelled,
        )

    def end(self) -> None:
        """EndSeed (once), and close the channel."""
        if self._ended:
            return
        self._ended = True
        with contextlib.suppress(grpc.RpcError):  # else the lease ends with its TTL
            stub = pb_grpc.WeightCacheServiceStub(self.channel)
            stub.EndSeed(pb.EndSeedRequest(lease_id=self.begun.lease_id), timeout=2.0)
        self.channel.close()
