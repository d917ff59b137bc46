"""Errors across the wire: a :class:`WeightCacheError` as a gRPC status carrying one
``google.rpc.ErrorInfo`` (AIP-193), and back.

Torch-free, as :mod:`weightcache.core.rpc` decodes every refusal through it: the admin
commands (``weightcache evict``, ``health``, the probes) must start without torch, which
:mod:`weightcache.core.protocol` imports (through ``core.recipe``).
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from weightcache.core.errors import (
    DAEMON_ERRORS,
    ERROR_DOMAIN,
    DaemonUnavailableError,
    RemoteError,
    WeightCacheError,
    error_for_reason,
)


def to_grpc_status(error: WeightCacheError) -> grpc.Status:
    """The gRPC status (code, message, trailer) for an error.

    The code is the ``status_code`` of the class that :data:`DAEMON_ERRORS` names for the
    error's reason; any other reason is sent as INTERNAL. The trailer carries one
    ``google.rpc.ErrorInfo`` (domain ``weightcache.v1``, the reason, string metadata).
    """
    cls = DAEMON_ERRORS.get(error.reason, WeightCacheError)
    info = error_details_pb2.ErrorInfo(
        reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(
        code=code_pb2.Code.Value(cls.status_code), message=error.detail, details=[detail]
    )
    return rpc_status.to_status(status)


def from_rpc_error(exc: grpc.RpcError) -> WeightCacheError:
    """The exception a gRPC error stands for.

    A status with an ErrorInfo gives the class of its reason (:func:`error_for_reason`);
    UNAVAILABLE or DEADLINE_EXCEEDED without one gives :class:`DaemonUnavailableError`;
    anything else a :class:`RemoteError` named after its code.
    """
    status = rpc_status.from_call(exc) if isinstance(exc, grpc.Call) else None
    if status is not None:
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return error_for_reason(info.reason, status.message, info.metadata)
    code = exc.code() if isinstance(exc, grpc.Call) else None
    text = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, None):
        return DaemonUnavailableError(f"{_why_unavailable(text)}: {text}")
    return RemoteError(f"{code}: {text}", reason=str(code.name if code else "UNKNOWN"))


def _why_unavailable(text: str) -> str:
    """What a gRPC UNAVAILABLE's details mean for a Unix socket: nothing listens on it (a
    daemon that died left it: stale), or connect(2) was refused by the file modes."""
    if "Connection refused" in text:
        return "no daemon (stale socket: nothing listens on it)"
    if "Permission denied" in text:
        return (
            "daemon unavailable: the socket is the daemon's user's only, unless the daemon "
            "runs with --group GROUP and this process is in that group"
        )
    return "daemon unavailable"
