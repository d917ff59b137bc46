"""One list of reason codes: the proto's ``ErrorReason`` enum, the SDK's exception classes
and the gRPC codes the daemon sends them with must agree (as httpx tests that every
transport exception is mapped)."""

from __future__ import annotations

import inspect
import re

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

import weightcache
from tests.support import TESTS
from weightcache.core import errors as _errors
from weightcache.core.errors import DAEMON_ERRORS, ERROR_DOMAIN, error_for_reason
from weightcache.core.status import to_grpc_status
from weightcache.v1 import weight_cache_service_pb2 as pb

PROTO = TESTS.parent / "protos" / "weightcache" / "v1" / "weight_cache_service.proto"
PREFIX = "ERROR_REASON_"


def _documented_codes() -> dict[str, str]:
    """Reason -> the gRPC code its comment in the proto starts with (``// NOT_FOUND: ...``)."""
    text = PROTO.read_text()
    found = re.findall(r"  // ([A-Z_]+): [^\n]*\n(?:  //[^\n]*\n)*  ERROR_REASON_([A-Z_]+) =", text)
    return {reason: code for code, reason in found}


def test_the_proto_enum_names_exactly_the_reasons_the_daemon_sends() -> None:
    enum = {name.removeprefix(PREFIX) for name in pb.ErrorReason.DESCRIPTOR.values_by_name}
    assert enum - {"UNSPECIFIED"} == set(DAEMON_ERRORS)


def test_each_reason_is_documented_in_the_proto_with_the_code_it_is_sent_with() -> None:
    sent = {reason: cls.status_code for reason, cls in DAEMON_ERRORS.items()}
    assert _documented_codes() == sent


@pytest.mark.parametrize("reason", sorted(DAEMON_ERRORS))
def test_each_reason_round_trips_to_its_one_exception_class(reason: str) -> None:
    cls = DAEMON_ERRORS[reason]
    status = to_grpc_status(cls("why", metadata={"k": "v"}))

    assert status.code == grpc.StatusCode[cls.status_code]
    [(key, blob)] = status.trailing_metadata
    assert key == "grpc-status-details-bin"
    decoded = status_pb2.Status.FromString(blob)
    info = error_details_pb2.ErrorInfo()
    assert decoded.details[0].Unpack(info)
    assert (info.domain, info.reason, dict(info.metadata)) == (ERROR_DOMAIN, reason, {"k": "v"})
    back = error_for_reason(info.reason, decoded.message, info.metadata)
    assert (type(back), back.reason, back.detail) == (cls, reason, "why")


def test_a_reason_no_class_carries_is_internal_and_a_plain_remote_error() -> None:
    error = weightcache.WeightCacheError("odd", reason="SOMETHING_NEW")
    assert to_grpc_status(error).code == grpc.StatusCode.INTERNAL
    back = error_for_reason("SOMETHING_NEW", "odd")
    assert (type(back), back.reason) == (weightcache.RemoteError, "SOMETHING_NEW")


def _exception_classes() -> list[type[BaseException]]:
    return [
        obj
        for _, obj in inspect.getmembers(_errors, inspect.isclass)
        if issubclass(obj, weightcache.WeightCacheError) and obj.__module__ == _errors.__name__
    ]


def test_every_exception_is_drawn_in_the_hierarchy_and_exported() -> None:
    doc = _errors.__doc__ or ""
    classes = _exception_classes()
    assert len(classes) >= len(DAEMON_ERRORS)
    for cls in classes:
        assert re.search(rf"[─ ]{cls.__name__}\b", doc), f"{cls.__name__} not in the hierarchy"
        assert cls.__name__ in weightcache.__all__
        assert getattr(weightcache, cls.__name__) is cls
