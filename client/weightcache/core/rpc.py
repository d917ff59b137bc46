"""The client's gRPC channel to a daemon, and translation of its errors into exceptions."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable
from typing import TypeVar

import grpc

from weightcache.core.errors import DaemonUnavailableError
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc

# grpc imports its channel module on a process's first insecure_channel (about 4 ms here,
# bench/README.md): imported with the SDK instead, a worker's first load() does not pay it.
with contextlib.suppress(ImportError):  # a private module: a later grpcio may move it
    importlib.import_module("grpc._channel")

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
        raise DaemonUnavailableError(f"no daemon socket at {socket}") from None
    except PermissionError as exc:
        raise DaemonUnavailableError(
            f"cannot reach the daemon socket {socket}: {exc.strerror}"
        ) from None
    channel = grpc.insecure_channel(
        target(socket), options=[("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)]
    )
    return channel, pb_grpc.WeightCacheServiceStub(channel)


def call(fn: Callable[[], T]) -> T:
    """Run one RPC, turning a gRPC error into the matching :class:`WeightCacheError`.

    Raises:
        DaemonUnavailableError: the daemon did not answer (UNAVAILABLE without details,
            or the deadline passed).
        WeightCacheError: the daemon refused; the subclass matches its ErrorInfo reason.
    """
    try:
        return fn()
    except grpc.RpcError as exc:
        # Imported on a refusal only: the conversions import torch, and the admin
        # commands (`weightcache health`, the probes) must start without it.
        from weightcache.core.protocol import from_rpc_error

        raise from_rpc_error(exc) from None
