"""The daemon's health (``grpc.health.v1``): liveness, readiness, start-up, and the
health-only listener for Kubernetes ``grpc:`` probes.

Services, as the gRPC health protocol lets a server name several:

- ``liveness`` (:data:`LIVENESS`): SERVING from bind to shutdown. It is answered by the
  event loop that serves every RPC, so an answer at all means the loop runs.
- ``readiness`` (:data:`READINESS`) and ``""``: SERVING once the start-up preloads have
  ended and every *required* model is READY, and while it stays so; NOT_SERVING before,
  after a required model failed or was refused (for good: a restart retries), after one
  was evicted, and from the start of a drain.
- ``weightcache.v1.WeightCacheService`` (:data:`~weightcache.core.rpc.SERVICE_NAME`):
  SERVING once every start-up preload has ended, successfully or not; NOT_SERVING from the
  start of a drain. The test harness waits on it: a daemon whose preload fails on purpose
  still ends its start-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]

from weightcache.core.rpc import LIVENESS, READINESS, SERVICE_NAME
from weightcache_service.access import (
    MAX_TCP_CONNECTIONS,
    AccessError,
    parse_listen,
    tcp_server_options,
)
from weightcache_service.store import Store

log = structlog.get_logger("weightcache.daemon")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: Seconds between re-evaluations of readiness (a required model evicted, a drain).
WATCH_INTERVAL = 0.2


class HealthServicer(health_aio.HealthServicer):  # type: ignore[misc]
    """grpcio-health-checking's asyncio servicer, with a ``Watch`` that writes outside
    the service's lock.

    The library's ``Watch`` holds the service's ``asyncio.Condition`` while it writes to
    the stream; a client that opened a zero HTTP/2 flow-control window never lets that
    write end, so every later ``set`` of the service, the drain's NOT_SERVING among them,
    waited forever, and SIGTERM with it (issue 27). Here the lock is held only to read the
    status; a watcher that does not read gets the latest status when it does (the health
    protocol lets intermediate statuses be skipped), and the server's stop cancels it.
    """

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        service = request.service
        condition = self._server_watchers[service]
        self._watcher_count_by_service[service] += 1
        sent = None
        try:
            while True:
                async with condition:
                    while (status := self._status(service)) == sent:
                        await condition.wait()
                await context.write(health_pb2.HealthCheckResponse(status=status))
                sent = status
        finally:
            self._watcher_count_by_service[service] -= 1
            if self._watcher_count_by_service[service] == 0:
                del self._server_watchers[service]
                del self._watcher_count_by_service[service]

    def _status(self, service: str) -> int:
        return int(self._server_status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN))


class Health:
    """The statuses of one daemon, on one servicer shared by every listener.

    Args:
        store: the models held; readiness reads their states.
        on_ready: called once, the first time readiness turns SERVING (``sd_notify``).
    """

    def __init__(self, store: Store, on_ready: Callable[[], None] = lambda: None) -> None:
        self.servicer = HealthServicer()
        self._store = store
        self._on_ready = on_ready
        self._notified = False
        #: Names of the required models registered so far (see :meth:`require`).
        self._required: set[str] = set()
        self._started = False
        self._draining = False
        self._ready: bool | None = None
        self._lock = asyncio.Lock()

    @property
    def preloads_ended(self) -> bool:
        """Whether every start-up preload has ended (successfully or not)."""
        return self._started

    @property
    def ready(self) -> bool:
        """Whether readiness is SERVING now."""
        return bool(self._ready)

    def require(self, name: str) -> None:
        """Mark the model called ``name`` required for readiness."""
        self._required.add(name)

    def require_instead(self, name: str, held: str) -> None:
        """The required model ``name`` turned out, once hashed, to hold what the model
        ``held`` holds (its load was refused as a duplicate): require ``held`` instead."""
        self._required.discard(name)
        self._required.add(held)

    async def bound(self) -> None:
        """The sockets are bound: alive, not ready, start-up not ended."""
        await self.servicer.set(LIVENESS, SERVING)
        await self.servicer.set(SERVICE_NAME, NOT_SERVING)
        await self._set_ready(False)

    async def started(self) -> None:
        """Every start-up preload has ended (successfully or not)."""
        self._started = True
        await self.servicer.set(SERVICE_NAME, SERVING)
        await self.evaluate()

    async def draining(self) -> None:
        """A drain began: neither started nor ready any more."""
        self._draining = True
        await self.servicer.set(SERVICE_NAME, NOT_SERVING)
        await self._set_ready(False)

    async def shutdown(self) -> None:
        """Every service NOT_SERVING, and no later change (grpcio's graceful shutdown)."""
        await self.servicer.enter_graceful_shutdown()

    async def evaluate(self) -> None:
        """Recompute readiness from the required models' states."""
        async with self._lock:
            await self._apply(self._is_ready())

    def _is_ready(self) -> bool:
        """Every required model READY; one refused or FAILED counts until it is loaded
        again under its name (fixed), or evicted while FAILED (given up: issue 37, item 16,
        where only a restart cleared it). A READY one evicted keeps readiness off."""
        if not self._started or self._draining:
            return False
        states = {entry.name: entry.state for entry in self._store.entries()}
        states.update(dict.fromkeys(self._store.refusals, "failed"))
        return all(
            states.get(name) == "ready"
            for name in self._required
            if name not in self._store.given_up
        )

    async def _set_ready(self, ready: bool) -> None:
        async with self._lock:
            await self._apply(ready)

    async def _apply(self, ready: bool) -> None:
        # Under _lock: servicer.set() may yield (a Watch stream holds its condition), and
        # a drain's NOT_SERVING must not be overtaken by an evaluation computed before it.
        if ready == self._ready:
            return
        self._ready = ready
        status = SERVING if ready else NOT_SERVING
        for service in ("", READINESS):
            await self.servicer.set(service, status)
        log.info("readiness", ready=ready)
        if ready and not self._notified:
            self._notified = True
            self._on_ready()

    async def watch(self) -> None:
        """Re-evaluate readiness every :data:`WATCH_INTERVAL` seconds, forever."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            await self.evaluate()


class HealthListener:
    """``--health-listen HOST:PORT``: a plaintext gRPC server that serves
    ``grpc.health.v1.Health`` and nothing else (any other method: UNIMPLEMENTED), for
    Kubernetes ``grpc:`` probes, which speak neither TLS client certificates nor Unix
    sockets. It tells no more than whether the daemon is alive and ready, so it may listen
    on any address.

    Args:
        address: ``HOST:PORT``; port 0 picks a free one.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._server: grpc.aio.Server | None = None

    async def start(self, health: Health, max_connections: int = MAX_TCP_CONNECTIONS) -> int:
        """Bind and start serving ``health``, holding at most ``max_connections``
        connections at once (one more is closed when accepted); returns the port bound.

        Raises:
            AccessError: ``address`` is not ``HOST:PORT``, its port is above 65535, or it
                cannot be bound.
        """
        parse_listen(self.address, "--health-listen")
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0), *tcp_server_options(max_connections)]
        )
        health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
        try:
            port = server.add_insecure_port(self.address)
        except RuntimeError as exc:  # grpcio's "Failed to bind"
            raise AccessError(f"--health-listen {self.address}: cannot bind: {exc}") from None
        await server.start()
        self._server = server
        log.info("health listening", address=self.address, port=port)
        return port

    async def stop(self) -> None:
        """Stop serving (at once: health calls are short)."""
        if self._server is not None:
            await self._server.stop(0)
