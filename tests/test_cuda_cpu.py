"""The CUDA IPC backend, as far as it can be checked without a GPU.

What runs here: the wire handle, UUID -> local index mapping, the refusals that must come
before any CUDA call, the CLI's refusal of ``--device`` without a device, the default lease
policy per device, the systemd template, and the ctypes calling convention of the runtime
binding against a stand-in runtime library compiled here (a C ``cudaIpcOpenMemHandle``
that takes its handle by value, as the real one does). Everything that needs a device is
in ``tests/gpu``.

Tests that assert what happens where torch sees *no* CUDA device are skipped on a GPU
machine; the others run everywhere.
"""

from __future__ import annotations

import configparser
import ctypes
import os
import shlex
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support import run_cli, short_tempdir
from weightcache._handles import open_cuda_ipc
from weightcache._lease import default_policy
from weightcache._loader import _FALLBACK_REASONS, _Attach
from weightcache._options import Mode
from weightcache.core import cuda as _cuda
from weightcache.core.cuda import (
    IPC_HANDLE_BYTES,
    Runtime,
    format_uuid,
    local_index,
    open_ipc,
)
from weightcache.core.errors import (
    CudaError,
    DeviceNotVisibleError,
    HandleError,
    WeightCacheError,
)
from weightcache.core.protocol import tensor_view_pb
from weightcache.core.records import CudaIpcHandle, TensorView, ViewColumns
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache_service.arena import plan_slots
from weightcache_service.cli import _parser

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "deploy" / "systemd" / "weightcache@.service"

WITHOUT_CUDA = pytest.mark.skipif(
    torch.cuda.is_available(), reason="asserts what happens where torch sees no CUDA device"
)

#: 64 bytes with every kind of value a handle holds: 0x00, 0xff, bytes that are not UTF-8.
RAW = bytes([0x00, 0xFF, 0x80, 0x7F, *range(1, 61)])
UUID_A = "GPU-0a1b2c3d-0000-4000-8000-00000000000a"
UUID_B = "GPU-0a1b2c3d-0000-4000-8000-00000000000b"
UUID_C = "GPU-0a1b2c3d-0000-4000-8000-00000000000c"
#: No GPU anywhere has this UUID.
ABSENT = "GPU-deadbeef-0000-4000-8000-000000000000"
BIG_SIZE = 8 * 2**30 + 256


# -- the handle on the wire ------------------------------------------------------------


def test_cuda_ipc_handle_round_trips_raw_bytes_and_size() -> None:
    slots, size = plan_slots([("w", "BF16", (4, 8)), ("q", "F8_E4M3", (16,))])
    reply = pb.AcquireResponse(
        storage=pb.StorageHandle(
            cuda_ipc=pb.CudaIpcHandle(device_uuid=UUID_A, ipc_handle=RAW, size=BIG_SIZE)
        ),
        tensors=[tensor_view_pb(slot.view()) for slot in slots],
    )

    assert len(RAW) == IPC_HANDLE_BYTES == 64
    wire = reply.SerializeToString()
    back = pb.AcquireResponse.FromString(wire)

    assert back.storage.WhichOneof("handle") == "cuda_ipc"
    handle = back.storage.cuda_ipc
    assert handle.ipc_handle == RAW
    assert len(handle.ipc_handle) == 64
    assert handle.size == BIG_SIZE == 8589934848
    assert handle.device_uuid == UUID_A
    assert [
        (v.name, v.dtype, list(v.shape), list(v.stride), v.byte_offset) for v in back.tensors
    ] == [
        ("w", "BF16", [4, 8], [8, 1], 0),
        ("q", "F8_E4M3", [16], [1], 256),
    ]
    assert size == 512
    # The raw bytes are on the wire as they are: length-delimited, no text encoding.
    assert RAW in wire


@pytest.mark.parametrize("length", [0, 16, 63, 65, 128])
def test_open_ipc_refuses_a_handle_that_is_not_64_bytes_before_loading_a_runtime(
    monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    loads: list[str] = []

    def runtime_spy() -> Runtime:
        loads.append("runtime()")
        raise AssertionError("open_ipc loaded the runtime before checking the handle")

    monkeypatch.setattr(_cuda, "runtime", runtime_spy)
    monkeypatch.setattr(_cuda, "_opened", {})

    with pytest.raises(CudaError) as raised:
        open_ipc(bytes(length), 256, 0)

    assert str(raised.value) == f"an IPC handle is 64 bytes, not {length}"
    assert raised.value.reason == "CUDA_ERROR"
    assert loads == []
    assert _cuda._opened == {}


# -- devices by UUID ---------------------------------------------------------------------


def test_format_uuid_writes_what_nvidia_smi_prints() -> None:
    bare = "0a1b2c3d-0000-4000-8000-00000000000a"
    assert format_uuid(bare) == UUID_A
    assert format_uuid(UUID_A) == UUID_A
    assert format_uuid(uuid.UUID(bare)) == UUID_A  # str() of a UUID-like object
    assert format_uuid("MIG-" + bare) == "MIG-" + bare


def test_local_index_finds_the_device_under_a_visible_list() -> None:
    visible = [UUID_A, UUID_B, UUID_C.removeprefix("GPU-")]

    assert local_index(UUID_A, uuids=visible) == 0
    assert local_index(UUID_B, uuids=visible) == 1
    assert local_index(UUID_B.removeprefix("GPU-"), uuids=visible) == 1
    assert local_index(UUID_C, uuids=visible) == 2
    # The same device under another CUDA_VISIBLE_DEVICES has another index.
    assert local_index(UUID_B, uuids=[UUID_C, UUID_B]) == 1
    assert local_index(UUID_B, uuids=[UUID_B]) == 0


@pytest.mark.parametrize("env", ["2,3", None], ids=["set", "unset"])
def test_local_index_names_cuda_visible_devices_when_the_device_is_absent(
    monkeypatch: pytest.MonkeyPatch, env: str | None
) -> None:
    if env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)

    with pytest.raises(DeviceNotVisibleError) as raised:
        local_index(UUID_C.removeprefix("GPU-"), uuids=[UUID_A, UUID_B])

    shown = "<unset>" if env is None else env
    assert str(raised.value) == (
        f"device {UUID_C} is not visible to this process (CUDA_VISIBLE_DEVICES={shown}; "
        f"visible: ['{UUID_A}', '{UUID_B}'])"
    )
    assert raised.value.reason == "DEVICE_NOT_VISIBLE"


@WITHOUT_CUDA
def test_local_index_without_a_cuda_device_is_device_not_visible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")

    with pytest.raises(DeviceNotVisibleError) as raised:
        local_index(UUID_A)

    assert str(raised.value) == (
        f"device {UUID_A} is not visible to this process (CUDA_VISIBLE_DEVICES=0; visible: [])"
    )


# -- refusals before any CUDA call -------------------------------------------------------


def _records() -> list[TensorView]:
    slots, _ = plan_slots([("w", "BF16", (4, 8)), ("q", "F8_E4M3", (16,))])
    return [slot.view() for slot in slots]


def _views() -> ViewColumns:
    return ViewColumns.of_rows(view.row() for view in _records())


@pytest.mark.parametrize("copy", [False, True], ids=["zero_copy", "copy"])
def test_open_cuda_ipc_of_an_invisible_device_is_refused_before_any_runtime_call(
    monkeypatch: pytest.MonkeyPatch, copy: bool
) -> None:
    monkeypatch.setattr(_cuda, "runtime", _no_runtime)
    handle = CudaIpcHandle(device_uuid=ABSENT, ipc_handle=bytes(64), size=256)

    with pytest.raises(DeviceNotVisibleError) as raised:
        open_cuda_ipc(handle, _views(), copy=copy)

    assert raised.value.reason == "DEVICE_NOT_VISIBLE"
    assert str(raised.value).startswith(f"device {ABSENT} is not visible to this process")


def _no_runtime() -> Runtime:
    raise AssertionError("a CUDA runtime call was made for a device that is not visible")


def _attach(mode: Mode = "zero_copy") -> _Attach:
    return _Attach(
        socket="/nonexistent/d.sock",
        mode=mode,
        ttl=10.0,
        wait_timeout=0.0,
        wait_for_daemon=False,
        policy=None,
        on_lost=None,
        on_revoke="copy",
        trusted=frozenset({os.getuid()}),
    )


@pytest.mark.parametrize("mode", ["zero_copy", "copy"])
def test_attach_maps_a_cuda_handle_it_cannot_see_to_device_not_visible(
    monkeypatch: pytest.MonkeyPatch, mode: Mode
) -> None:
    """What ``load()`` meets when a CUDA daemon's device is not visible here: the daemon's
    AcquireResponse, as the protobuf message it sends, opened by the attach step."""
    monkeypatch.setattr(_cuda, "runtime", _no_runtime)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    reply = pb.AcquireResponse(
        lease=pb.Lease(lease_id="l" * 32, instance_id="i" * 32),
        storage=pb.StorageHandle(
            cuda_ipc=pb.CudaIpcHandle(device_uuid=ABSENT, ipc_handle=RAW, size=512)
        ),
        tensors=[tensor_view_pb(v) for v in _records()],
    )

    with pytest.raises(DeviceNotVisibleError) as raised:
        _attach(mode)._map(reply, os.getuid())

    assert raised.value.reason == "DEVICE_NOT_VISIBLE"
    assert raised.value.reason in _FALLBACK_REASONS
    assert "(CUDA_VISIBLE_DEVICES=; visible: " in str(raised.value)


def test_attach_refuses_a_reply_without_a_handle() -> None:
    reply = pb.AcquireResponse(
        lease=pb.Lease(lease_id="l" * 32), tensors=[tensor_view_pb(v) for v in _records()]
    )

    with pytest.raises(HandleError) as raised:
        _attach()._map(reply, os.getuid())

    assert str(raised.value) == "the daemon offers a handle this client does not know: None"
    assert raised.value.reason == "INVALID_HANDLE"
    assert raised.value.reason in _FALLBACK_REASONS


def test_cuda_errors_fall_back_to_disk_with_their_reason() -> None:
    assert issubclass(DeviceNotVisibleError, WeightCacheError)
    assert issubclass(CudaError, WeightCacheError)
    assert DeviceNotVisibleError("x").reason == "DEVICE_NOT_VISIBLE"
    assert CudaError("x").reason == "CUDA_ERROR"
    assert {"DEVICE_NOT_VISIBLE", "CUDA_ERROR"} <= _FALLBACK_REASONS


def test_default_lease_policy_by_device() -> None:
    assert default_policy("cuda") == "exit"
    assert default_policy("cpu") == "ignore"


# -- the CLI without a device ------------------------------------------------------------


@WITHOUT_CUDA
@pytest.mark.parametrize("device", ["cuda:0", "GPU-nonexistent"])
def test_preload_on_a_device_torch_cannot_see_exits_1_and_binds_nothing(device: str) -> None:
    folder = short_tempdir()
    socket = folder / "run" / "d.sock"
    try:
        result = run_cli("preload", "--device", device, "--socket", str(socket))

        assert (result.returncode, result.stdout) == (1, "")
        assert result.stderr == (
            f"weightcache preload: --device {device}: torch sees no CUDA/ROCm device\n"
        )
        assert os.listdir(folder) == []  # no socket folder, socket or lock file
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@WITHOUT_CUDA
def test_preload_on_a_device_torch_cannot_see_without_socket_exits_1() -> None:
    """Without ``--socket`` the default path is named after the device's UUID, so the
    device is resolved earlier, while choosing the path: same refusal."""
    result = run_cli("preload", "--device", "GPU-nonexistent")

    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (
        "weightcache preload: --device GPU-nonexistent: torch sees no CUDA/ROCm device\n"
    )


# -- the systemd template ----------------------------------------------------------------


def _unit() -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=True, delimiters=("=",), comment_prefixes=("#",))
    # typeshed declares optionxform a method; the configparser docs say to assign it.
    parser.optionxform = str  # type: ignore[method-assign,assignment]
    parser.read_string(UNIT.read_text())
    return parser


def test_systemd_template_runs_one_daemon_per_gpu_instance() -> None:
    unit = _unit()

    assert unit.sections() == ["Unit", "Service", "Install"]
    service = unit["Service"]
    start = shlex.split(service["ExecStart"])
    assert start[:2] == ["/usr/local/bin/weightcache", "preload"]
    assert start[start.index("--device") + 1] == "%i"
    # No --socket: the socket is the device's by the rule (weightcache.core.sockets).
    assert "--socket" not in start
    assert {"$WEIGHTCACHE_MODELS", "$WEIGHTCACHE_ARGS"} <= set(start)
    # Readiness is the daemon's own sd_notify READY=1 (no polling ExecStartPost).
    assert (service["Type"], service["NotifyAccess"]) == ("notify", "main")
    assert "ExecStartPost" not in service
    assert service["EnvironmentFile"] == "-/etc/weightcache/%i.env"
    assert service["Environment"].split() == [
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False",
        "CUDA_DEVICE_ORDER=PCI_BUS_ID",
        "WEIGHTCACHE_HASH_CACHE=/var/cache/weightcache/sha256",
        "WEIGHTCACHE_RUNTIME_DIR=/run/weightcache",
    ]
    assert service["KillSignal"] == "SIGTERM"
    # Stopping waits for the drain (--drain-timeout, default 30 s) and then some.
    assert int(service["TimeoutStopSec"]) > 30
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_systemd_template_flags_are_the_cli_flags() -> None:
    start = shlex.split(_unit()["Service"]["ExecStart"])
    argv = [arg.replace("%i", "0") for arg in start[1:] if not arg.startswith("$")]

    args = _parser().parse_args([*argv, "/models/a"])

    assert (args.command, args.device, args.log_format) == ("preload", "0", "json")
    assert args.socket is None  # the device's default socket
    assert args.models == ["/models/a"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("instance", ["0", "GPU-8f3c1a2b-0000-4000-8000-000000000001"])
def test_systemd_analyze_verifies_an_instance(tmp_path: Path, instance: str) -> None:
    # The binary must exist for `verify`; point it at one that does, change nothing else.
    text = UNIT.read_text().replace("/usr/local/bin/weightcache", shutil.which("true") or "")
    (tmp_path / UNIT.name).write_text(text)

    result = subprocess.run(
        ["systemd-analyze", "verify", f"./weightcache@{instance}.service"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


# -- the runtime binding's calling convention --------------------------------------------

#: A stand-in CUDA/HIP runtime with the real signatures (cuda_runtime_api.h, hip_runtime_api.h).
#: It records what it was given; fake_* functions read that back.
FAKE_RUNTIME_C = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct { char reserved[64]; } ipc_handle_t;

static int device = -1, last_error = 0;
static unsigned int flags_seen = 0;
static char handle_seen[64];
static void *closed = 0, *freed = 0;

static int fail(int code) { last_error = code; return code; }

#define RUNTIME(P)                                                                      \
int P##SetDevice(int d) { if (d < 0 || d > 7) return fail(101); device = d; return 0; } \
int P##Malloc(void **p, size_t n) {                                                     \
    if (n >> 44) return fail(2);                                                        \
    *p = (void *)(uintptr_t)(0x7f0000000000ull + n); return 0; }                        \
int P##Free(void *p) { freed = p; return 0; }                                           \
int P##IpcGetMemHandle(ipc_handle_t *h, void *p) {                                      \
    uint64_t v = (uint64_t)(uintptr_t)p;                                                \
    for (int i = 0; i < 64; i++) h->reserved[i] = (char)((v >> (8 * (i % 8))) ^ i);    \
    return 0; }                                                                         \
int P##IpcOpenMemHandle(void **p, ipc_handle_t h, unsigned int flags) {                 \
    memcpy(handle_seen, h.reserved, 64); flags_seen = flags;                            \
    if ((unsigned char)h.reserved[0] == 0xff) return fail(201);                         \
    uint64_t v = 0;                                                                     \
    for (int i = 0; i < 8; i++)                                                         \
        v |= (uint64_t)((unsigned char)h.reserved[i] ^ i) << (8 * i);                  \
    *p = (void *)(uintptr_t)v; return 0; }                                              \
int P##IpcCloseMemHandle(void *p) { closed = p; return 0; }                             \
int P##GetLastError(void) { int e = last_error; last_error = 0; return e; }             \
const char *P##GetErrorString(int code) {                                               \
    return code == 201 ? "invalid device context"                                       \
         : code == 2 ? "out of memory" : "unknown error"; }

RUNTIME(cuda)
RUNTIME(hip)

int fake_device(void) { return device; }
int fake_pending_error(void) { return last_error; }
unsigned int fake_flags(void) { return flags_seen; }
const char *fake_handle(void) { return handle_seen; }
void *fake_closed(void) { return closed; }
void *fake_freed(void) { return freed; }
"""


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ctypes.CDLL]:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler to build the stand-in runtime")
    folder = tmp_path_factory.mktemp("fake-cudart")
    (folder / "fake.c").write_text(FAKE_RUNTIME_C)
    library = folder / "libfakecudart.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(folder / "fake.c")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    lib = ctypes.CDLL(str(library))
    lib.fake_handle.restype = ctypes.c_void_p
    lib.fake_closed.restype = ctypes.c_void_p
    lib.fake_freed.restype = ctypes.c_void_p
    lib.fake_flags.restype = ctypes.c_uint
    yield lib


def _runtime(lib: ctypes.CDLL, prefix: str) -> Runtime:
    """The binding's code over the stand-in library (its constructor finds the real one)."""
    rt = Runtime.__new__(Runtime)
    rt.prefix = prefix
    rt._lib = lib
    return rt


#: Above 4 GiB: a size or pointer cut to 32 bits would show.
SIZE = 5 * 2**30 + 512
PTR = 0x7F0000000000 + SIZE


@pytest.mark.parametrize("prefix", ["cuda", "hip"])
def test_runtime_passes_sizes_pointers_and_the_handle_by_value(
    fake_lib: ctypes.CDLL, prefix: str
) -> None:
    rt = _runtime(fake_lib, prefix)

    rt.set_device(3)
    assert fake_lib.fake_device() == 3
    ptr = rt.malloc(SIZE)
    assert ptr == PTR == 0x7F0140000200
    raw = rt.ipc_get_handle(ptr)
    assert len(raw) == 64
    assert raw[:8] == bytes(((PTR >> (8 * i)) & 0xFF) ^ i for i in range(8))

    # cudaIpcOpenMemHandle(void **devPtr, cudaIpcMemHandle_t handle, unsigned int flags):
    # the 64-byte struct is passed by value, the flag is cudaIpcMemLazyEnablePeerAccess.
    assert rt.ipc_open(raw) == PTR
    assert ctypes.string_at(fake_lib.fake_handle(), 64) == raw
    assert fake_lib.fake_flags() == 1
    other = RAW[2:] + bytes(2)
    want = int.from_bytes(bytes(b ^ i for i, b in enumerate(other[:8])), "little")
    assert rt.ipc_open(other) == want
    assert ctypes.string_at(fake_lib.fake_handle(), 64) == other

    rt.ipc_close(PTR)
    assert fake_lib.fake_closed() == PTR
    rt.free(PTR)
    assert fake_lib.fake_freed() == PTR


@pytest.mark.parametrize("prefix", ["cuda", "hip"])
def test_runtime_errors_name_the_call_and_clear_the_last_error(
    fake_lib: ctypes.CDLL, prefix: str
) -> None:
    rt = _runtime(fake_lib, prefix)

    with pytest.raises(CudaError) as opened:
        rt.ipc_open(RAW[1:2] + bytes(63))
    with pytest.raises(CudaError) as allocated:
        rt.malloc(2**45)
    with pytest.raises(CudaError) as selected:
        rt.set_device(-1)

    assert str(opened.value) == f"{prefix}IpcOpenMemHandle failed: invalid device context (201)"
    assert str(allocated.value) == f"{prefix}Malloc failed: out of memory (2)"
    assert str(selected.value) == f"{prefix}SetDevice failed: unknown error (101)"
    assert opened.value.reason == "CUDA_ERROR"
    # torch reads cudaGetLastError after its own kernel launches: nothing may be left there.
    assert fake_lib.fake_pending_error() == 0
