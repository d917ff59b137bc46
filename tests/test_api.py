"""The public surface of ``import weightcache`` and its exception hierarchy."""

from __future__ import annotations

import dataclasses
import inspect
import math
import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.rpc import error_details_pb2, status_pb2
from torch import nn

import weightcache
from tests.support import Checkpoints, Daemon, DaemonPool, assert_bitwise_equal
from weightcache._options import LoadKeywords
from weightcache.core.errors import ERROR_DOMAIN, error_for_reason
from weightcache.core.status import to_grpc_status


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


def _hints(obj: object) -> dict[str, object]:
    # Some modules import what their signatures name under TYPE_CHECKING only (importing
    # weightcache must not import torch), so the test supplies those names.
    names = {name: getattr(weightcache, name) for name in weightcache.__all__}
    return typing.get_type_hints(obj, localns={**names, "torch": torch})


def _public_signatures() -> Iterator[tuple[str, dict[str, object]]]:
    """(where, resolved annotations) of every exported function, of every public method,
    constructor and property of every exported class, and of each such class's fields."""
    for name in weightcache.__all__:
        obj = getattr(weightcache, name)
        if inspect.isfunction(obj):
            yield name, _hints(obj)
        if not isinstance(obj, type) or issubclass(obj, BaseException):
            continue
        yield name, {k: v for k, v in _hints(obj).items() if k[0] != "_"}
        for attr, member in vars(obj).items():
            if attr.startswith("_") and attr != "__init__":
                continue
            function = member.fget if isinstance(member, property) else member
            function = getattr(function, "__func__", function)  # staticmethod, classmethod
            if inspect.isfunction(function):
                yield f"{name}.{attr}", _hints(function)


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


@pytest.mark.parametrize(
    "module",
    [
        "weightcache",
        "weightcache_service.cli",
        "weightcache_service.admin",
        "weightcache.core.status",
    ],
)
def test_import_does_not_import_torch(module: str) -> None:
    """Neither the SDK's namespace nor the command (whose probes run often), its client
    subcommands, nor the decoding of a refusal imports torch."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )

    assert result.stdout == "False\n"


def test_the_parser_imports_neither_grpc_nor_structlog() -> None:
    """``weightcache --version`` and the parser start without gRPC, protobuf or structlog
    (issue 28: admin commands within 1.5x of a bare ``import grpc``)."""
    code = (
        "import sys, weightcache_service.cli as c; c._parser()\n"
        "print(sorted(m for m in ('grpc', 'google.protobuf', 'structlog', 'rich') "
        "if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )

    assert result.stdout == "[]\n"


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


# -- LoadOptions: the options of load() and load_into() as one typed value (issue 15) -----


@pytest.fixture(scope="module")
def daemon(module_daemons: DaemonPool, checkpoints: Checkpoints) -> Daemon:
    return module_daemons.start([checkpoints.single], dtype="F16")


def test_load_options_defaults_are_loads_defaults() -> None:
    options = weightcache.LoadOptions()

    assert dataclasses.asdict(options) == {
        "socket": None,
        "device": "cpu",
        "dtype": None,
        "recipe": None,
        "mode": "zero_copy",
        "fallback": True,
        "fingerprint_level": "full",
        "tp_rank": 0,
        "tp_size": 1,
        "ttl": None,
        "wait_timeout": 30.0,
        "lease_policy": None,
        "on_lease_lost": None,
        "on_revoke": "keep",
        "trusted_uid": None,
    }
    # The keywords load() and load_into() take are exactly the fields, with their types.
    keywords = {name: ref.__forward_arg__ for name, ref in LoadKeywords.__annotations__.items()}
    assert keywords == {f.name: f.type for f in dataclasses.fields(weightcache.LoadOptions)}
    assert LoadKeywords.__total__ is False


def test_load_options_are_frozen_and_keyword_only() -> None:
    options = weightcache.LoadOptions(ttl=2.5)

    with pytest.raises(dataclasses.FrozenInstanceError):
        options.ttl = 3.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        weightcache.LoadOptions("/run/weightcache/cpu.sock")  # type: ignore[call-arg]
    assert dataclasses.replace(options, device="cuda:1").device == "cuda:1"
    assert options == weightcache.LoadOptions(ttl=2.5)


def _bitwise_same_load(a: weightcache.LoadedWeights, b: weightcache.LoadedWeights) -> None:
    assert (a.source, a.model, a.fingerprint) == (b.source, b.model, b.fingerprint)
    assert a.fallback_reason == b.fallback_reason
    assert_bitwise_equal(a.tensors, b.tensors)


@pytest.mark.parametrize("where", ["cache", "disk"])
def test_options_and_keywords_load_the_same(
    where: str, daemon: Daemon, module_daemons: DaemonPool, checkpoints: Checkpoints
) -> None:
    socket = daemon.socket if where == "cache" else module_daemons.socket("absent")
    fields: dict[str, Any] = {"socket": socket, "dtype": "F16", "mode": "copy", "ttl": 5.0}

    options = weightcache.LoadOptions(**fields)
    with (
        weightcache.load(checkpoints.single, **fields) as by_keywords,
        weightcache.load(checkpoints.single, options=options) as by_options,
    ):
        _bitwise_same_load(by_keywords, by_options)
        assert by_options.source == where
        expected = weightcache.load_from_disk(checkpoints.single, dtype="F16").tensors
        assert_bitwise_equal(by_options.tensors, expected)
        if where == "disk":
            assert by_options.fallback_reason is not None
            assert by_options.fallback_reason.code == "DAEMON_UNAVAILABLE"


def _module_for(tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose buffers have the checkpoint's names and shapes, on the meta device."""
    root = nn.Module()
    for name, tensor in tensors.items():
        *path, attr = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = owner.get_submodule(part)
        owner.register_buffer(attr, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
    return root


def test_load_into_takes_the_same_options(daemon: Daemon, checkpoints: Checkpoints) -> None:
    fields: dict[str, Any] = {"socket": daemon.socket, "dtype": "F16", "mode": "copy"}
    expected = weightcache.load_from_disk(checkpoints.single, dtype="F16").tensors
    by_keywords, by_options = _module_for(expected), _module_for(expected)

    options = weightcache.LoadOptions(**fields)
    with (
        weightcache.load_into(by_keywords, checkpoints.single, **fields) as a,
        weightcache.load_into(by_options, checkpoints.single, options=options) as b,
    ):
        _bitwise_same_load(a, b)
        assert b.source == "cache"
        assert_bitwise_equal(dict(by_keywords.named_buffers()), expected)
        assert_bitwise_equal(dict(by_options.named_buffers()), expected)


def test_options_beside_keywords_is_a_type_error(checkpoints: Checkpoints) -> None:
    options = weightcache.LoadOptions(mode="copy")
    message = (
        r"^give the options either as options= or as keywords, not both "
        r"\(keywords given: socket, ttl\)$"
    )

    with pytest.raises(TypeError, match=message):
        weightcache.load(checkpoints.single, options=options, ttl=5.0, socket="/x.sock")
    with pytest.raises(TypeError, match=message):
        weightcache.load_into(nn.Module(), checkpoints.single, options=options, ttl=5.0, socket="x")


def test_options_of_another_type_is_a_type_error(checkpoints: Checkpoints) -> None:
    with pytest.raises(TypeError, match=r"^options must be a LoadOptions, not dict$"):
        weightcache.load(checkpoints.single, options={"ttl": 5.0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument 'sockett'"):
        weightcache.load(checkpoints.single, sockett="/x.sock")  # type: ignore[call-arg]


INVALID_OPTIONS: list[tuple[dict[str, Any], str]] = [
    ({"mode": "mmap"}, "mode must be one of ('zero_copy', 'copy'), not 'mmap'"),
    (
        {"fingerprint_level": "deep"},
        "fingerprint_level must be one of ('layout', 'sampled', 'full'), not 'deep'",
    ),
    (
        {"lease_policy": "retry"},
        "lease_policy must be one of ('raise', 'exit', 'ignore'), not 'retry'",
    ),
    (
        {"on_revoke": "drop"},
        "on_revoke must be one of ('keep', 'copy', 'raise', 'exit'), not 'drop'",
    ),
    (
        {"dtype": "F16", "recipe": weightcache.Recipe()},
        "give dtype inside the recipe, not beside it",
    ),
    ({"ttl": 0.0}, "ttl must be a finite number of seconds > 0, not 0.0"),
    ({"ttl": math.inf}, "ttl must be a finite number of seconds > 0, not inf"),
    ({"wait_timeout": -1.0}, "wait_timeout must be a finite number of seconds >= 0, not -1.0"),
    (
        {"device": "mps"},
        "device 'mps': use cpu, cuda:N, N, cuda, a GPU-/MIG- UUID, an index or a torch.device",
    ),
    ({"device": -1}, "device -1: an index is 0 or more"),
]


@pytest.mark.parametrize(("fields", "message"), INVALID_OPTIONS, ids=lambda v: str(v)[:40])
def test_invalid_options_are_value_errors_either_way(
    fields: dict[str, Any], message: str, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    with pytest.raises(ValueError) as built:
        weightcache.LoadOptions(**fields)
    with pytest.raises(ValueError) as loaded:
        weightcache.load(checkpoints.single, **fields)

    assert str(built.value) == str(loaded.value) == message


@pytest.mark.parametrize(
    ("fields", "message"),
    [case for case in INVALID_OPTIONS if set(case[0]) <= {"dtype", "recipe", "fingerprint_level"}],
    ids=lambda v: str(v)[:40],
)
def test_load_from_disk_refuses_what_load_options_refuse(
    fields: dict[str, Any], message: str, checkpoints: Checkpoints
) -> None:
    """One home for these checks: load_from_disk takes no options object, but the same
    rules (LoadOptions') refuse its arguments with the same message."""
    with pytest.raises(ValueError) as refused:
        weightcache.load_from_disk(checkpoints.single, **fields)

    assert str(refused.value) == message
