"""Turning a :class:`WeightCacheError` into a gRPC status with ``google.rpc.ErrorInfo``.

Follows AIP-193: the status carries one ErrorInfo with domain ``weightcache.v1``, the
reason and string metadata; grpcio-status packs it into the ``grpc-status-details-bin``
trailer.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from weightcache.core.errors import DAEMON_ERRORS, ERROR_DOMAIN, WeightCacheError


def to_grpc_status(error: WeightCacheError) -> grpc.Status:
    """The gRPC status (code, message, trailer) for an error.

    The code is the ``status_code`` of the class that :data:`DAEMON_ERRORS` names for the
    error's reason; any other reason is sent as INTERNAL.
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
