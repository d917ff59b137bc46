"""The daemon process: grpc.aio server on a Unix socket, health, reflection, shutdown.

Health (``grpc.health.v1``, :mod:`weightcache_service.health`): ``liveness`` while the
loop serves; ``readiness`` and ``""`` once every required model is READY;
``weightcache.v1.WeightCacheService`` once every start-up preload has ended. Optional
listeners: health only (``--health-listen``, :mod:`.health`), Prometheus metrics
(``--metrics-listen``, :mod:`.metrics`); ``sd_notify`` under systemd (:mod:`.notify`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import resource
import signal
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from weightcache.core.errors import ModelExistsError, ResourceExhaustedError, WeightCacheError
from weightcache.core.fingerprint import DEFAULT_LEVEL, Level
from weightcache.core.recipe import Placement, Recipe
from weightcache.core.rpc import MAX_RESPONSE_BYTES, SERVICE_NAME, target
from weightcache.core.sockets import MAX_SOCKET_PATH, SHM_DIR, segment_tag
from weightcache.core.stalls import StallWatch
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc
from weightcache_service import signals
from weightcache_service.access import (
    CONNECTION_OPTIONS,
    Access,
    AccessError,
    is_loopback,
    parse_listen,
    tcp_connection_bound,
    tcp_server_options,
)
from weightcache_service.arena import SharedMemoryArena
from weightcache_service.authz import AuthorizationInterceptor, Policy
from weightcache_service.backend import CPU_DEVICE, Device, open_backend
from weightcache_service.budget import MemoryBudget
from weightcache_service.cache import WeightCache
from weightcache_service.guard import StatusGuard
from weightcache_service.handover import (
    HandOverRefusedError,
    check_segment,
    manifest_path,
    read_manifest,
    write_manifest,
)
from weightcache_service.health import Health, HealthListener
from weightcache_service.leases import LeaseTable
from weightcache_service.notify import Notifier
from weightcache_service.options import ServiceOptions
from weightcache_service.seed_serve import SeedServer
from weightcache_service.segments import (
    Skipped,
    handover_name,
    remove_dead_segments,
    remove_stale_segments,
    segment_name,
    segment_prefix,
)
from weightcache_service.servicer import WeightCacheServicer, register_raw_seed_data
from weightcache_service.socket_lock import SocketLock, SocketLostError

if TYPE_CHECKING:
    from weightcache_service.metrics import MetricsListener
    from weightcache_service.sendfile_serve import SendfileServer
from weightcache_service.store import Entry, Store

log = structlog.get_logger("weightcache.daemon")

REAP_INTERVAL = 0.2
#: Seconds between the event loop's beats of its :class:`StallWatch` (whose clock times
#: the leases: a loop that did not run for longer stops the lease clock meanwhile).
STALL_BEAT = 0.1
#: A stall of the event loop at least this long (seconds) is logged.
STALL_LOGGED = 1.0
#: Seconds between checks that the socket path and its lock file are still this daemon's.
SOCKET_CHECK_INTERVAL = 0.5
#: Seconds each ``EXTEND_TIMEOUT_USEC`` gives systemd's start timeout while start-up
#: preloads run; sent every third of it.
START_EXTENSION = 60.0
#: Largest request accepted: requests carry ids, paths and a fingerprint, never data.
MAX_REQUEST_BYTES = 4 * 2**20


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (the soft default, often 1024, is
    what a few hundred idle connections exhaust; the hard limit is the operator's).

    Returns:
        The ``(soft, hard)`` limits now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning(
                "cannot raise the file descriptor limit", soft=soft, hard=hard, error=str(exc)
            )
    return soft, hard


@dataclass(frozen=True)
class TcpListener:
    """``--listen HOST:PORT``: TLS unless ``insecure`` (then loopback only).

    Attributes:
        address: ``HOST:PORT``.
        cert, key: PEM server certificate chain and private key (paths).
        client_ca: PEM CA bundle (path); when set, clients must present a certificate
            it signed (mutual TLS), and such peers are authenticated.
        insecure: plaintext, allowed only on a loopback address.
        client_subjects: ``--tls-client-subject``: certificate names (common name,
            subject alternative name or ``CN=...`` subject) allowed every RPC; empty:
            any certificate ``client_ca`` signed.
        unauthenticated_info: ``--allow-unauthenticated-info``: peers without an allowed
            certificate may call GetServerInfo, ListModels and GetModel (see
            :mod:`weightcache_service.authz`).
    """

    address: str
    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None
    insecure: bool = False
    client_subjects: tuple[str, ...] = ()
    unauthenticated_info: bool = False

    @property
    def policy(self) -> Policy:
        """What TCP peers may call."""
        return Policy(
            mutual_tls=self.client_ca is not None and not self.insecure,
            subjects=frozenset(self.client_subjects),
            unauthenticated_info=self.unauthenticated_info,
        )

    def bind(self, server: grpc.aio.Server) -> int:
        """Add the port to ``server``; returns the port bound.

        Raises:
            AccessError: plaintext on a non-loopback address, TLS without cert and key,
                ``client_subjects`` without ``client_ca``, or unreadable PEM files.
        """
        host, _ = parse_listen(self.address)
        if self.client_subjects and (self.insecure or not self.client_ca):
            raise AccessError("--tls-client-subject needs --tls-client-ca (mutual TLS)")
        if self.insecure:
            if not is_loopback(host):
                raise AccessError(f"--insecure TCP only on loopback, not {host}")
            return server.add_insecure_port(self.address)
        if not (self.cert and self.key):
            raise AccessError("--listen needs --tls-cert and --tls-key (or --insecure)")
        try:
            pair = (Path(self.key).read_bytes(), Path(self.cert).read_bytes())
            ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        except OSError as exc:
            raise AccessError(f"cannot read TLS files: {exc}") from None
        creds = grpc.ssl_server_credentials(
            [pair], root_certificates=ca, require_client_auth=bool(ca)
        )
        return server.add_secure_port(self.address, creds)


@dataclass(frozen=True)
class PreloadSpec:
    """One model to load at start: a checkpoint folder under a recipe and placement;
    ``required``: the daemon is not ready (health ``readiness``) until it is READY;
    ``name``: the model's name before the suffixes (a Hub repo id's
    :attr:`~weightcache.core.hub.HubModel.name`), None for the folder's basename."""

    path: str
    recipe: Recipe = field(default_factory=Recipe)
    placement: Placement = field(default_factory=Placement)
    fingerprint_level: Level = DEFAULT_LEVEL
    required: bool = True
    name: str | None = None
    #: ``--seed-from``: the peer daemon (``HOST:PORT``) to seed it from first.
    seed_from: str = ""


@dataclass
class DaemonConfig:
    """Everything the daemon is started with.

    Attributes:
        socket: Unix socket path.
        preload: models to load at start.
        options: permissions for remote requests, and the drain timeout.
        budget: admission control for arenas.
        access: socket and segment permissions (``--group``).
        tcp: an extra TCP listener, or None.
        device: the resolved device (:func:`backend.resolve_device`): the CPU (shared
            memory) or a GPU (CUDA IPC).
        grace: seconds in-flight RPCs get at shutdown, after the drain.
        health_listen: ``HOST:PORT`` of a plaintext health-only listener, or None.
        metrics_listen: ``HOST:PORT`` of the Prometheus metrics listener, or None.
        hand_over: ``--hand-over``: SIGTERM hands the arenas and leases over to the next
            daemon on the socket (as SIGUSR2 always does) instead of draining.
        argv: the command line it was started with (logged at start).
        allow_seeding: ``--allow-seeding``: authenticated peers may seed from it.
        seed_max_rate: ``--seed-max-rate``: bytes per second per seed stream served (0:
            no limit).
        seed_plane: ``--seed-plane``: ``tcp`` offers seeders the sendfile data plane
            (:mod:`.sendfile_plane`, plaintext, authorized per connection) beside
            ReadSeedData; ``grpc``: ReadSeedData only (every byte inside TLS).
        seed_data_port: ``--seed-data-port``: the data plane's port on ``--listen``'s
            host (0: any free one, logged).
        seed_mooncake: ``--seed-mooncake``: the data plane also stages ranges for
            Mooncake's transfer engine (:mod:`.mooncake_plane`).
    """

    socket: str
    preload: list[PreloadSpec] = field(default_factory=list)
    options: ServiceOptions = field(default_factory=ServiceOptions)
    budget: MemoryBudget = field(default_factory=MemoryBudget)
    access: Access = field(default_factory=Access)
    tcp: TcpListener | None = None
    device: Device = CPU_DEVICE
    grace: float = 1.0
    health_listen: str | None = None
    metrics_listen: str | None = None
    hand_over: bool = False
    argv: list[str] = field(default_factory=list)
    allow_seeding: bool = False
    seed_max_rate: float = 0.0
    seed_plane: str = "tcp"
    seed_data_port: int = 0
    seed_mooncake: bool = False


class Daemon:
    """One daemon: call :meth:`run` from an event loop; :meth:`stop` ends it."""

    def __init__(self, config: DaemonConfig, leases: LeaseTable | None = None) -> None:
        self.config = config
        self.instance_id = uuid.uuid4().hex
        tag = segment_tag(config.socket)
        self._segment_prefix = segment_prefix(tag, self.instance_id)
        self._tag = tag
        # The device is resolved here, once: the store, the cache and server info all read
        # this one Backend.
        self.backend = open_backend(config.device, self._segment_prefix, config.access)
        config.budget.bind(self.backend.available)
        self.store = Store(self.backend.make_arena, config.budget)
        #: How long the event loop was not scheduled; its clock times the leases, so a
        #: daemon that was starved (an overloaded host, SIGSTOP) does not count that time
        #: against leases whose renewals were queued behind it (docs/leases.md).
        self.stalls = StallWatch()
        self.cache = WeightCache(
            self.store,
            leases or LeaseTable(clock=self.stalls.now),
            config.options,
            self.instance_id,
            self.backend,
        )
        # Until every start-up preload is registered, a miss may be a model about to load.
        self.cache.starting = bool(config.preload)
        self.notifier = Notifier.from_env()
        self.health = Health(self.store, on_ready=self._notify_ready)
        self._health_listener = (
            HealthListener(config.health_listen) if config.health_listen else None
        )
        self._metrics_listener: MetricsListener | None = None
        if config.metrics_listen:
            # prometheus-client only for a daemon that serves metrics: about 0.1 s of
            # the start otherwise (issue 39, -X importtime).
            from weightcache_service.metrics import MetricsListener

            self._metrics_listener = MetricsListener(config.metrics_listen)
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._drain_deadline: float | None = None
        #: Names of the models adopted from a predecessor's hand-over.
        self._adopted: set[str] = set()
        #: (st_dev, st_ino) of the socket this daemon bound.
        self._socket_id: tuple[int, int] | None = None
        #: (soft, hard) RLIMIT_NOFILE after raise_fd_limit, for the "started" line.
        self._fd_limit: tuple[int, int] = (0, 0)
        #: Connections each TCP listener may hold (access.tcp_connection_bound).
        self._tcp_bound = 0
        #: The ``--listen`` server: a gRPC server of its own, so that its connection
        #: bound (which gRPC applies per listener, from server-wide options) leaves the
        #: Unix socket unbounded.
        self._tcp_server: grpc.aio.Server | None = None
        #: The seeding data plane's listener (``--allow-seeding``, ``--seed-plane tcp``).
        self._data_plane: SendfileServer | None = None
        #: Why the socket path stopped being this daemon's, once it did.
        self._socket_lost: str | None = None
        self._hand_over_asked = False

    def on_signal(self, signum: int) -> None:
        """A signal of ``signals.STOP``: logged, then :meth:`stop` (a hand-over for SIGTERM
        under ``--hand-over``)."""
        name = signal.Signals(signum).name
        if self._stop.is_set():
            log.warning("received second signal: cutting the drain short", signal=name)
        else:
            log.info("received signal: draining", signal=name, pid=os.getpid())
        self.stop(self.config.hand_over and signum == signal.SIGTERM)

    def stop(self, hand_over: bool = False) -> None:
        """Ask the daemon to drain and shut down, or (``hand_over``, on shared memory) to
        leave its arenas and leases to its successor (:meth:`_hand_over`); a second call
        skips the rest of the drain (signal-handler safe)."""
        if self._stop.is_set():
            self._force.set()
        self._hand_over_asked = self._hand_over_asked or hand_over
        self._stop.set()

    async def run(self) -> None:
        """Serve until :meth:`stop`; then free every arena, remove the socket, unlock.

        Raises:
            AccessError: the socket folder, the TCP listener, the health or the metrics
                listener is unusable or unsafe (a malformed or busy address).
            SocketInUseError: another daemon serves the socket.
            SocketLostError: the socket file was removed or replaced, or another process
                took its lock, while the daemon served: it stopped (every health service
                NOT_SERVING first), leaving the path to whoever has it now.
        """
        socket = self.config.socket
        self._fd_limit = raise_fd_limit()  # logged with "started", once the start is safe
        listeners = [self.config.tcp, self.config.health_listen, self.config.metrics_listen]
        self._tcp_bound = tcp_connection_bound(
            self._fd_limit[0], sum(x is not None for x in listeners)
        )
        self.config.access.prepare_folder(socket)
        lock = SocketLock(socket)
        try:
            await asyncio.to_thread(self._adopt, socket)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket)  # we hold the lock: whoever bound it is gone
            server = await self._start_server(socket)
            # Only now the scan of /dev/shm for what dead daemons left (slow on a busy host
            # with many segments): adopted leases are renewed by KeepAlive from the moment
            # the server starts, so that a hand-over loses none at the default TTL (issue
            # 39). Adopted segments were renamed to this daemon's prefix already, and new
            # ones carry it: the scan removes neither.
            await asyncio.to_thread(self._clean_after_predecessor)
            try:
                await self._start_listeners()
                await self._serve(lock)
            finally:
                await self._shutdown(server)
        finally:
            # Only our own socket: a path taken over by another daemon stays its.
            if self._socket_id is None or self._socket_problem(None) is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(socket)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_bind_path(socket))  # a start that failed before the rename
            lock.release()
        if self._socket_lost is not None:
            raise SocketLostError(f"socket {socket}: {self._socket_lost}; stopped")

    def _socket_problem(self, lock: SocketLock | None) -> str | None:
        """Why the socket path is no longer this daemon's (None: it is): the file gone or
        replaced, or (with ``lock``) its lock file held by another process."""
        try:
            st = os.stat(self.config.socket, follow_symlinks=False)
        except FileNotFoundError:
            return "the socket file was removed"
        if (st.st_dev, st.st_ino) != self._socket_id:
            return "the socket path names another file"
        if lock is not None and not lock.keep():
            return "another process holds the socket's lock file"
        return None

    async def _watch_socket(self, lock: SocketLock) -> None:
        """Stop when the socket path is no longer ours: workers cannot reach us there, so
        every health service turns NOT_SERVING (liveness too) and the daemon exits with
        an error, for its supervisor to start it again."""
        while True:
            await asyncio.sleep(SOCKET_CHECK_INTERVAL)
            why = self._socket_problem(lock)
            if why is not None:
                self._socket_lost = why
                log.error("socket lost: stopping", socket=self.config.socket, why=why)
                await self.health.shutdown()
                self.stop()
                return

    def _adopt(self, socket: str) -> None:
        """Adopt what a predecessor handed over (:mod:`.handover`): each model whose
        manifest entry, segment and checkpoint check out, with its leases; what does not is
        logged and left to :meth:`_clean_after_predecessor`, which removes it."""
        path = manifest_path(socket)
        refused: list[str] = []
        try:
            held = read_manifest(path, refused)
        except HandOverRefusedError as exc:
            log.error("hand-over refused: adopting nothing", manifest=path, why=str(exc))
            return
        for why in refused:
            log.error("hand-over: model not adopted", manifest=path, why=why)
        if held is None:
            return
        access = self.config.access
        for model in held:
            try:
                if self.backend.name != "cpu_shm":
                    raise HandOverRefusedError(f"backend {self.backend.name} adopts no segment")
                check_segment(model, self._tag)
                new_path = os.path.join(SHM_DIR, segment_name(self._segment_prefix))
                entry = self.cache.adopt(
                    model,
                    functools.partial(
                        _adopt_arena, model.segment, new_path=new_path, access=access
                    ),
                )
            except (HandOverRefusedError, WeightCacheError, OSError) as exc:
                log.error("hand-over: model not adopted", model=model.name, why=str(exc))
                continue
            self._adopted.add(entry.name)
            log.info(
                "adopted",
                model=entry.name,
                bytes=entry.size,
                leases=len(model.leases),
                fingerprint=entry.fingerprint.digest[:16],
            )

    async def _hand_over(self) -> None:
        """Stop for a restart: refuse new leases, leave every READY arena in place with a
        manifest (:func:`handover.write_manifest`) naming it and its leases, and tell every
        KeepAlive stream to reconnect to the successor. Without shared memory (a GPU,
        whose memory dies with the process) it drains instead."""
        if self.backend.name != "cpu_shm":
            log.warning("hand-over needs shared memory: draining instead")
            await self._drain()
            return
        self.cache.draining = True
        self.notifier.send("STOPPING=1", "STATUS=handing over")
        await self.health.draining()
        held = []
        originals = []
        for model in self.cache.handed_over():
            # Renamed to a name no clean-up of dead daemons' segments removes.
            renamed = os.path.join(SHM_DIR, handover_name(self._tag))
            os.rename(model.segment, renamed)
            held.append(dataclasses.replace(model, segment=renamed))
            originals.append(model.segment)
        path = manifest_path(self.config.socket)
        try:
            await asyncio.to_thread(write_manifest, path, self.instance_id, held)
        except OSError as exc:
            log.error("cannot write the hand-over manifest: draining", why=str(exc))
            # Back to their own names, so that the drain frees them (issue 37, item 7:
            # they stayed in /dev/shm under hand-over names nobody would adopt).
            for model, original in zip(held, originals, strict=True):
                os.rename(model.segment, original)
            await self._drain()
            return
        for model in held:
            self.store.detach(model.name)
        self.cache.announce_hand_over()
        log.info(
            "handed over",
            manifest=path,
            models=len(held),
            leases=sum(len(m.leases) for m in held),
        )

    def _clean_after_predecessor(self) -> None:
        # /dev/shm is everyone's: whatever is there is checked, and what is not ours to
        # remove is skipped and logged, never fatal (SECURITY.md).
        skipped: list[Skipped] = []
        try:
            stale, skipped = remove_stale_segments(self._tag, self._segment_prefix)
            # Dead daemons of other sockets too: a crash followed by a restart elsewhere
            # must not leave its memory behind for good.
            dead = remove_dead_segments(skipped=skipped)
        except OSError as exc:
            log.warning("cannot look for dead daemons' segments", error=str(exc))
            stale, dead = [], []
        for path in stale:
            log.warning("removed a dead daemon's segment", path=path)
        for segment in dead:
            log.warning("removed a dead daemon's segment", path=segment.path, pid=segment.pid)
        for entry in dict.fromkeys(skipped):
            log.warning("skipped a segment name that is not ours", path=entry.path, why=entry.why)

    def _grpc_server(
        self, servicer: WeightCacheServicer, connection_options: list[tuple[str, int]]
    ) -> grpc.aio.Server:
        """A gRPC server with every service, the interceptors and the given connection
        options (the Unix socket's and ``--listen``'s differ only by those)."""
        tcp = self.config.tcp
        policy = replace(tcp.policy if tcp else Policy(), allow_seeding=self.config.allow_seeding)
        server = grpc.aio.server(
            # Outermost first: a peer is authorized before its request is even judged.
            interceptors=[
                AuthorizationInterceptor(policy),
                StatusGuard(f"/{SERVICE_NAME}/"),
            ],
            options=[
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
                ("grpc.so_reuseport", 0),
                *connection_options,
            ],
        )
        pb_grpc.add_WeightCacheServiceServicer_to_server(servicer, server)
        register_raw_seed_data(server, servicer)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        _enable_reflection(server)
        return server

    async def _start_server(self, socket: str) -> grpc.aio.Server:
        # Bound under a name of its own, then renamed into place: gRPC unlinks the path it
        # bound when the server stops, and by then the socket path may be another
        # daemon's (ours was removed or replaced: _watch_socket). Each accepted
        # connection keeps the bound name (getsockname), which is how the servicer
        # tells its connections from others (.peers).
        bound = _bind_path(socket)
        seeds = SeedServer(self.cache, self.config.seed_max_rate)
        servicer = WeightCacheServicer(self.cache, bound, seeds=seeds)
        server = self._grpc_server(servicer, CONNECTION_OPTIONS)
        if self.config.tcp is not None:
            tcp_server = self._grpc_server(servicer, tcp_server_options(self._tcp_bound))
            port = self.config.tcp.bind(tcp_server)
            await tcp_server.start()
            self._tcp_server = tcp_server
            log.info(
                "listening on tcp",
                address=self.config.tcp.address,
                port=port,
                max_connections=self._tcp_bound,
            )
            if self.config.allow_seeding and self.config.seed_plane != "grpc":
                from weightcache_service.sendfile_serve import SendfileServer

                host, _ = parse_listen(self.config.tcp.address)
                stager = None
                if self.config.seed_mooncake:
                    from weightcache_service.mooncake_plane import MooncakeStager

                    stager = MooncakeStager()
                plane = SendfileServer(seeds, host, self.config.seed_data_port, stager)
                try:
                    data_port = await plane.start()
                except OSError as exc:
                    await tcp_server.stop(0)
                    raise AccessError(f"cannot bind the seed data plane: {exc}") from None
                self._data_plane = servicer.data_plane = plane
                log.info("listening for seed data", address=host, port=data_port)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where it is wider
        try:
            server.add_insecure_port(target(bound))
            await server.start()
        except BaseException:
            if self._tcp_server is not None:
                await self._tcp_server.stop(0)
            raise
        finally:
            os.umask(old_umask)
        self.config.access.secure_path(bound, self.config.access.socket_mode)
        st = os.stat(bound, follow_symlinks=False)
        if bound != socket:
            os.rename(bound, socket)
        self._socket_id = (st.st_dev, st.st_ino)
        await self.health.bound()
        log.info("listening", socket=socket, instance=self.instance_id[:12], pid=os.getpid())
        env = self.cache.environment
        log.info(
            "started",
            version=env.weightcache_version,
            torch=env.torch_version,
            backend=env.backend,
            device=self.backend.device,
            device_uuid=env.device_uuid,
            models=[spec.path for spec in self.config.preload],
            required=[spec.path for spec in self.config.preload if spec.required],
            argv=self.config.argv,
            fd_limit=self._fd_limit[0],
            tcp_max_connections=self._tcp_bound,
        )
        return server

    async def _start_listeners(self) -> None:
        """The optional health-only and metrics listeners (a bind failure stops the start:
        an operator who asked for probes must not get a daemon without them)."""
        if self._health_listener is not None:
            await self._health_listener.start(self.health, self._tcp_bound)
        if self._metrics_listener is not None:
            from weightcache_service.metrics import Metrics

            metrics = Metrics(
                self.cache, asyncio.get_running_loop(), ready=lambda: self.health.ready
            )
            await asyncio.to_thread(self._metrics_listener.start, metrics, self._tcp_bound)

    async def _stop_listeners(self) -> None:
        if self._health_listener is not None:
            await self._health_listener.stop()
        if self._metrics_listener is not None:
            await asyncio.to_thread(self._metrics_listener.stop)

    def _notify_ready(self) -> None:
        models = sum(1 for e in self.store.entries() if e.state == "ready")
        self.notifier.send("READY=1", f"STATUS=serving {models} model(s)", f"MAINPID={os.getpid()}")

    async def _extend_start(self) -> None:
        # Loading a large checkpoint may outlast TimeoutStartSec=: while start-up preloads
        # run, ask systemd for more time (sd_notify(3), EXTEND_TIMEOUT_USEC). Once they have
        # ended without READY (a required model failed), the unit's own timeout applies.
        while not self.health.preloads_ended:
            self.notifier.send(f"EXTEND_TIMEOUT_USEC={int(START_EXTENSION * 1e6)}")
            await asyncio.sleep(START_EXTENSION / 3)

    async def _watchdog_forever(self, interval: float) -> None:
        # Sent from the event loop: a loop that stops turning stops the pings.
        while True:
            self.notifier.send("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def _serve(self, lock: SocketLock) -> None:
        tasks = [
            asyncio.create_task(self._watch_stalls()),
            asyncio.create_task(self._watch_socket(lock)),
            asyncio.create_task(self._reap_forever()),
            asyncio.create_task(self._preload_startup()),
            asyncio.create_task(self.health.watch()),
        ]
        if (interval := self.notifier.watchdog_interval) is not None:
            tasks.append(asyncio.create_task(self._watchdog_forever(interval)))
        if self.notifier.address is not None:
            tasks.append(asyncio.create_task(self._extend_start()))
        try:
            await self._stop.wait()
            if self._hand_over_asked:
                await self._hand_over()
            else:
                await self._drain()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _drain(self) -> None:
        """Refuse new leases, push REVOKING to every holder, and wait until they have all
        taken note or the drain timeout has passed (or a second signal came). A holder
        has taken note when it released, or (shared memory, where the revoke unlinked the
        segment under its mapping: :meth:`.Revocation._revoke`) renewed the revoked
        lease, keeping its mapping: then nothing more is waited for."""
        self.cache.draining = True
        self.notifier.send("STOPPING=1", "STATUS=draining")
        await self.health.draining()
        live = len(self.cache.leases)
        if not live:
            return
        self.cache.revoke_all()
        timeout = self.config.options.drain_timeout
        log.info("draining", leases=live, timeout=timeout)
        loop = asyncio.get_running_loop()
        deadline = self._drain_deadline = loop.time() + timeout
        leases = self.cache.leases
        while leases.unsettled() and loop.time() < deadline and not self._force.is_set():
            await asyncio.sleep(0.05)
        log.info("drained", leases_left=leases.unsettled(), leases_kept=len(leases))

    async def _watch_stalls(self) -> None:
        # Beats from the event loop: a loop that does not turn stops the lease clock.
        try:
            while True:
                stall = self.stalls.beat(STALL_BEAT)
                if stall >= STALL_LOGGED:
                    log.warning(
                        "event loop stalled: lease times extended",
                        seconds=round(stall, 3),
                        leases=len(self.cache.leases),
                    )
                await asyncio.sleep(STALL_BEAT)
        finally:
            self.stalls.beat(None)  # no more beats: the lease clock runs on

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            self.cache.reap()

    async def _preload_startup(self) -> None:
        cfg = self.config
        tasks = []
        required: list[Entry] = []
        for spec in cfg.preload:
            try:
                entry, task = await self.cache.begin_load(
                    spec.path,
                    spec.recipe,
                    spec.placement,
                    spec.fingerprint_level,
                    name=spec.name,
                    seed_from=spec.seed_from,
                )
                tasks.append(task)
                if spec.required:
                    self.health.require(entry.name)
                    required.append(entry)
            except ModelExistsError as err:
                if err.metadata.get("model") in self._adopted:
                    # The usual restart: the predecessor handed it over (issue 37, item 18:
                    # this was a warning at every such restart).
                    log.info("already held: adopted", path=spec.path, model=err.metadata["model"])
                else:
                    log.warning("already held", path=spec.path, error=err.detail)
                if spec.required and "model" in err.metadata:
                    self.health.require(err.metadata["model"])
            except Exception as err:
                # Never let one model stop the others or leave health NOT_SERVING forever:
                # it is required under its FAILED name, until loaded again or evicted.
                if isinstance(err, WeightCacheError):
                    log.error("cannot preload", path=spec.path, reason=err.reason, error=err.detail)
                else:
                    log.exception("cannot preload", path=spec.path, error=repr(err))
                # A model refused for lack of memory stays listed (FAILED): counted below.
                if not isinstance(err, ResourceExhaustedError):
                    refused: str | None = self.cache.refuse(
                        spec.path,
                        spec.recipe,
                        spec.placement,
                        spec.fingerprint_level,
                        err,
                        name=spec.name,
                    ).name
                else:
                    refused = self._failed_name(spec.path)
                if spec.required:
                    # A name no model takes, if none was kept: never ready, as before.
                    self.health.require(refused or f"{spec.path} (refused)")
        self.cache.starting = False
        await asyncio.gather(*(asyncio.shield(task) for task in tasks), return_exceptions=True)
        for entry in required:
            # A copy of another start-up model, found so once hashed: require the one held,
            # as when the duplicate is refused at admission (above).
            if isinstance(entry.failure, ModelExistsError) and "model" in entry.failure.metadata:
                self.health.require_instead(entry.name, entry.failure.metadata["model"])
        await self.health.started()
        if not self.health.ready:
            self.notifier.send(f"STATUS={self._not_ready_status()}")
        entries = self.store.entries()
        ready = [e for e in entries if e.state == "ready"]
        failed = len(self.store.refusals) + len(entries) - len(ready)
        (log.error if failed else log.info)(
            "ready",
            socket=cfg.socket,
            models=len(ready),
            failed=failed,
            bytes=self.store.held_bytes(),
        )

    def _failed_name(self, path: str) -> str | None:
        """The name of the FAILED model a start-up preload of ``path`` left (refused for
        lack of memory), if any."""
        real = Path(os.path.realpath(path))
        names = [e.name for e in self.store.entries() if e.state == "failed"]
        return next((n for n in names if self.store.get(n).checkpoint.root == real), None)

    def _not_ready_status(self) -> str:
        """systemd's STATUS= once start-up ended without readiness: the models that are not
        READY and why (``systemctl status`` shows it while the unit waits, instead of a
        silent start; the unit's TimeoutStartSec= then applies)."""
        failed = [f"{m.name}: {m.error}" for m in self.cache.models() if m.state == "failed"]
        if not failed:
            return "not ready: start-up ended, a required model is not READY"
        return f"not ready: {len(failed)} model(s) FAILED: {'; '.join(failed)}"[:1000]

    def _grace(self) -> float:
        """Seconds in-flight RPCs get: ``config.grace``, but never past the end of the
        drain timeout (a KeepAlive stream of a holder that never reads would otherwise
        hold the exit for the whole grace)."""
        if self._drain_deadline is None:
            return self.config.grace
        left = self._drain_deadline - asyncio.get_running_loop().time()
        return min(self.config.grace, max(0.0, left))

    async def _shutdown(self, server: grpc.aio.Server) -> None:
        log.info("shutting down", leases=len(self.cache.leases))
        self.cache.draining = True
        await self.health.shutdown()
        self.cache.close_sessions()
        grace = self._grace()
        if self._data_plane is not None:
            await self._data_plane.stop()
        await asyncio.gather(
            server.stop(grace), *([self._tcp_server.stop(grace)] if self._tcp_server else [])
        )
        await self._stop_listeners()
        await self.cache.wait_loads()
        self.store.close()
        log.info("stopped")


#: Server reflection's stable name. grpcio-reflection serves only ``v1alpha``, whose
#: messages ``v1`` repeats field for field under another package (grpc/grpc-proto,
#: ``grpc/reflection/v1/reflection.proto``): the same servicer answers both.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
#: The name grpcio-reflection serves (``reflection.SERVICE_NAME``).
REFLECTION_V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
#: The one method of both.
_REFLECTION_METHODS = frozenset(
    f"/{service}/ServerReflectionInfo" for service in (REFLECTION_V1, REFLECTION_V1ALPHA)
)


class _Reflection(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """Server reflection as ``grpc.reflection.v1`` (what grpcurl and current clients ask
    first) and ``v1alpha`` (older ones), with grpcio-reflection imported at the first
    reflection call instead of at start: it imports protobuf's ``descriptor_pb2``, about
    0.1 s of a daemon's start on a 2-CPU VM, for a service only tools use (issue 39)."""

    def __init__(self, services: tuple[str, ...]) -> None:
        self._services = services
        self._handler: grpc.RpcMethodHandler | None = None  # type: ignore[type-arg]

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:  # type: ignore[type-arg]
        """The reflection method's handler, or None for any other method."""
        if handler_call_details.method not in _REFLECTION_METHODS:
            return None
        if self._handler is None:
            from grpc_reflection.v1alpha import reflection, reflection_pb2

            # reflection.aio is public (enable_server_reflection uses it), not in __all__.
            servicer = reflection.aio.ReflectionServicer(self._services)  # type: ignore[attr-defined]
            self._handler = grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        return self._handler


def _enable_reflection(server: grpc.aio.Server) -> None:
    """Serve server reflection, v1 and v1alpha (:class:`_Reflection`)."""
    services = (
        SERVICE_NAME,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        REFLECTION_V1,
        REFLECTION_V1ALPHA,
    )
    server.add_generic_rpc_handlers((_Reflection(services),))


def _adopt_arena(segment: str, size: int, *, new_path: str, access: Access) -> SharedMemoryArena:
    """:meth:`SharedMemoryArena.adopt` with this daemon's segment mode and group."""
    return SharedMemoryArena.adopt(segment, size, new_path, access.segment_mode, access.gid)


def _bind_path(socket: str) -> str:
    """Where to bind before renaming onto ``socket``: ``.<socket name>.<pid>`` beside it, or
    ``socket`` itself when that name would be too long for a Unix socket."""
    folder, name = os.path.split(socket)
    bound = os.path.join(folder, f".{name}.{os.getpid()}")
    return bound if len(os.fsencode(bound)) <= MAX_SOCKET_PATH else socket


def run_daemon(config: DaemonConfig) -> None:
    """Run a daemon in the foreground until SIGTERM, SIGINT, SIGQUIT or SIGXCPU (what each
    signal does: :mod:`weightcache_service.signals`).

    Raises:
        AccessError: the socket folder or the TCP listener is unusable or unsafe.
        DeviceError: ``config.device`` names no usable device.
        SocketInUseError: another daemon serves the socket.
        SocketLostError: the socket path stopped being this daemon's while it served.
    """

    async def main() -> None:
        daemon = Daemon(config)
        loop = asyncio.get_running_loop()
        signals.install(loop, daemon.on_signal, lambda: daemon.stop(True))
        await daemon.run()

    asyncio.run(main())


def model_roots(paths: list[str]) -> list[Path]:
    """Resolve ``--model-root`` folders with realpath."""
    return [Path(os.path.realpath(p)) for p in paths]
