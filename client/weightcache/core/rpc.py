"""The client's gRPC channel to a daemon, and translation of its errors into exceptions."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from weightcache.core.errors import (
    DaemonUnavailableError,
    RemoteError,
    WeightCacheError,
    error_for_reason,
)
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc

T = TypeVar("T")
#: Largest response accepted: an AcquireResponse of a model with very many tensors.
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
        raise translate(exc) from None


def translate(exc: grpc.RpcError) -> WeightCacheError:
    """The exception a gRPC error stands for (see :func:`call`)."""
    status = rpc_status.from_call(exc) if isinstance(exc, grpc.Call) else None
    if status is not None:
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return error_for_reason(info.reason, status.message, info.metadata)
    code = exc.code() if isinstance(exc, grpc.Call) else None
    text = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, None):
        return DaemonUnavailableError(f"daemon unavailable: {text}")
    return RemoteError(f"{code}: {text}", reason=str(code.name if code else "UNKNOWN"))
