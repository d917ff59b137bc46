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

from weightcache._errors import ERROR_DOMAIN, WeightCacheError

_CODES: dict[str, int] = {
    "FINGERPRINT_MISMATCH": code_pb2.NOT_FOUND,
    "MODEL_NOT_FOUND": code_pb2.NOT_FOUND,
    "MODEL_LOADING": code_pb2.UNAVAILABLE,
    "MODEL_FAILED": code_pb2.FAILED_PRECONDITION,
    "LEASE_NOT_FOUND": code_pb2.NOT_FOUND,
    "LEASES_ACTIVE": code_pb2.FAILED_PRECONDITION,
    "RESOURCE_EXHAUSTED": code_pb2.RESOURCE_EXHAUSTED,
    "PERMISSION_DENIED": code_pb2.PERMISSION_DENIED,
    "INVALID_CHECKPOINT": code_pb2.INVALID_ARGUMENT,
    "INVALID_ARGUMENT": code_pb2.INVALID_ARGUMENT,
    "INVALID_RECIPE": code_pb2.INVALID_ARGUMENT,
    "MODEL_EXISTS": code_pb2.ALREADY_EXISTS,
    "DRAINING": code_pb2.UNAVAILABLE,
    "NOT_SAME_HOST": code_pb2.FAILED_PRECONDITION,
    "INTERNAL": code_pb2.INTERNAL,
}


def to_grpc_status(error: WeightCacheError) -> grpc.Status:
    """The gRPC status (code, message, trailer) for an error; unknown reasons are INTERNAL."""
    info = error_details_pb2.ErrorInfo(
        reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(
        code=_CODES.get(error.reason, code_pb2.INTERNAL), message=error.detail, details=[detail]
    )
    return rpc_status.to_status(status)
