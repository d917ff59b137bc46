"""Fuzzing with hypothesis: hostile checkpoints and malformed gRPC requests.

1. Mutated safetensors files (header JSON edited field by field, header bytes flipped,
   lengths changed, files truncated or extended, random bytes) through
   ``open_checkpoint`` + ``load_from_disk``: only :class:`InvalidCheckpointError`, or
   success with every tensor equal to the bytes at its declared offsets in the file.
2. The same files through a live daemon's remote Preload: only ``INVALID_CHECKPOINT``
   (and then the client's own validation refuses the file too), or ``READY`` and an attach
   bitwise equal to ``load_from_disk``; the daemon keeps serving.
3. Random field values for every RPC, and random bytes as raw messages: only documented
   status codes; the daemon keeps serving and a good model still attaches bitwise.

Examples are bounded and derandomized (stable in CI); ``WEIGHTCACHE_FUZZ_EXAMPLES=N``
multiplies them, ``WEIGHTCACHE_FUZZ_RANDOM=1`` draws fresh ones.

Faults the fuzzing found (deep nesting, lone surrogates, overflowing zero-size shapes)
have regression tests at the end; the strategies no longer avoid those inputs.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.protobuf import duration_pb2
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

import weightcache
from tests.security_support import acquire_request, stop_together
from tests.support import (
    Daemon,
    DaemonPool,
    assert_bitwise_equal,
    health,
    raw_bytes,
    rpc_failure,
    service_stub,
)
from weightcache.core.dtypes import TORCH_DTYPES
from weightcache.testing import READY_TIMEOUT
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)

SCALE = max(1, int(os.environ.get("WEIGHTCACHE_FUZZ_EXAMPLES", "1")))
RANDOM = os.environ.get("WEIGHTCACHE_FUZZ_RANDOM") == "1"
START_TIMEOUT = READY_TIMEOUT  # the harness's one ready timeout
GOOD = "good"
SERVICE = "/weightcache.v1.WeightCacheService/"
#: Status codes the contract documents for requests that decode.
DOCUMENTED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


#: How the client reports trailers over gRPC's metadata size limit: the known fault of
#: errors that echo long request strings (test_security.py,
#: test_an_error_about_a_name_at_the_limit_reaches_the_client).
METADATA_LIMIT = "metadata size exceeds"


def assert_documented(rpc: str, exc: grpc.RpcError) -> None:
    """A documented status code; RESOURCE_EXHAUSTED only from the daemon or grpc's size
    limits."""
    code, details = exc.code(), exc.details() or ""
    assert code in DOCUMENTED, (rpc, code, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and METADATA_LIMIT in details:
        event("known fault: error trailers over the metadata limit")
        return
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        return
    failure = rpc_failure(exc)  # the daemon's own refusals carry one ErrorInfo
    assert failure.domain == "weightcache.v1", failure


def fuzz(examples: int) -> Callable[[Any], Any]:
    """Hypothesis settings for one fuzz test."""
    return settings(
        max_examples=examples * SCALE,
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.function_scoped_fixture,
        ],
    )


# -- the base checkpoint and its mutations -------------------------------------------


def base_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=gen)
    return {
        "a": raw[:24].view(torch.float32).reshape(2, 3),
        "b": raw[24:32].view(torch.bfloat16),
        "c": raw[32:48].view(torch.int64),
        "d": torch.tensor([True, False, True]),
        "e": torch.zeros((0, 3), dtype=torch.uint8),
        "f": raw[48:50].view(torch.float16).reshape(()),
        "g": raw[50:55].view(torch.float8_e4m3fn),
    }


BASE = save(base_tensors(), metadata={"format": "pt"})
BASE_HEADER_LEN = struct.unpack("<Q", BASE[:8])[0]
BASE_HEADER: dict[str, Any] = json.loads(BASE[8 : 8 + BASE_HEADER_LEN])
BASE_DATA = BASE[8 + BASE_HEADER_LEN :]
NAMES = sorted(k for k in BASE_HEADER if k != "__metadata__")


def pack(header: Any, data: bytes, header_len: int | None = None, pad: int = 0) -> bytes:
    raw = json.dumps(header, ensure_ascii=False).encode("utf-8", "surrogatepass") + b" " * pad
    length = len(raw) if header_len is None else header_len
    return struct.pack("<Q", length % 2**64) + raw + data


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
dims = st.one_of(
    st.integers(0, 8),
    st.integers(0, 2**20),
    st.sampled_from([2**31, 2**32 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 2**70]),
    st.integers(-3, -1),
)
shapes = st.one_of(st.lists(dims, max_size=4), st.lists(st.just(1), min_size=60, max_size=70), junk)
offsets_value = st.one_of(
    st.integers(0, len(BASE_DATA) + 16),
    st.sampled_from([2**63, 2**64 + 3, -1]),
    junk,
)
offsets = st.one_of(st.lists(offsets_value, min_size=2, max_size=2), st.lists(offsets_value), junk)
dtypes = st.one_of(st.sampled_from(sorted(TORCH_DTYPES)), st.sampled_from(["F7", "f32", ""]), junk)
entries = st.one_of(
    st.fixed_dictionaries({"dtype": dtypes, "shape": shapes, "data_offsets": offsets}),
    st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets", "x"]), junk, max_size=3),
    junk,
)
tensor_names = st.one_of(st.sampled_from(NAMES), st.text(max_size=12), st.just("__metadata__"))


@st.composite
def edited_headers(draw: st.DrawFn) -> bytes:
    """The base header with a few fields replaced, added or removed; lengths and data
    sometimes changed too."""
    header: dict[str, Any] = json.loads(json.dumps(BASE_HEADER))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["field", "entry", "add", "delete", "copy", "metadata"]))
        name = draw(tensor_names)
        if action == "field" and isinstance(header.get(name), dict):
            key = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            header[name][key] = draw(
                {"dtype": dtypes, "shape": shapes, "data_offsets": offsets}[key]
            )
        elif action in ("entry", "add"):
            header[name] = draw(entries)
        elif action == "delete":
            header.pop(name, None)
        elif action == "copy" and NAMES:
            header[name] = json.loads(json.dumps(header.get(draw(st.sampled_from(NAMES)))))
        elif action == "metadata":
            header["__metadata__"] = draw(
                st.one_of(st.dictionaries(st.text(max_size=6), st.text(max_size=6)), junk)
            )
    data = draw(
        st.one_of(
            st.just(BASE_DATA),
            st.integers(0, len(BASE_DATA)).map(lambda n: BASE_DATA[:n]),
            st.binary(max_size=32).map(lambda extra: BASE_DATA + extra),
        )
    )
    header_len = draw(st.one_of(st.none(), st.integers(0, 2048), st.sampled_from([2**64 - 1])))
    return pack(header, data, header_len, pad=draw(st.integers(0, 7)))


@st.composite
def flipped_bytes(draw: st.DrawFn) -> bytes:
    """The base file with random bytes overwritten (mostly in the header), cut or grown."""
    raw = bytearray(BASE)
    for _ in range(draw(st.integers(1, 6))):
        where = draw(st.integers(0, min(len(raw) - 1, 8 + BASE_HEADER_LEN + 8)))
        raw[where] = draw(st.integers(0, 255))
    cut = draw(st.one_of(st.none(), st.integers(0, len(raw))))
    out = bytes(raw[:cut] if cut is not None else raw)
    return out + draw(st.binary(max_size=8))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def reshaped(draw: st.DrawFn, numel: int) -> list[int]:
    """A shape of ``numel`` elements (with some 1s; a 0 somewhere when ``numel`` is 0)."""
    if numel == 0:
        return draw(st.permutations([0, *draw(st.lists(st.integers(0, 5), max_size=2))]))
    dims, rest = [], numel
    for _ in range(draw(st.integers(0, 3))):
        dims.append(draw(st.sampled_from(_divisors(rest))))
        rest //= dims[-1]
    return [*dims, rest] if rest > 1 or not dims else dims


@st.composite
def reinterpreted(draw: st.DrawFn) -> bytes:
    """Valid files over the same bytes: dtypes of the same item size, other shapes of the
    same size, tensors swapped between equal-sized slots, new metadata, keys reordered."""
    header: dict[str, Any] = json.loads(json.dumps(BASE_HEADER))
    for name in draw(st.lists(st.sampled_from(NAMES), unique=True)):
        entry = header[name]
        size = TORCH_DTYPES[entry["dtype"]].itemsize
        if draw(st.booleans()):
            entry["dtype"] = draw(st.sampled_from(SAME_SIZE[size]))
        begin, end = entry["data_offsets"]
        if draw(st.booleans()) and end > begin:
            entry["dtype"] = "U8"
            entry["shape"] = draw(reshaped(end - begin))
        else:
            entry["shape"] = draw(reshaped(math.prod(entry["shape"])))
    sizes: dict[int, list[str]] = {}
    for name in NAMES:
        begin, end = header[name]["data_offsets"]
        sizes.setdefault(end - begin, []).append(name)
    for group in sizes.values():
        if len(group) > 1 and draw(st.booleans()):
            first, second = group[0], group[1]
            a, b = header[first]["data_offsets"], header[second]["data_offsets"]
            header[first]["data_offsets"], header[second]["data_offsets"] = b, a
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=8), st.text(max_size=8)))
    order = draw(st.permutations(list(header)))
    return pack({k: header[k] for k in order}, BASE_DATA, pad=draw(st.integers(0, 16)))


SAME_SIZE: dict[int, list[str]] = {}
for _name, _dtype in TORCH_DTYPES.items():
    SAME_SIZE.setdefault(_dtype.itemsize, []).append(_name)

checkpoint_files = st.one_of(
    reinterpreted(), edited_headers(), flipped_bytes(), st.binary(max_size=300)
)


def expected_tensors(raw: bytes) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    """What a file declares, read independently of weightcache: name -> (dtype, shape,
    the bytes at its offsets)."""
    header_len = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + header_len])
    start = 8 + header_len
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = (
            TORCH_DTYPES[entry["dtype"]],
            tuple(entry["shape"]),
            raw[start + begin : start + end],
        )
    return out


def assert_declared(tensors: dict[str, torch.Tensor], raw: bytes) -> None:
    """Every tensor has the dtype, shape and bytes the file declares for it."""
    want = expected_tensors(raw)
    assert sorted(tensors) == sorted(want)
    for name, tensor in tensors.items():
        dtype, shape, data = want[name]
        assert (tensor.dtype, tuple(tensor.shape)) == (dtype, shape), name
        assert raw_bytes(tensor).numpy().tobytes() == data, name


def write_checkpoint(folder: Path, raw: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(raw)
    return folder


# -- 1. in process -------------------------------------------------------------------


def test_base_checkpoint_is_valid(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "base", BASE)
    assert_declared(weightcache.load_from_disk(folder).tensors, BASE)
    assert_bitwise_equal(weightcache.load_from_disk(folder).tensors, base_tensors())


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder the in-process fuzz rewrites for each example."""
    return tmp_path_factory.mktemp("fuzz-scratch")


@fuzz(300)
@given(raw=checkpoint_files)
def test_disk_loading_refuses_or_returns_the_declared_bytes(scratch: Path, raw: bytes) -> None:
    folder = write_checkpoint(scratch / "disk", raw)

    try:
        weights = weightcache.load_from_disk(folder)
    except weightcache.InvalidCheckpointError as err:
        assert err.reason == "INVALID_CHECKPOINT"
        assert str(err)
        event("refused")
        return
    assert_declared(weights.tensors, raw)
    event("loaded")


# -- daemons -------------------------------------------------------------------------


@dataclass(frozen=True)
class Daemons:
    """``fuzzed``: remote Preload under ``root``, holds ``good``; ``faulty``: the same
    options, for the regression tests of known faults (which leave it damaged)."""

    fuzzed: Daemon
    faulty: Daemon
    root: Path
    good: Path
    faulty_root: Path


@pytest.fixture(scope="module")
def daemons(
    module_daemons: DaemonPool, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemons]:
    root = tmp_path_factory.mktemp("fuzz-root")
    faulty_root = tmp_path_factory.mktemp("faulty-root")
    good = write_checkpoint(root / GOOD, BASE)
    options = ["--allow-remote-preload", "--drain-timeout", "1"]
    with pytest.MonkeyPatch.context() as env:  # the daemons' full-level hash cache
        env.setenv("WEIGHTCACHE_HASH_CACHE", str(tmp_path_factory.mktemp("hash-cache")))
        fuzzed = module_daemons.start(
            [good], args=[*options, "--model-root", str(root)], wait=False
        )
        faulty = module_daemons.start(
            [], args=[*options, "--model-root", str(faulty_root)], wait=False
        )
    fuzzed.wait_ready(START_TIMEOUT)
    faulty.wait_ready(START_TIMEOUT)
    yield Daemons(fuzzed, faulty, root, good, faulty_root)
    stop_together([fuzzed, faulty])


def preload(socket: str, path: Path, timeout: float = 60) -> list[pb.PreloadResponse]:
    with service_stub(socket) as stub:
        return list(stub.Preload(pb.PreloadRequest(path=str(path)), timeout=timeout))


def assert_still_serving(daemons: Daemons) -> None:
    """Health SERVING, ListModels answers, and the good model attaches bitwise."""
    socket = daemons.fuzzed.socket
    assert daemons.fuzzed.proc.poll() is None, daemons.fuzzed.log()
    assert health(socket) == "SERVING"
    with service_stub(socket) as stub:
        names = [m.name for m in stub.ListModels(pb.ListModelsRequest(), timeout=30).models]
    assert GOOD in names
    weights = weightcache.load(daemons.good, socket=socket, mode="copy", fallback=False)
    assert weights.source == "cache"
    assert_bitwise_equal(weights.tensors, base_tensors())
    assert_bitwise_equal(weights.tensors, weightcache.load_from_disk(daemons.good).tensors)
    with service_stub(socket) as stub:
        model = stub.GetModel(pb.GetModelRequest(name=GOOD), timeout=30).model
    assert model.lease_count == 0


# -- 2. remote Preload ---------------------------------------------------------------


@fuzz(80)
@given(raw=checkpoint_files)
def test_remote_preload_refuses_or_serves_what_disk_loading_gives(
    daemons: Daemons, raw: bytes
) -> None:
    folder = write_checkpoint(daemons.root / "case", raw)
    socket = daemons.fuzzed.socket

    try:
        responses = preload(socket, folder)
    except grpc.RpcError as exc:
        failure = rpc_failure(exc)
        event(failure.reason)
        if failure.reason == "MODEL_EXISTS":  # the same bytes as the good model
            assert (failure.code, failure.metadata["model"]) == (
                grpc.StatusCode.ALREADY_EXISTS,
                GOOD,
            )
            return
        assert (failure.code, failure.reason) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_CHECKPOINT",
        ), failure
        with pytest.raises(weightcache.InvalidCheckpointError):
            weightcache.open_checkpoint(folder)
        return
    last = responses[-1]
    event("READY")
    assert (last.model, last.state) == ("case", pb.MODEL_STATE_READY), last
    try:
        attached = weightcache.load(folder, socket=socket, mode="copy", fallback=False)
        assert attached.source == "cache"
        disk = weightcache.load_from_disk(folder).tensors
        assert_bitwise_equal(attached.tensors, disk)
        assert_declared(attached.tensors, raw)
    finally:
        with service_stub(socket) as stub:
            stub.Evict(pb.EvictRequest(name="case"), timeout=30)


def test_daemon_serves_after_fuzzed_preloads(daemons: Daemons) -> None:
    assert_still_serving(daemons)


# -- 3. malformed requests -----------------------------------------------------------

interesting_text = st.sampled_from(
    ["", "\0", "a\0b", "..", "../../etc/passwd", "/", "/etc/shadow", "\U0010ffff", "é" * 3]
)
texts = st.one_of(
    st.text(max_size=40),
    interesting_text,
    st.builds(lambda c, n: c * n, st.characters(), st.integers(100, 5000)),
)
int32 = st.integers(-(2**31), 2**31 - 1)
durations = st.builds(
    duration_pb2.Duration,
    seconds=st.one_of(st.integers(-5, 400), st.integers(-(2**40), 2**40)),
    nanos=st.integers(-999_999_999, 999_999_999),
)
digests = st.one_of(st.from_regex(r"[0-9a-f]{64}", fullmatch=True), texts)
components = st.lists(st.builds(pb.FingerprintComponent, name=texts, digest=digests), max_size=5)


@st.composite
def preload_requests(draw: st.DrawFn, root: Path, good: Path) -> pb.PreloadRequest:
    path = draw(
        st.one_of(
            st.sampled_from([str(good), str(root), str(root / ".."), str(root / "nothing")]),
            texts,
            texts.map(lambda t: str(root / t.replace("\0", ""))),
        )
    )
    recipe = pb.Recipe(
        dtype=draw(st.one_of(st.sampled_from(["", "F16", "bf16", "I64", "F8_E4M3"]), texts)),
        plugins=draw(
            st.lists(
                st.builds(
                    pb.RecipePlugin,
                    name=texts,
                    params=st.dictionaries(texts, texts, max_size=2),
                ),
                max_size=2,
            )
        ),
        tp_rules=draw(
            st.lists(
                st.builds(
                    pb.TensorParallelRule,
                    pattern=st.one_of(texts, st.just("*")),
                    style=st.one_of(texts, st.sampled_from(["colwise", "rowwise", "replicate"])),
                ),
                max_size=2,
            )
        ),
    )
    return pb.PreloadRequest(
        path=path,
        recipe=recipe,
        placement=draw(
            st.one_of(
                st.builds(pb.Placement, tp_rank=st.just(0), tp_size=st.sampled_from([0, 1, 2])),
                st.builds(pb.Placement, tp_rank=int32, tp_size=int32),
            )
        ),
        # Unknown values on purpose: a proto3 enum field takes any int, though the generated
        # stub types it as the FingerprintLevel wrapper.
        fingerprint_level=draw(st.integers(0, 6)),  # type: ignore[arg-type]
    )


@st.composite
def acquire_requests(draw: st.DrawFn, valid: pb.AcquireRequest) -> pb.AcquireRequest:
    request = pb.AcquireRequest()
    request.CopyFrom(valid)
    if draw(st.booleans()):
        request.fingerprint.digest = draw(digests)
    if draw(st.booleans()):
        del request.fingerprint.components[:]
        request.fingerprint.components.extend(draw(components))
    request.request_id = draw(texts)
    request.checkpoint_path = draw(texts)
    request.pid = draw(int32)
    if draw(st.booleans()):
        request.ttl.CopyFrom(draw(durations))
    else:
        request.ClearField("ttl")
    request.environment.CopyFrom(
        pb.Environment(weightcache_version=draw(texts), torch_version=draw(texts))
    )
    return request


RPCS = [
    "Preload",
    "GetModel",
    "ListModels",
    "Acquire",
    "KeepAlive",
    "Release",
    "Evict",
    "GetServerInfo",
]


@st.composite
def requests_for(draw: st.DrawFn, rpc: str, daemons: Daemons, valid: pb.AcquireRequest) -> Any:
    """A request message (a list of them for KeepAlive) with random field values."""
    request: Any
    if rpc == "Preload":
        request = draw(preload_requests(daemons.root, daemons.good))
    elif rpc == "GetModel":
        request = pb.GetModelRequest(name=draw(st.one_of(texts, st.just(GOOD))))
    elif rpc == "Acquire":
        request = draw(acquire_requests(valid))
    elif rpc == "KeepAlive":
        ids = st.lists(st.one_of(texts, st.from_regex(r"[0-9a-f]{32}", fullmatch=True)), max_size=4)
        request = draw(st.lists(st.builds(pb.KeepAliveRequest, lease_ids=ids), max_size=3))
    elif rpc == "Release":
        request = pb.ReleaseRequest(lease_id=draw(texts))
    elif rpc == "Evict":
        name = draw(texts)
        assume(name != GOOD)
        request = pb.EvictRequest(name=name, force=draw(st.booleans()))
    elif rpc == "ListModels":
        request = pb.ListModelsRequest()
    else:
        request = pb.GetServerInfoRequest()
    return request


@pytest.fixture(scope="module")
def channel(daemons: Daemons) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(
        f"unix:{daemons.fuzzed.socket}",
        options=[("grpc.max_receive_message_length", 256 * 2**20)],
    ) as opened:
        yield opened


def _invoke(stub: pb_grpc.WeightCacheServiceStub, rpc: str, request: Any) -> list[Any]:
    """Run one call to its end; the messages it returned."""
    if rpc == "Preload":
        return list(stub.Preload(request, timeout=60))
    if rpc == "KeepAlive":
        return list(stub.KeepAlive(iter(request), timeout=60))
    return [getattr(stub, rpc)(request, timeout=60)]


_VALID: dict[Path, pb.AcquireRequest] = {}


def _valid_acquire(model_dir: Path) -> pb.AcquireRequest:
    if model_dir not in _VALID:
        _VALID[model_dir] = acquire_request(model_dir)
    return _VALID[model_dir]


@pytest.mark.parametrize("rpc", RPCS)
@fuzz(30)
@given(data=st.data())
def test_random_requests_get_only_documented_codes(
    daemons: Daemons, channel: grpc.Channel, rpc: str, data: st.DataObject
) -> None:
    valid = _valid_acquire(daemons.good)
    request = data.draw(requests_for(rpc, daemons, valid), label="request")
    stub = pb_grpc.WeightCacheServiceStub(channel)

    try:
        replies = _invoke(stub, rpc, request)
    except grpc.RpcError as exc:
        event(f"{rpc} {exc.code().name}")
        assert_documented(rpc, exc)
        return
    event(f"{rpc} OK")
    if rpc == "Acquire":
        assert replies[0].lease.model == GOOD
        stub.Release(pb.ReleaseRequest(lease_id=replies[0].lease.lease_id), timeout=60)
    if rpc == "Evict":
        assert replies[0].model.name != GOOD


#: A raw message to an RPC: random bytes, or a valid message with random unknown fields.
raw_messages = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda number, payload: _tag(number, 2) + _varint(len(payload)) + payload,
        st.integers(1, 2**29 - 1),
        st.binary(max_size=64),
    ),
)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


REQUEST_TYPES: dict[str, Any] = {
    "Preload": pb.PreloadRequest,
    "GetModel": pb.GetModelRequest,
    "ListModels": pb.ListModelsRequest,
    "Acquire": pb.AcquireRequest,
    "KeepAlive": pb.KeepAliveRequest,
    "Release": pb.ReleaseRequest,
    "Evict": pb.EvictRequest,
    "GetServerInfo": pb.GetServerInfoRequest,
}


def _decodes(rpc: str, raw: bytes) -> Any:
    """The request ``raw`` decodes to, or None."""
    try:
        return REQUEST_TYPES[rpc].FromString(raw)
    except DecodeError:
        return None


def _identity(raw: bytes) -> bytes:
    return raw


@pytest.mark.parametrize("rpc", RPCS)
@fuzz(25)
@given(raw=raw_messages)
def test_raw_bytes_get_only_documented_codes(
    daemons: Daemons, channel: grpc.Channel, rpc: str, raw: bytes
) -> None:
    decoded = _decodes(rpc, raw)
    assume(not (rpc == "Evict" and decoded is not None and decoded.name == GOOD))
    path = SERVICE + rpc

    try:
        if rpc == "Preload":
            list(channel.unary_stream(path, _identity, _identity)(raw, timeout=60))
        elif rpc == "KeepAlive":
            list(channel.stream_stream(path, _identity, _identity)(iter([raw]), timeout=60))
        else:
            reply = channel.unary_unary(path, _identity, _identity)(raw, timeout=60)
            if rpc == "Acquire":  # only a request that decodes to a valid fingerprint
                lease = pb.AcquireResponse.FromString(reply).lease.lease_id
                pb_grpc.WeightCacheServiceStub(channel).Release(
                    pb.ReleaseRequest(lease_id=lease), timeout=60
                )
    except grpc.RpcError as exc:
        event(f"{'decodes' if decoded is not None else 'undecodable'} {exc.code().name}")
        if decoded is None:
            # Bytes that do not decode are a malformed request like any other.
            failure = rpc_failure(exc)
            assert (failure.code, failure.reason, failure.metadata) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_ARGUMENT",
                {"field": "request"},
            ), (rpc, failure)
            assert failure.message.startswith(f"the request to {path} does not decode: ")
        else:
            assert_documented(rpc, exc)
        return
    # Accepted: the bytes decode.
    event(f"{'decodes' if decoded is not None else 'undecodable'} OK")
    assert decoded is not None, (rpc, raw)


def test_daemon_serves_after_fuzzed_requests(daemons: Daemons) -> None:
    assert_still_serving(daemons)


# -- faults the fuzzing found (regression tests) -----------------------------------


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _deep(depth: int) -> bytes:
    return b'{"a": ' + b"[" * depth + b"]" * depth + b"}"


FAULTS: dict[str, bytes] = {
    # json.loads raises RecursionError, which _checkpoint.read_shard_header does not catch.
    "deeply-nested-header": struct.pack("<Q", 2 * 100_000 + 7) + _deep(100_000),
    # _fingerprint._sampled_digest encodes tensor names with str.encode(): a lone surrogate
    # (legal as a JSON \\u escape) raises UnicodeEncodeError.
    "surrogate-tensor-name": pack({"\ud800": _entry("F32", [1], 0, 4)}, bytes(4)),
    # A zero-size tensor with a dimension of 2**64: validation passes (0 bytes); torch.empty
    # raises TypeError on the disk path; the daemon's TensorView (int64) raises ValueError.
    "zero-size-dim-2**64": pack({"a": _entry("F32", [0, 2**64], 0, 0)}, b""),
    # Zero elements, but strides overflow int64: torch raises RuntimeError on the disk path,
    # the daemon's TensorView stride raises ValueError.
    "zero-size-stride-overflow": pack({"a": _entry("F32", [0, 2**40, 2**40], 0, 0)}, b""),
}
DAEMON_FAULTS: dict[str, bytes] = {
    **FAULTS,
    # Loads, but Model.metadata (map<string, string>) cannot hold the lone surrogate: every
    # ListModels, and GetModel/Evict/Acquire of the model, fail with UNKNOWN from then on.
    "surrogate-metadata": pack(
        {"__metadata__": {"k": "\udfff"}, "a": _entry("F32", [1], 0, 4)}, bytes(4)
    ),
}


@pytest.mark.parametrize("case", sorted(FAULTS))
def test_known_fault_on_disk_is_invalid_checkpoint(tmp_path: Path, case: str) -> None:
    folder = write_checkpoint(tmp_path / case, FAULTS[case])

    with pytest.raises(weightcache.InvalidCheckpointError):
        weightcache.load_from_disk(folder)


def test_deeply_nested_index_is_invalid_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "nested-index"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_bytes(_deep(100_000))

    with pytest.raises(weightcache.InvalidCheckpointError):
        weightcache.open_checkpoint(folder)


@pytest.mark.parametrize("case", sorted(DAEMON_FAULTS))
def test_known_fault_in_remote_preload_is_invalid_checkpoint(daemons: Daemons, case: str) -> None:
    folder = write_checkpoint(daemons.faulty_root / case, DAEMON_FAULTS[case])
    socket = daemons.faulty.socket

    try:
        responses = preload(socket, folder, timeout=30)
    except grpc.RpcError as exc:
        failure = rpc_failure(exc)
        assert (failure.code, failure.reason) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_CHECKPOINT",
        )
    else:
        # Accepting it would be fine only if it then behaved like any model.
        assert responses[-1].state == pb.MODEL_STATE_READY, responses[-1]
        with service_stub(socket) as stub:
            stub.ListModels(pb.ListModelsRequest(), timeout=30)
            stub.Evict(pb.EvictRequest(name=case), timeout=30)
    assert health(socket) == "SERVING"
