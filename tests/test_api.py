"""The public surface of ``import weightcache`` and its exception hierarchy."""

from __future__ import annotations

import subprocess
import sys
import types

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

import weightcache
from weightcache.core.errors import ERROR_DOMAIN, error_for_reason
from weightcache.core.protocol import to_grpc_status


def _subclasses(cls: type[weightcache.RemoteError]) -> list[type[weightcache.RemoteError]]:
    found: list[type[weightcache.RemoteError]] = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


REMOTE_ERRORS = sorted(_subclasses(weightcache.RemoteError), key=lambda c: c.__name__)


def test_all_names_exist() -> None:
    missing = [name for name in weightcache.__all__ if not hasattr(weightcache, name)]

    assert missing == []
    assert len(set(weightcache.__all__)) == len(weightcache.__all__)


def test_all_public_names_are_exported() -> None:
    for name in weightcache.__all__:
        getattr(weightcache, name)  # resolve the lazily imported names first
    public = {
        name
        for name, value in vars(weightcache).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }

    assert public | {"__version__"} == set(weightcache.__all__)


def test_unknown_attribute_is_an_attribute_error() -> None:
    name = "no_such_name"
    with pytest.raises(AttributeError, match=name):
        getattr(weightcache, name)


def test_import_does_not_import_torch() -> None:
    code = "import sys, weightcache; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )

    assert result.stdout == "False\n"


def test_exported_errors_are_weightcache_errors() -> None:
    exported = [getattr(weightcache, name) for name in weightcache.__all__]
    errors = [obj for obj in exported if isinstance(obj, type) and issubclass(obj, Exception)]

    assert weightcache.WeightCacheError in errors
    assert all(issubclass(e, weightcache.WeightCacheError) for e in errors)
    assert set(REMOTE_ERRORS) <= set(errors)


def test_exit_code_and_protocol_constants() -> None:
    assert weightcache.EXIT_LEASE_LOST == 75
    assert weightcache.PROTOCOL_VERSION == "weightcache.v1"
    assert isinstance(weightcache.__version__, str)


def test_every_remote_error_has_its_own_reason() -> None:
    reasons = [cls.reason for cls in REMOTE_ERRORS]

    assert len(REMOTE_ERRORS) >= 11
    assert len(set(reasons)) == len(reasons)
    assert all(r.isupper() and r != "UNKNOWN" for r in reasons)


@pytest.mark.parametrize("cls", REMOTE_ERRORS, ids=lambda c: c.__name__)
def test_remote_error_maps_back_from_its_reason(cls: type[weightcache.RemoteError]) -> None:
    err = error_for_reason(cls.reason, "the detail", {"model": "m"})

    assert type(err) is cls
    assert isinstance(err, weightcache.RemoteError)
    assert (err.reason, err.detail, str(err), err.metadata) == (
        cls.reason,
        "the detail",
        "the detail",
        {"model": "m"},
    )


@pytest.mark.parametrize(
    ("cls", "reason"),
    [
        (weightcache.InvalidCheckpointError, "INVALID_CHECKPOINT"),
        (weightcache.DaemonUnavailableError, "DAEMON_UNAVAILABLE"),
        (weightcache.LeaseLostError, "LEASE_LOST"),
        (weightcache.RecipeError, "INVALID_RECIPE"),
    ],
)
def test_client_side_errors_carry_their_reason(
    cls: type[weightcache.WeightCacheError], reason: str
) -> None:
    assert cls.reason == reason
    assert cls("x").reason == reason
    assert not issubclass(cls, weightcache.RemoteError)


def test_invalid_checkpoint_maps_back_from_its_reason() -> None:
    err = error_for_reason("INVALID_CHECKPOINT", "bad header")

    assert type(err) is weightcache.InvalidCheckpointError


def test_unknown_reason_is_a_plain_remote_error() -> None:
    err = error_for_reason("SOMETHING_NEW", "?", {"k": "v"})

    assert type(err) is weightcache.RemoteError
    assert (err.reason, err.metadata) == ("SOMETHING_NEW", {"k": "v"})


def test_fingerprint_mismatch_components_come_from_metadata() -> None:
    err = error_for_reason(
        "FINGERPRINT_MISMATCH", "differs", {"components": "checkpoint/a.safetensors,recipe"}
    )

    assert isinstance(err, weightcache.FingerprintMismatchError)
    assert err.components == ["checkpoint/a.safetensors", "recipe"]


@pytest.mark.parametrize(
    ("cls", "code"),
    [
        (weightcache.FingerprintMismatchError, grpc.StatusCode.NOT_FOUND),
        (weightcache.ModelNotFoundError, grpc.StatusCode.NOT_FOUND),
        (weightcache.ModelLoadingError, grpc.StatusCode.UNAVAILABLE),
        (weightcache.LeasesActiveError, grpc.StatusCode.FAILED_PRECONDITION),
        (weightcache.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
        (weightcache.InvalidCheckpointError, grpc.StatusCode.INVALID_ARGUMENT),
        (weightcache.ModelExistsError, grpc.StatusCode.ALREADY_EXISTS),
        (weightcache.DrainingError, grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_daemon_status_round_trips_to_the_same_error(
    cls: type[weightcache.WeightCacheError], code: grpc.StatusCode
) -> None:
    status = to_grpc_status(cls("why", metadata={"model": "m"}))

    assert status.code == code
    assert status.details == "why"
    [(key, blob)] = status.trailing_metadata
    assert key == "grpc-status-details-bin"
    decoded = status_pb2.Status.FromString(blob)
    info = error_details_pb2.ErrorInfo()
    assert decoded.details[0].Unpack(info)
    assert (info.domain, info.reason, dict(info.metadata)) == (
        ERROR_DOMAIN,
        cls.reason,
        {"model": "m"},
    )
    back = error_for_reason(info.reason, decoded.message, info.metadata)
    assert type(back) is cls
