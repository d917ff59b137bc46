"""The client's gRPC channel to a daemon, and translation of its errors into exceptions."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import grpc

from weightcache.core.errors import DaemonUnavailableError, WeightCacheError
from weightcache.core.forking import calling, opened_channel
from weightcache.core.per_process import PerProcess
from weightcache.core.sockets import no_socket, socket_denied
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc

T = TypeVar("T")
#: The service's full name: what a daemon's gRPC health service reports SERVING once its
#: start-up preloads have ended (grpc.health.v1).
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["WeightCacheService"].full_name
#: The daemon's liveness health service: SERVING from bind to shutdown (grpc.health.v1).
LIVENESS = "liveness"
#: The daemon's readiness health service (also ``""``): SERVING once every required
#: start-up model is READY, and not while draining.
READINESS = "readiness"
#: Largest response, in bytes, the daemon sends and the SDK accepts: an AcquireResponse of
#: a model with very many tensors.
MAX_RESPONSE_BYTES = 256 * 2**20
#: Every SDK channel's options. A subchannel pool of the channel's own: by default gRPC
#: shares one connection among the channels of a process with the same target and
#: options, and a forked child's new channel could then take the connection of a channel
#: it inherited (``forking.abandon_channels`` keeps those untouched), whose descriptor is
#: the parent's: the child's call failed with "Wrong file descriptor generation" (1 child
#: of 20 in ``tests/test_fork.py``, 2026-12-05). One channel per socket per process
#: (:func:`shared`) gives up nothing by it.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES),
    ("grpc.use_local_subchannel_pool", 1),
)


def target(socket: str) -> str:
    """The gRPC target for a Unix socket path (``unix:`` + absolute path)."""
    return "unix:" + os.path.abspath(socket)


def connect(socket: str) -> tuple[grpc.Channel, pb_grpc.WeightCacheServiceStub]:
    """Open a channel to the daemon at ``socket`` (lazily: nothing is sent yet).

    Raises:
        DaemonUnavailableError: no socket file exists at the path, or it cannot be reached.
    """
    try:
        os.stat(socket)
    except FileNotFoundError:
        raise DaemonUnavailableError(no_socket(socket)) from None
    except PermissionError as exc:
        raise DaemonUnavailableError(socket_denied(socket, exc.strerror)) from None
    with calling():
        channel = grpc.insecure_channel(target(socket), options=CHANNEL_OPTIONS)
        opened_channel(channel)
    return channel, pb_grpc.WeightCacheServiceStub(channel)


def call(fn: Callable[[], T]) -> T:
    """Run one RPC, turning a gRPC error into the matching :class:`WeightCacheError`.

    Raises:
        DaemonUnavailableError: the daemon did not answer (UNAVAILABLE without details,
            or the deadline passed).
        WeightCacheError: the daemon refused; the subclass matches its ErrorInfo reason.
    """
    try:
        with calling():
            return fn()
    except grpc.RpcError as exc:
        raise _error(exc) from None


def _error(exc: grpc.RpcError) -> WeightCacheError:
    # Imported on a refusal only (google.rpc's messages): torch-free, as the admin commands
    # (`weightcache evict`, `health`, the probes) must start without it.
    from weightcache.core.status import from_rpc_error

    return from_rpc_error(exc)


#: This process's channel and stub by socket path.
_shared: PerProcess[str, tuple[grpc.Channel, pb_grpc.WeightCacheServiceStub]] = PerProcess()


def shared(socket: str) -> tuple[grpc.Channel, pb_grpc.WeightCacheServiceStub]:
    """This process's channel to the daemon at ``socket``: opened on first use (again in
    a forked child, or after :func:`retire`), then kept, so that a process's loads, its
    KeepAlive stream and its Releases share one connection instead of each connecting
    (a unary call on a fresh channel took 1.2-1.8 ms here, on a connected one 0.6 ms).

    Raises:
        DaemonUnavailableError: no channel is open and no socket file exists at the path,
            or it cannot be reached (:func:`connect`).
    """
    with _shared.lock:
        channels = _shared.entries()
        opened = channels.get(socket)
        if opened is None:
            opened = channels[socket] = connect(socket)
        return opened


def retire(socket: str, channel: grpc.Channel) -> None:
    """Close ``channel`` and, if it is still ``socket``'s shared channel, forget it: the
    next :func:`shared` connects afresh rather than wait out the old channel's reconnect
    backoff (gRPC's, up to two minutes) after the daemon went away."""
    with _shared.lock:
        channels = _shared.entries()
        opened = channels.get(socket)
        if opened is not None and opened[0] is channel:
            del channels[socket]
    with calling():
        channel.close()


def call_shared(socket: str, rpc: Callable[[pb_grpc.WeightCacheServiceStub], T]) -> T:
    """Run ``rpc(stub)`` on the shared channel to ``socket`` as :func:`call` does.

    A channel that could not reach the daemon (UNAVAILABLE from the transport, no
    ErrorInfo) is retired; a deadline passed is not (the daemon may be slow, and the
    channel carries the process's KeepAlive stream, which closing it would end). A call
    on a channel retired meanwhile (closed, or CANCELLED by the close) is made once more
    on a new one.

    Raises:
        DaemonUnavailableError: as :func:`call`, or the socket file is missing, or the
            channel closed under both attempts, or this process was forked while its
            parent's SDK was mid-call (:mod:`weightcache.core.forking`).
        WeightCacheError: the daemon refused; the subclass matches its ErrorInfo reason
            (:class:`RemoteError` for a status without one).
    """
    for attempt in range(2):
        channel, stub = shared(socket)
        try:
            with calling():
                return rpc(stub)
        except ValueError as exc:
            # grpc refuses to start a call on a closed channel; only retire closes one,
            # and it first stops sharing it.
            if _is_shared(socket, channel):
                raise
            failure: Exception = exc
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code is grpc.StatusCode.CANCELLED and not _is_shared(socket, channel):
                failure = exc
            else:
                err = _error(exc)
                if isinstance(err, DaemonUnavailableError) and code is grpc.StatusCode.UNAVAILABLE:
                    retire(socket, channel)
                raise err from None
        if attempt:
            raise DaemonUnavailableError(f"the channel to {socket} closed: {failure}")
    raise AssertionError("unreachable")


def _is_shared(socket: str, channel: grpc.Channel) -> bool:
    with _shared.lock:
        opened = _shared.entries().get(socket)
        return opened is not None and opened[0] is channel
