"""Prometheus metrics of one daemon (``--metrics-listen HOST:PORT``, path ``/metrics``).

Each daemon has its own :class:`~prometheus_client.CollectorRegistry` (never the process's
global one), so that several daemons in one process, as in tests, do not mix. Counters
and the acquire histogram are fed by the cache's events (:class:`CacheEvents`); gauges are
read at scrape time from a snapshot taken on the event loop (the HTTP server answers on
its own thread, and the cache's tables belong to the loop).

| metric | type | labels | meaning |
|---|---|---|---|
| ``weightcache_models`` | gauge | ``state`` | models by state (loading, ready, failed, evicting) |
| ``weightcache_memory_held_bytes`` | gauge | | bytes of arenas held |
| ``weightcache_memory_unlinked_bytes`` | gauge | | bytes of revoked arenas still mapped (3) |
| ``weightcache_unlinked_arenas`` | gauge | | such arenas |
| ``weightcache_memory_budget_bytes`` | gauge | | the arena budget (``+Inf`` when unlimited) |
| ``weightcache_leases_active`` | gauge | | live leases |
| ``weightcache_model_state`` | gauge | ``model``, ``state`` | 1 for its state, 0 for others (4) |
| ``weightcache_model_bytes`` | gauge | ``model`` | the model's arena size in bytes (0: none held) |
| ``weightcache_model_leases`` | gauge | ``model`` | live leases on the model |
| ``weightcache_ready`` | gauge | | 1 while readiness is SERVING, else 0 |
| ``weightcache_acquires_total`` | counter | ``result``, ``reason`` | Acquire RPCs (1) |
| ``weightcache_acquire_duration_seconds`` | histogram | | Acquire latency in the daemon |
| ``weightcache_preloads_total`` | counter | ``result``, ``reason`` | preloads (2) |
| ``weightcache_preload_bytes_total`` | counter | | bytes of models loaded READY |
| ``weightcache_preload_seconds_total`` | counter | | seconds spent loading them |
| ``weightcache_lease_expiries_total`` | counter | | leases ended by their TTL |
| ``weightcache_lease_revocations_total`` | counter | | leases revoked (forced evict, drain) |
| ``weightcache_daemon_info`` | gauge | ``version``, ``backend``, ``device_uuid`` | 1 |
| ``process_*`` | | | prometheus-client's ``ProcessCollector``: RSS, CPU, start time, fds |

(1) ``result`` ``granted`` (``reason`` empty), ``refused`` (``reason`` the error's: the
worker falls back to disk, or raises), ``probe_missed``: an Acquire by file identity that
found no model loaded from those files (``MODEL_NOT_FOUND``, ``FINGERPRINT_MISMATCH``),
which the SDK follows with an Acquire by fingerprint (docs/protocol.md), or ``waiting``: a
``MODEL_LOADING`` refusal of an Acquire that says it asks again
(``AcquireRequest.asks_again_if_loading``: the SDK before its ``wait_timeout``). Neither
of the last two is a fallback: one load counts at most one ``granted`` or one ``refused``.
(2) ``result``: loads ended ``ready`` or ``failed``, or ``refused``: a start-up model or
a Preload RPC refused before its load began (missing or malformed checkpoint, recipe,
memory budget); ``reason`` the error's (empty for ``ready``).
(3) Arenas revoked on shared memory: unlinked, but mapped by workers whose revoked leases
have not ended yet; counted against the budget.
(4) One series per model listed (``weightcache ls``: held, loading, FAILED) and state
(loading, ready, failed, evicting); ``model`` is its name (a Hub repo id's ``org/name``
for a model loaded from one). A model evicted leaves the exposition.
"""

from __future__ import annotations

import asyncio
import errno
import math
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, get_args
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    make_wsgi_app,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from weightcache.core.records import ModelState
from weightcache_service.access import MAX_TCP_CONNECTIONS, AccessError, parse_listen
from weightcache_service.cache import WeightCache
from weightcache_service.events import CacheEvents
from weightcache_service.store import Entry

log = structlog.get_logger("weightcache.daemon")

#: Acquire takes well under a millisecond when it hits: finer buckets than the default.
ACQUIRE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.5)
#: Seconds a scrape waits for the event loop's snapshot.
SNAPSHOT_TIMEOUT = 5.0


@dataclass(frozen=True)
class Snapshot:
    """The gauges' values at one instant, taken on the event loop."""

    states: dict[str, int]
    held: int
    budget: int | None
    leases: int
    ready: bool
    unlinked: int = 0
    unlinked_arenas: int = 0
    #: Per model listed: name, state, arena bytes, live leases.
    models: tuple[tuple[str, str, int, int], ...] = ()


class Metrics(CacheEvents):
    """The metrics of one daemon's cache; an event sink the cache calls.

    Args:
        cache: the cache observed (its ``events`` are set to this object).
        loop: the event loop that owns the cache.
        ready: whether readiness is SERVING now (read on the loop at each scrape).
    """

    def __init__(
        self,
        cache: WeightCache,
        loop: asyncio.AbstractEventLoop,
        ready: Callable[[], bool] = lambda: False,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._cache = cache
        self._loop = loop
        self._ready = ready
        self.acquires = Counter(
            "weightcache_acquires",
            "Acquire RPCs by result (granted; refused: the worker falls back; probe_missed, "
            "waiting: it asks again) and refusal reason.",
            ["result", "reason"],
            registry=self.registry,
        )
        self.acquire_seconds = Histogram(
            "weightcache_acquire_duration_seconds",
            "Time the daemon took to answer an Acquire.",
            buckets=ACQUIRE_BUCKETS,
            registry=self.registry,
        )
        self.preloads = Counter(
            "weightcache_preloads",
            "Preloads by result (ready, failed, refused before loading) and reason.",
            ["result", "reason"],
            registry=self.registry,
        )
        self.preload_bytes = Counter(
            "weightcache_preload_bytes", "Bytes of models loaded READY.", registry=self.registry
        )
        self.preload_seconds = Counter(
            "weightcache_preload_seconds",
            "Seconds spent loading the models that became READY.",
            registry=self.registry,
        )
        self.expiries = Counter(
            "weightcache_lease_expiries", "Leases ended by their TTL.", registry=self.registry
        )
        self.revocations = Counter(
            "weightcache_lease_revocations",
            "Leases revoked (forced evict, drain).",
            registry=self.registry,
        )
        self.seeds = Counter(
            "weightcache_seeds",
            "Seeds from a peer by result (seeded; else why the model was loaded from its "
            "files instead: refused, layout, mismatch, transfer, unsupported).",
            ["result"],
            registry=self.registry,
        )
        self.seeded_bytes = Counter(
            "weightcache_seeded_bytes",
            "Bytes pulled from peers into models that became READY seeded.",
            registry=self.registry,
        )
        self.seed_seconds = Counter(
            "weightcache_seed_seconds",
            "Seconds spent seeding from peers (successful or not).",
            registry=self.registry,
        )
        self.registry.register(_Gauges(self))
        # process_* (resident and virtual memory, CPU seconds, start time, open and max
        # file descriptors), as the default registry has them: this registry is our own.
        ProcessCollector(registry=self.registry)
        cache.events = self

    # -- CacheEvents -------------------------------------------------------------------

    def acquired(self, reason: str, seconds: float, result: str = "") -> None:
        """Count an Acquire: ``reason`` empty when granted, else the refusal's reason;
        ``result`` ``probe_missed`` or ``waiting`` for a refusal the worker asks again
        after (:meth:`CacheEvents.acquired`), else ``refused``."""
        result = "granted" if not reason else result or "refused"
        self.acquires.labels(result, reason).inc()
        self.acquire_seconds.observe(seconds)

    def loaded(self, entry: Entry) -> None:
        """Count a load that ended, READY or not."""
        ready = entry.state == "ready"
        reason = "" if ready or entry.failure is None else entry.failure.reason
        self.preloads.labels("ready" if ready else "failed", reason).inc()
        if ready:
            self.preload_bytes.inc(entry.size)
            self.preload_seconds.inc(entry.load_seconds)

    def preload_refused(self, reason: str) -> None:
        """Count a preload refused before its load began."""
        self.preloads.labels("refused", reason).inc()

    def seeded(self, result: str, nbytes: int, seconds: float) -> None:
        """Count a seed attempt: ``result`` (``seeded`` or why not), the ``nbytes`` bytes
        it made READY (0 unless seeded), and its ``seconds``."""
        self.seeds.labels(result).inc()
        self.seeded_bytes.inc(nbytes)
        self.seed_seconds.inc(seconds)

    def lease_expired(self) -> None:
        """Count a lease ended by its TTL."""
        self.expiries.inc()

    def leases_revoked(self, count: int) -> None:
        """Count ``count`` leases revoked at once."""
        self.revocations.inc(count)

    # -- scrape ------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The gauges' values, read on the event loop (call from another thread).

        Raises:
            TimeoutError: the loop did not answer within :data:`SNAPSHOT_TIMEOUT` seconds.
        """

        async def take() -> Snapshot:
            states = dict.fromkeys(get_args(ModelState), 0)
            for entry in self._cache.store.entries():
                states[entry.state] += 1
            states["failed"] += len(self._cache.store.refusals)
            budget = self._cache.store.budget
            unlinked = self._cache.unlinked_arenas()
            return Snapshot(
                states=states,
                held=self._cache.store.held_bytes(),
                budget=budget.limit if budget is not None else None,
                leases=len(self._cache.leases),
                unlinked=sum(arena.size_bytes for arena in unlinked),
                unlinked_arenas=len(unlinked),
                ready=self._ready(),
                models=tuple(
                    (m.name, m.state, m.size_bytes, m.lease_count) for m in self._cache.models()
                ),
            )

        future = asyncio.run_coroutine_threadsafe(take(), self._loop)
        return future.result(SNAPSHOT_TIMEOUT)


class _Gauges(Collector):
    """The gauges, collected at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        # No snapshot at registration (the loop may not run yet): names only.
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._metrics.snapshot()
        models = GaugeMetricFamily("weightcache_models", "Models by state.", labels=["state"])
        for state, count in snap.states.items():
            models.add_metric([state], count)
        yield models
        yield GaugeMetricFamily(
            "weightcache_memory_held_bytes", "Bytes of arenas held.", value=snap.held
        )
        yield GaugeMetricFamily(
            "weightcache_memory_unlinked_bytes",
            "Bytes of revoked arenas unlinked but still mapped by workers.",
            value=snap.unlinked,
        )
        yield GaugeMetricFamily(
            "weightcache_unlinked_arenas",
            "Revoked arenas unlinked but still mapped by workers.",
            value=snap.unlinked_arenas,
        )
        yield GaugeMetricFamily(
            "weightcache_memory_budget_bytes",
            "The arena budget (+Inf: unlimited, no --max-memory).",
            value=math.inf if snap.budget is None else snap.budget,
        )
        yield GaugeMetricFamily("weightcache_leases_active", "Live leases.", value=snap.leases)
        per_state = GaugeMetricFamily(
            "weightcache_model_state",
            "1 for each model's state (loading, ready, failed, evicting), 0 for the others.",
            labels=["model", "state"],
        )
        size = GaugeMetricFamily(
            "weightcache_model_bytes", "Each model's arena size.", labels=["model"]
        )
        leases = GaugeMetricFamily(
            "weightcache_model_leases", "Live leases on each model.", labels=["model"]
        )
        for name, current, nbytes, count in snap.models:
            for each in get_args(ModelState):
                per_state.add_metric([name, each], int(each == current))
            size.add_metric([name], nbytes)
            leases.add_metric([name], count)
        yield from (per_state, size, leases)
        yield GaugeMetricFamily(
            "weightcache_ready",
            "1 while readiness is SERVING (every required model READY, not draining), else 0.",
            value=int(snap.ready),
        )
        env = self._metrics._cache.environment
        info = GaugeMetricFamily(
            "weightcache_daemon_info",
            "The daemon: version, backend and device UUID (always 1).",
            labels=["version", "backend", "device_uuid"],
        )
        info.add_metric([env.weightcache_version, env.backend, env.device_uuid], 1)
        yield info


#: Seconds a metrics connection may stay silent (no request line, or a request not
#: finished) before the listener closes it.
METRICS_IDLE_TIMEOUT = 5.0


class _QuietHandler(WSGIRequestHandler):
    """One request per connection, no access log; a peer silent for
    :data:`METRICS_IDLE_TIMEOUT` seconds is dropped (the socket's timeout)."""

    timeout = METRICS_IDLE_TIMEOUT

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:  # TimeoutError included: an idle or vanished peer
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing."""


class _BoundedServer(socketserver.ThreadingMixIn, WSGIServer):
    """prometheus-client's threading WSGI server, holding at most ``max_connections``
    connections (threads) at once: one more is closed as soon as it is accepted."""

    daemon_threads = True
    max_connections = MAX_TCP_CONNECTIONS

    def server_bind(self) -> None:
        # An IPv6 wildcard serves IPv4 too (IPv4-mapped), whatever the host's
        # net.ipv6.bindv6only says: as gRPC's listeners do.
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsListener:
    """``--metrics-listen HOST:PORT``: the registry over HTTP (prometheus-client's WSGI
    app, on a thread of its own), one request per connection, at most
    ``max_connections`` connections at once, each closed after
    :data:`METRICS_IDLE_TIMEOUT` seconds of silence.

    Args:
        address: ``HOST:PORT``; port 0 picks a free one.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, metrics: Metrics, max_connections: int = MAX_TCP_CONNECTIONS) -> int:
        """Bind and serve, holding at most ``max_connections`` connections; returns the
        port bound.

        Raises:
            AccessError: ``address`` is not ``HOST:PORT``, its port is above 65535, or it
                cannot be bound.
        """
        host, port = parse_listen(self.address, "--metrics-listen")

        class Server(_BoundedServer):
            pass

        Server.max_connections = max_connections
        try:
            self._server = self._bind(host, port, metrics, Server)
        except OSError as exc:
            raise AccessError(f"--metrics-listen {self.address}: cannot bind: {exc}") from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="weightcache-metrics", daemon=True
        )
        self._thread.start()
        bound = int(self._server.server_port)
        log.info("metrics listening", address=self.address, port=bound)
        return bound

    @staticmethod
    def _bind(host: str, port: int, metrics: Metrics, server: type[WSGIServer]) -> WSGIServer:
        """The server bound to ``host``'s address family, as prometheus-client's
        start_http_server does, except that ``0.0.0.0`` and ``::`` both mean every
        interface of both families (IPv6, and IPv4 as IPv4-mapped addresses), as they do for gRPC's
        ``--listen`` and ``--health-listen``; ``0.0.0.0`` binds IPv4 only on a host without
        IPv6.

        Raises:
            OSError: it cannot be bound.
        """
        if host == "0.0.0.0" and socket.has_ipv6:
            try:
                return MetricsListener._bind("::", port, metrics, server)
            except OSError as exc:
                if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                    raise
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        server.address_family = family
        return make_server(
            str(sockaddr[0]),
            port,
            make_wsgi_app(metrics.registry),
            server,
            handler_class=_QuietHandler,
        )

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()
