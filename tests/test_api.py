"""The public surface of ``import weightcache`` and its exception hierarchy."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types
import typing
from collections.abc import Iterator

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

import weightcache
from weightcache.core.errors import ERROR_DOMAIN, error_for_reason
from weightcache_service.status import to_grpc_status


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


def _classes_in(annotation: object) -> set[type]:
    """The classes an annotation names: ``dict[str, X] | None`` names ``dict``, ``str``, ``X``."""
    if isinstance(annotation, list | tuple):  # Callable[[A, B], R] keeps its parameters in a list
        return set().union(*map(_classes_in, annotation))
    found = {annotation} if isinstance(annotation, type) else set()
    origin = typing.get_origin(annotation)
    if isinstance(origin, type):
        found.add(origin)
    return found.union(*map(_classes_in, typing.get_args(annotation)))


def _public_signatures() -> Iterator[tuple[str, dict[str, object]]]:
    """(where, resolved annotations) of every exported function, of every public method,
    constructor and property of every exported class, and of each such class's fields."""
    for name in weightcache.__all__:
        obj = getattr(weightcache, name)
        if inspect.isfunction(obj):
            yield name, typing.get_type_hints(obj)
        if not isinstance(obj, type) or issubclass(obj, BaseException):
            continue
        yield name, {k: v for k, v in typing.get_type_hints(obj).items() if k[0] != "_"}
        for attr, member in vars(obj).items():
            if attr.startswith("_") and attr != "__init__":
                continue
            function = member.fget if isinstance(member, property) else member
            function = getattr(function, "__func__", function)  # staticmethod, classmethod
            if inspect.isfunction(function):
                yield f"{name}.{attr}", typing.get_type_hints(function)


# Classes a public signature names that users never get hold of: LoadedWeights keeps its
# mapped arena in a private attribute, and only load() builds a LoadedWeights.
NOT_REACHABLE = {"weightcache._handles.MappedArena"}


def test_every_class_a_public_signature_names_is_exported() -> None:
    exported = {getattr(weightcache, name) for name in weightcache.__all__}
    missing = sorted(
        f"{where} [{key}]: {cls.__module__}.{cls.__qualname__}"
        for where, hints in _public_signatures()
        for key, annotation in hints.items()
        for cls in _classes_in(annotation)
        if cls.__module__.partition(".")[0] == "weightcache"
        and cls not in exported
        and f"{cls.__module__}.{cls.__qualname__}" not in NOT_REACHABLE
    )

    assert missing == []


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
