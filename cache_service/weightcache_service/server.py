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
import os
import signal
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from weightcache.core.errors import ModelExistsError, ResourceExhaustedError, WeightCacheError
from weightcache.core.fingerprint import DEFAULT_LEVEL, Level
from weightcache.core.recipe import Placement, Recipe
from weightcache.core.rpc import MAX_RESPONSE_BYTES, SERVICE_NAME, target
from weightcache.core.sockets import segment_tag
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc
from weightcache_service.access import Access, AccessError, is_loopback, parse_listen
from weightcache_service.arena import remove_stale_segments
from weightcache_service.authz import AuthorizationInterceptor, Policy
from weightcache_service.backend import CPU_DEVICE, Device, open_backend
from weightcache_service.budget import MemoryBudget
from weightcache_service.cache import ServiceOptions, WeightCache
from weightcache_service.guard import StatusGuard
from weightcache_service.health import Health, HealthListener
from weightcache_service.leases import LeaseTable
from weightcache_service.metrics import Metrics, MetricsListener
from weightcache_service.notify import Notifier
from weightcache_service.segments import remove_dead_segments, segment_prefix
from weightcache_service.servicer import WeightCacheServicer
from weightcache_service.socket_lock import SocketLock
from weightcache_service.store import Entry, Store

log = structlog.get_logger("weightcache.daemon")

REAP_INTERVAL = 0.2
#: Seconds each ``EXTEND_TIMEOUT_USEC`` gives systemd's start timeout while start-up
#: preloads run; sent every third of it.
START_EXTENSION = 60.0
#: Largest request accepted: requests carry ids, paths and a fingerprint, never data.
MAX_REQUEST_BYTES = 4 * 2**20


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
    ``required``: the daemon is not ready (health ``readiness``) until it is READY."""

    path: str
    recipe: Recipe = field(default_factory=Recipe)
    placement: Placement = field(default_factory=Placement)
    fingerprint_level: Level = DEFAULT_LEVEL
    required: bool = True


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
        argv: the command line it was started with (logged at start).
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
    argv: list[str] = field(default_factory=list)


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
        self.cache = WeightCache(
            self.store, leases or LeaseTable(), config.options, self.instance_id, self.backend
        )
        # Until every start-up preload is registered, a miss may be a model about to load.
        self.cache.starting = bool(config.preload)
        self.notifier = Notifier.from_env()
        self.health = Health(self.store, on_ready=self._notify_ready)
        self._health_listener = (
            HealthListener(config.health_listen) if config.health_listen else None
        )
        self._metrics_listener = (
            MetricsListener(config.metrics_listen) if config.metrics_listen else None
        )
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._drain_deadline: float | None = None

    def on_signal(self, signum: int) -> None:
        """A SIGTERM or SIGINT: logged, then :meth:`stop`."""
        name = signal.Signals(signum).name
        if self._stop.is_set():
            log.warning("received second signal: cutting the drain short", signal=name)
        else:
            log.info("received signal: draining", signal=name, pid=os.getpid())
        self.stop()

    def stop(self) -> None:
        """Ask the daemon to drain and shut down; a second call skips the rest of the
        drain (signal-handler safe)."""
        if self._stop.is_set():
            self._force.set()
        self._stop.set()

    async def run(self) -> None:
        """Serve until :meth:`stop`; then free every arena, remove the socket, unlock.

        Raises:
            AccessError: the socket folder, the TCP listener, the health or the metrics
                listener is unusable or unsafe (a malformed or busy address).
            SocketInUseError: another daemon serves the socket.
        """
        socket = self.config.socket
        self.config.access.prepare_folder(socket)
        lock = SocketLock(socket)
        try:
            self._clean_after_predecessor(socket)
            server = await self._start_server(socket)
            try:
                await self._start_listeners()
                await self._serve()
            finally:
                await self._shutdown(server)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket)
            lock.release()

    def _clean_after_predecessor(self, socket: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket)  # we hold the lock: whoever bound it is gone
        for path in remove_stale_segments(self._tag, self._segment_prefix):
            log.warning("removed a dead daemon's segment", path=path)
        # Dead daemons of other sockets too: a crash followed by a restart elsewhere must
        # not leave its memory behind for good.
        try:
            dead = remove_dead_segments()
        except OSError as exc:
            log.warning("cannot look for dead daemons' segments", error=str(exc))
            dead = []
        for segment in dead:
            log.warning("removed a dead daemon's segment", path=segment.path, pid=segment.pid)

    async def _start_server(self, socket: str) -> grpc.aio.Server:
        tcp = self.config.tcp
        server = grpc.aio.server(
            # Outermost first: a peer is authorized before its request is even judged.
            interceptors=[
                AuthorizationInterceptor(tcp.policy if tcp else Policy()),
                StatusGuard(f"/{SERVICE_NAME}/"),
            ],
            options=[
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_WeightCacheServiceServicer_to_server(
            WeightCacheServicer(self.cache, socket), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where it is wider
        try:
            server.add_insecure_port(target(socket))
            if self.config.tcp is not None:
                port = self.config.tcp.bind(server)
                log.info("listening on tcp", address=self.config.tcp.address, port=port)
            await server.start()
        finally:
            os.umask(old_umask)
        self.config.access.secure_path(socket, self.config.access.socket_mode)
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
        )
        return server

    async def _start_listeners(self) -> None:
        """The optional health-only and metrics listeners (a bind failure stops the start:
        an operator who asked for probes must not get a daemon without them)."""
        if self._health_listener is not None:
            await self._health_listener.start(self.health)
        if self._metrics_listener is not None:
            metrics = Metrics(
                self.cache, asyncio.get_running_loop(), ready=lambda: self.health.ready
            )
            await asyncio.to_thread(self._metrics_listener.start, metrics)

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

    async def _serve(self) -> None:
        tasks = [
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
            await self._drain()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _drain(self) -> None:
        """Refuse new leases, push REVOKING to every holder, and wait until they have all
        released or the drain timeout has passed (or a second signal came)."""
        self.cache.draining = True
        self.notifier.send("STOPPING=1", "STATUS=draining")
        await self.health.draining()
        live = self.cache.revoke_all()
        if not live:
            return
        timeout = self.config.options.drain_timeout
        log.info("draining", leases=live, timeout=timeout)
        loop = asyncio.get_running_loop()
        deadline = self._drain_deadline = loop.time() + timeout
        while len(self.cache.leases) and loop.time() < deadline and not self._force.is_set():
            await asyncio.sleep(0.05)
        log.info("drained", leases_left=len(self.cache.leases))

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
                    spec.path, spec.recipe, spec.placement, spec.fingerprint_level
                )
                tasks.append(task)
                if spec.required:
                    self.health.require(entry.name)
                    required.append(entry)
            except ModelExistsError as err:
                log.warning("already held", path=spec.path, error=err.detail)
                if spec.required and "model" in err.metadata:
                    self.health.require(err.metadata["model"])
            except WeightCacheError as err:
                if spec.required:
                    self.health.refused()
                # A model refused for lack of memory stays listed (FAILED): counted below.
                if not isinstance(err, ResourceExhaustedError):
                    self.cache.refuse(
                        spec.path, spec.recipe, spec.placement, spec.fingerprint_level, err
                    )
                log.error("cannot preload", path=spec.path, reason=err.reason, error=err.detail)
            except Exception as err:
                # Never let one model stop the others or leave health NOT_SERVING forever.
                if spec.required:
                    self.health.refused()
                log.exception("cannot preload", path=spec.path, error=repr(err))
                self.cache.refuse(
                    spec.path, spec.recipe, spec.placement, spec.fingerprint_level, err
                )
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
        await server.stop(self._grace())
        await self._stop_listeners()
        await self.cache.wait_loads()
        self.store.close()
        log.info("stopped")


def run_daemon(config: DaemonConfig) -> None:
    """Run a daemon in the foreground until SIGTERM or SIGINT.

    Raises:
        AccessError: the socket folder or the TCP listener is unusable or unsafe.
        DeviceError: ``config.device`` names no usable device.
        SocketInUseError: another daemon serves the socket.
    """

    async def main() -> None:
        daemon = Daemon(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.on_signal, sig)
        await daemon.run()

    asyncio.run(main())


def model_roots(paths: list[str]) -> list[Path]:
    """Resolve ``--model-root`` folders with realpath."""
    return [Path(os.path.realpath(p)) for p in paths]
