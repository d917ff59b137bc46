"""The C++ worker of examples/cpp/, built with CMake against the distribution's gRPC and run
as its own process against a real daemon: the tensors it reads from shared memory are
bitwise what Python's safetensors reads from the checkpoint files, in either tensor format,
a wrong model gets the daemon's exact reason, and every lease it took is released when it
exits. A process posing as the daemon serves it crafted views (a byte_offset near 2^63, an
overflowing stride, a malformed table): it refuses them with INVALID_HANDLE, reading no byte.
Its dtype table and its $WEIGHTCACHE_TRUSTED_UID are the Python SDK's."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from tests.race_support import preload_changing, racing_daemon
from tests.support import (
    INDEX_FILE,
    SMALL_TENSOR,
    Checkpoints,
    Daemon,
    DaemonPool,
    get_model,
    pb,
    pb_grpc,
    raw_bytes,
    serve_on_unix,
    service_stub,
    wait_until,
)
from weightcache._trust import ENV_TRUSTED_UID, trusted_uids
from weightcache.core.dtypes import TORCH_DTYPES
from weightcache.core.errors import HandleError, UntrustedSocketError
from weightcache.core.protocol import tensor_table_pb, tensor_view_from_pb, view_columns_from_pb
from weightcache.testing import list_models

# A cold build takes minutes on a loaded 2-core machine; `make test` builds it first.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "examples" / "cpp"
BUILD = ROOT / ".build" / "cpp"
WORKER_TIMEOUT = 60.0

# The worker's exit codes (examples/cpp/src/failure.h).
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_INVALID_HANDLE = 5
EXIT_LEASE_LOST = 6
EXIT_TENSOR_NOT_FOUND = 7
EXIT_UNTRUSTED_SOCKET = 8
NOBODY = 65534
_TOOLS = ("cmake", "protoc", "grpc_cpp_plugin", "pkg-config")
# A lease's lines in the daemon's log: "<time> [info     ] <event>   lease=<8 hex> ...".
_LEASE_EVENT = re.compile(r"\] (\S.*?)\s{2,}.*?\blease=(\w{8})")


def _missing_tools() -> list[str]:
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if "pkg-config" not in missing:
        probe = subprocess.run(["pkg-config", "--exists", "grpc++"], check=False)
        if probe.returncode != 0:
            missing.append("grpc++ (libgrpc++-dev)")
    return missing


@pytest.fixture(scope="session")
def cpp_worker() -> Path:
    """The worker's executable, built (or brought up to date) once per session in .build/cpp.

    Skipped where the toolchain is missing, except in CI ($CI set), where `make test`
    installs it (`make cpp-deps`) and its absence is a failure.
    """
    missing = _missing_tools()
    if missing:
        message = f"C++ toolchain missing: {', '.join(missing)}; run `make cpp-deps`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    if not (BUILD / "CMakeCache.txt").exists():
        _run_build(["cmake", "-S", str(SOURCE), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release"])
    _run_build(["cmake", "--build", str(BUILD), "--parallel", str(os.cpu_count() or 1)])
    return BUILD / "weightcache-worker"


def _run_build(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"


def run_worker(
    worker: Path, socket: str, *args: str, env: Mapping[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    """Run the worker to completion, with these variables added to the environment;
    returns its exit code and the JSON it printed."""
    done = subprocess.run(
        [str(worker), "--socket", socket, *args],
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT,
        check=False,
        env={**os.environ, **(env or {})},
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 1, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    printed: dict[str, Any] = json.loads(lines[0])
    return done.returncode, printed


def expected_tensors(checkpoint: Path) -> dict[str, dict[str, Any]]:
    """What safetensors reads from the checkpoint's files: per tensor, its dtype name,
    shape, byte length and the sha256 of its bytes, as the worker prints them."""
    index = checkpoint / INDEX_FILE
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    found = {}
    for shard in shards:
        with safe_open(str(checkpoint / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                data = raw_bytes(f.get_tensor(name)).numpy().tobytes()
                found[name] = {
                    "name": name,
                    "dtype": f.get_slice(name).get_dtype(),
                    "shape": f.get_slice(name).get_shape(),
                    "nbytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
    return found


def printed_tensors(printed: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in printed["tensors"]}


def lease_events(daemon: Daemon) -> dict[str, list[str]]:
    """What the daemon's log says happened to each lease (by the 8-character prefix it
    logs): "acquired", then "released", "lease ended: keepalive stream closed" or
    "lease expired"."""
    events: dict[str, list[str]] = {}
    for event, lease in _LEASE_EVENT.findall(daemon.log()):
        events.setdefault(lease, []).append(event)
    return events


def assert_released(daemon: Daemon, model: str, lease_id: str) -> None:
    """The lease ended by the worker's Release (not by its stream's end, not by expiry),
    and the model has no live lease left."""
    assert lease_events(daemon)[lease_id[:8]] == ["acquired", "released"]
    assert get_model(daemon.socket, model).lease_count == 0


def assert_every_lease_released(daemon: Daemon) -> None:
    """Every lease the daemon granted so far was released, and no model has a live one."""
    events = lease_events(daemon)
    assert all(e == ["acquired", "released"] for e in events.values()), events
    assert all(m.lease_count == 0 for m in list_models(daemon.socket))


@pytest.fixture(scope="module")
def holder(module_daemons: DaemonPool, checkpoints: Checkpoints) -> Daemon:
    """A daemon holding ``single``, ``sharded`` and ``other-sharded`` (which one test
    evicts), at the default fingerprint level, full."""
    return module_daemons.start(
        [checkpoints.single, checkpoints.sharded, checkpoints.other_sharded]
    )


@pytest.mark.parametrize("name", ["sharded", "single"])
def test_attach_by_file_identity_reads_every_tensor_bitwise(
    cpp_worker: Path, holder: Daemon, checkpoints: Checkpoints, name: str
) -> None:
    checkpoint: Path = getattr(checkpoints, name)

    code, printed = run_worker(cpp_worker, holder.socket, "--checkpoint", str(checkpoint))

    assert code == 0, printed
    model = get_model(holder.socket, name)
    assert printed["model"] == name
    assert printed["match"] == "files"
    assert printed["fingerprint"] == model.fingerprint.digest
    assert printed["segment"]["size"] == model.size_bytes
    assert printed_tensors(printed) == expected_tensors(checkpoint)
    assert sorted(printed_tensors(printed)) == sorted(checkpoints.tensors)
    assert_released(holder, name, printed["lease_id"])


def test_the_table_format_reads_the_same_tensors_as_the_views(
    cpp_worker: Path, holder: Daemon, checkpoints: Checkpoints
) -> None:
    ask = ("--checkpoint", str(checkpoints.sharded))

    views_code, views = run_worker(cpp_worker, holder.socket, *ask, "--tensor-format", "views")
    table_code, table = run_worker(cpp_worker, holder.socket, *ask, "--tensor-format", "table")

    assert (views_code, table_code) == (0, 0), (views, table)
    assert table["tensors"] == views["tensors"]  # the same tensors, in the same order
    assert printed_tensors(table) == expected_tensors(checkpoints.sharded)
    assert_released(holder, "sharded", views["lease_id"])
    assert_released(holder, "sharded", table["lease_id"])


def test_the_dtype_table_is_the_python_sdks(cpp_worker: Path) -> None:
    done = subprocess.run(
        [str(cpp_worker), "--print-dtype-sizes"],
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    sizes = {name: dtype.itemsize for name, dtype in TORCH_DTYPES.items()}
    assert json.loads(done.stdout) == sizes


@pytest.mark.parametrize("mode", ["model-name", "checkpoint-path", "digest"])
def test_attach_trusting_the_daemons_fingerprint(
    cpp_worker: Path, holder: Daemon, checkpoints: Checkpoints, mode: str
) -> None:
    model = get_model(holder.socket, "sharded")
    identity = {
        "model-name": ["--model", "sharded"],
        "checkpoint-path": ["--trust-daemon", "--checkpoint", str(checkpoints.sharded)],
        "digest": ["--fingerprint", model.fingerprint.digest],
    }[mode]

    code, printed = run_worker(
        cpp_worker, holder.socket, *identity, "--tensor", "embed.weight", "--tensor", SMALL_TENSOR
    )

    assert code == 0, printed
    assert printed["match"] == "fingerprint"
    assert printed["fingerprint"] == model.fingerprint.digest
    expected = expected_tensors(checkpoints.sharded)
    assert printed_tensors(printed) == {n: expected[n] for n in ("embed.weight", SMALL_TENSOR)}
    assert_released(holder, "sharded", printed["lease_id"])


def test_keepalive_renews_a_short_lease_while_it_is_held(
    cpp_worker: Path, holder: Daemon, checkpoints: Checkpoints
) -> None:
    # A 2 s lease held for 3 s lives only if renewed (every 2/3 s: at 0, 0.67, 1.33, 2, 2.67 s).
    code, printed = run_worker(
        cpp_worker,
        holder.socket,
        *("--checkpoint", str(checkpoints.single), "--ttl", "2", "--hold", "3"),
        *("--tensor", "layers.1.scale"),
    )

    assert code == 0, printed
    assert printed["renewals"] >= 4
    expected = expected_tensors(checkpoints.single)["layers.1.scale"]
    assert printed["tensors"] == [expected]
    assert_released(holder, "single", printed["lease_id"])


# Per case: the worker's arguments ("other": that checkpoint's path), then the gRPC code,
# the ErrorInfo reason and a metadata key the daemon sends.
REFUSALS = {
    "unloaded-checkpoint": (["--checkpoint", "other"], "NOT_FOUND", "MODEL_NOT_FOUND", "path"),
    "unknown-digest": (["--fingerprint", "0" * 64], "NOT_FOUND", "MODEL_NOT_FOUND", "path"),
    "unknown-name": (["--model", "nosuch"], "NOT_FOUND", "MODEL_NOT_FOUND", "model"),
    "bad-digest": (["--fingerprint", "not-hex"], "INVALID_ARGUMENT", "INVALID_ARGUMENT", "field"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refusal_prints_the_code_and_the_reason(
    cpp_worker: Path, holder: Daemon, checkpoints: Checkpoints, case: str
) -> None:
    identity, code, reason, metadata = REFUSALS[case]
    args = [str(checkpoints.other) if a == "other" else a for a in identity]

    exit_code, printed = run_worker(cpp_worker, holder.socket, *args)

    assert exit_code == EXIT_REFUSED
    error = printed["error"]
    assert (error["source"], error["code"], error["reason"]) == ("daemon", code, reason)
    assert error["domain"] == "weightcache.v1"
    assert metadata in error["metadata"]
    assert_every_lease_released(holder)


def test_a_missing_tensor_fails_and_still_releases(
    cpp_worker: Path, holder: Daemon, checkpoints: Checkpoints
) -> None:
    code, printed = run_worker(
        cpp_worker, holder.socket, "--checkpoint", str(checkpoints.single), "--tensor", "nosuch"
    )

    assert code == EXIT_TENSOR_NOT_FOUND
    assert printed["error"]["reason"] == "TENSOR_NOT_FOUND"
    assert get_model(holder.socket, "single").lease_count == 0
    assert_every_lease_released(holder)


def test_a_revoked_lease_is_noticed_and_released(
    cpp_worker: Path, holder: Daemon, checkpoints: Checkpoints
) -> None:
    command = [str(cpp_worker), "--socket", holder.socket, "--hold", "30"]
    worker = subprocess.Popen(
        [*command, "--checkpoint", str(checkpoints.other_sharded)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: get_model(holder.socket, "other-sharded").lease_count == 1, 30)
        with service_stub(holder.socket) as stub:
            stub.Evict(pb.EvictRequest(name="other-sharded", force=True), timeout=10)
        stdout, stderr = worker.communicate(timeout=WORKER_TIMEOUT)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()

    assert worker.returncode == EXIT_LEASE_LOST, (stdout, stderr)
    error = json.loads(stdout)["error"]
    assert error["reason"] == "LEASE_LOST"
    assert "REVOKING" in error["message"]
    assert_every_lease_released(holder)
    wait_until(lambda: "other-sharded" not in [m.name for m in list_models(holder.socket)], 10)


# -- $WEIGHTCACHE_TRUSTED_UID and --trusted-uid ----------------------------------------

# Values the Python SDK refuses (int() does not read them) and values it reads as a uid,
# or as an integer no file has as owner ("-1", "4294967296").
UIDS_REFUSED = ["daemon", "10001,10002", "1__0", "0x2711", "10001.0", "_1", "1_", "+", " "]
UIDS_READ = [" 10001 ", "+10_001", "0010001", "-1", "4294967296"]


@pytest.mark.parametrize("value", UIDS_REFUSED)
def test_a_trusted_uid_variable_the_python_sdk_refuses_is_refused_alike(
    cpp_worker: Path,
    holder: Daemon,
    checkpoints: Checkpoints,
    monkeypatch: pytest.MonkeyPatch,
    value: str,
) -> None:
    monkeypatch.setenv(ENV_TRUSTED_UID, value)
    with pytest.raises(UntrustedSocketError) as python:
        trusted_uids()

    code, printed = run_worker(cpp_worker, holder.socket, "--checkpoint", str(checkpoints.single))

    assert code == EXIT_UNTRUSTED_SOCKET
    error = printed["error"]
    assert (error["source"], error["reason"]) == ("worker", python.value.reason)
    assert error["message"] == str(python.value) == "$WEIGHTCACHE_TRUSTED_UID is not a uid"
    assert_every_lease_released(holder)


@pytest.mark.parametrize("value", UIDS_READ)
def test_a_trusted_uid_variable_the_python_sdk_reads_is_read_alike(
    cpp_worker: Path,
    holder: Daemon,
    checkpoints: Checkpoints,
    monkeypatch: pytest.MonkeyPatch,
    value: str,
) -> None:
    monkeypatch.setenv(ENV_TRUSTED_UID, value)
    assert int(value) in trusted_uids()

    code, printed = run_worker(
        cpp_worker, holder.socket, "--checkpoint", str(checkpoints.single), "--tensor", SMALL_TENSOR
    )

    assert code == 0, printed
    assert printed["tensors"] == [expected_tensors(checkpoints.single)[SMALL_TENSOR]]
    assert_released(holder, "single", printed["lease_id"])


@pytest.mark.parametrize("value", ["daemon", "-1", "4294967295", "1_0", ""])
def test_a_trusted_uid_flag_takes_only_a_uid(cpp_worker: Path, holder: Daemon, value: str) -> None:
    code, printed = run_worker(
        cpp_worker, holder.socket, "--model", "single", "--trusted-uid", value
    )

    assert code == EXIT_USAGE
    assert printed["error"]["reason"] == "INVALID_ARGUMENT"
    assert printed["error"]["message"] == f"--trusted-uid takes a uid, not '{value}'"


@contextlib.contextmanager
def _chowned(path: str, uid: int) -> Iterator[None]:
    info = os.lstat(path)
    os.chown(path, uid, -1, follow_symlinks=False)
    try:
        yield
    finally:
        os.chown(path, info.st_uid, info.st_gid, follow_symlinks=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the socket folder to a uid")
def test_a_socket_folder_of_another_uid_is_trusted_only_when_named(
    cpp_worker: Path, holder: Daemon, checkpoints: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The Kubernetes layout (deploy/kubernetes/worker-pod.yaml): the daemon's uid owns the
    # socket folder, the worker runs as another and trusts it by $WEIGHTCACHE_TRUSTED_UID.
    monkeypatch.delenv(ENV_TRUSTED_UID, raising=False)
    folder = os.path.dirname(holder.socket)
    ask = ("--checkpoint", str(checkpoints.single), "--tensor", SMALL_TENSOR)
    by_env = {ENV_TRUSTED_UID: str(NOBODY)}
    with _chowned(folder, NOBODY):
        refused = run_worker(cpp_worker, holder.socket, *ask)
        trusted_by_flag = run_worker(cpp_worker, holder.socket, *ask, "--trusted-uid", str(NOBODY))
        trusted_by_env = run_worker(cpp_worker, holder.socket, *ask, env=by_env)
        # Like the SDK's trusted_uid= argument, the flag replaces the variable.
        flag_over_env = run_worker(
            cpp_worker, holder.socket, *ask, "--trusted-uid", "12345", env=by_env
        )

    for code, printed in (refused, flag_over_env):
        assert code == EXIT_UNTRUSTED_SOCKET
        assert printed["error"]["reason"] == "UNTRUSTED_SOCKET"
        assert printed["error"]["message"] == (
            f"{folder}: the daemon's folder belongs to uid {NOBODY}; "
            "trust it with --trusted-uid or $WEIGHTCACHE_TRUSTED_UID"
        )
    expected = expected_tensors(checkpoints.single)[SMALL_TENSOR]
    for code, printed in (trusted_by_flag, trusted_by_env):
        assert code == 0, printed
        assert printed["tensors"] == [expected]
        assert_released(holder, "single", printed["lease_id"])
    assert_every_lease_released(holder)


# -- a process posing as the daemon ----------------------------------------------------


class _RogueServicer(pb_grpc.WeightCacheServiceServicer):
    """Answers Acquire with the reply the test sets, keeps every lease ACTIVE, records
    Releases."""

    def __init__(self) -> None:
        self.reply = pb.AcquireResponse()
        self.released: list[str] = []

    def Acquire(self, request: pb.AcquireRequest, context: Any) -> pb.AcquireResponse:
        return self.reply

    def KeepAlive(
        self, requests: Iterator[pb.KeepAliveRequest], context: Any
    ) -> Iterator[pb.KeepAliveResponse]:
        for request in requests:
            yield pb.KeepAliveResponse(
                instance_id=self.reply.lease.instance_id,
                leases=[
                    pb.LeaseStatus(lease_id=lease, state=pb.LEASE_STATE_ACTIVE)
                    for lease in request.lease_ids
                ],
            )

    def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        self.released.append(request.lease_id)
        return pb.ReleaseResponse()


@dataclass(frozen=True)
class Rogue:
    """A gRPC server on a socket this user owns (so the worker trusts it) whose ``good``
    reply hands out ``segment``, a 512-byte arena of this user's holding two tensors: ``w``
    (F32, 6) at byte 0 and ``ids`` (I64, 3) at byte 256, whose bytes are ``arena``'s."""

    socket: str
    servicer: _RogueServicer
    good: pb.AcquireResponse
    arena: bytes


@pytest.fixture(scope="module")
def rogue() -> Iterator[Rogue]:
    servicer = _RogueServicer()
    arena = bytes(range(256)) * 2
    segment = f"/dev/shm/wctest-cpp-rogue-{uuid.uuid4().hex}"
    # A worker holds one thread with its KeepAlive stream while it calls Release.
    with serve_on_unix(servicer, 4) as socket, _removed(segment):
        Path(segment).write_bytes(arena)
        good = pb.AcquireResponse(
            lease=pb.Lease(lease_id="rogue-lease", model="tiny", instance_id="rogue"),
            model=pb.Model(name="tiny", state=pb.MODEL_STATE_READY),
            storage=pb.StorageHandle(shared_memory=pb.SharedMemoryHandle(path=segment, size=512)),
            tensors=[
                pb.TensorView(name="w", dtype="F32", shape=[6], stride=[1], nbytes=24),
                pb.TensorView(
                    name="ids", dtype="I64", shape=[3], stride=[1], byte_offset=256, nbytes=24
                ),
            ],
        )
        good.lease.ttl.FromSeconds(10)
        yield Rogue(socket, servicer, good, arena)


@contextlib.contextmanager
def _removed(path: str) -> Iterator[None]:
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _as_table(reply: pb.AcquireResponse) -> None:
    """List the reply's views as the daemon's TensorTable instead (core.protocol)."""
    views = [tensor_view_from_pb(v) for v in reply.tensors]
    del reply.tensors[:]
    reply.tensor_table.CopyFrom(tensor_table_pb(views))


def _serve(rogue: Rogue, lease_id: str, spoil: Callable[[pb.AcquireResponse], object]) -> None:
    reply = pb.AcquireResponse()
    reply.CopyFrom(rogue.good)
    reply.lease.lease_id = lease_id
    spoil(reply)
    rogue.servicer.reply = reply


def _attach(worker: Path, rogue: Rogue, *args: str) -> tuple[int, dict[str, Any]]:
    # The rogue grants whatever is asked: any digest names its model.
    return run_worker(worker, rogue.socket, "--fingerprint", "0" * 64, *args)


@pytest.mark.parametrize("form", ["views", "table"])
def test_rogue_baseline_reads_the_arena(cpp_worker: Path, rogue: Rogue, form: str) -> None:
    _serve(rogue, f"lease-baseline-{form}", _as_table if form == "table" else lambda r: None)

    code, printed = _attach(cpp_worker, rogue)

    assert code == 0, printed
    arena = rogue.arena
    assert printed["tensors"] == [
        {"name": "w", "dtype": "F32", "shape": [6], "nbytes": 24,
         "sha256": hashlib.sha256(arena[0:24]).hexdigest()},
        {"name": "ids", "dtype": "I64", "shape": [3], "nbytes": 24,
         "sha256": hashlib.sha256(arena[256:280]).hexdigest()},
    ]  # fmt: skip
    assert rogue.servicer.released[-1] == f"lease-baseline-{form}"


def _spoil_w(**fields: Any) -> Callable[[pb.AcquireResponse], None]:
    def spoil(reply: pb.AcquireResponse) -> None:
        for key, value in fields.items():
            if key == "stride":
                del reply.tensors[0].stride[:]
                reply.tensors[0].stride.extend(value)
            else:
                setattr(reply.tensors[0], key, value)

    return spoil


#: case -> (how tensor 'w' is spoiled, the INVALID_HANDLE message). Before the worker
#: checked for overflow, the first passed (byte_offset + nbytes wrapped to a negative end)
#: and the worker read far past its mapping; the third (2^62 + 1 elements of 4 bytes wrap
#: to 4 bytes) passed as contiguous.
ROGUE_VIEWS = {
    "byte-offset-near-2^63": (
        _spoil_w(byte_offset=2**63 - 8),
        "tensor 'w': 24 bytes at byte_offset 9223372036854775800 reach past the arena's 512",
    ),
    "byte-offset-past-the-end": (
        _spoil_w(byte_offset=496),
        "tensor 'w': 24 bytes at byte_offset 496 reach past the arena's 512",
    ),
    "stride-overflowing-to-contiguous": (
        _spoil_w(stride=[2**62 + 1]),
        "tensor 'w': not row-major contiguous",
    ),
    "nbytes-disagrees": (
        _spoil_w(nbytes=12),
        "tensor 'w': nbytes 12 is not its shape times 4 bytes",
    ),
}


@pytest.mark.parametrize("form", ["views", "table"])
@pytest.mark.parametrize("case", sorted(ROGUE_VIEWS))
def test_a_rogue_view_is_refused_unread_and_released(
    cpp_worker: Path, rogue: Rogue, case: str, form: str
) -> None:
    spoil, message = ROGUE_VIEWS[case]
    lease = f"lease-{case}-{form}"

    def spoil_in_form(reply: pb.AcquireResponse) -> None:
        spoil(reply)
        if form == "table":
            _as_table(reply)
            if case == "nbytes-disagrees":  # tensor_table_pb computes nbytes afresh
                reply.tensor_table.nbytes[0] = 12

    _serve(rogue, lease, spoil_in_form)

    code, printed = _attach(cpp_worker, rogue)

    assert code == EXIT_INVALID_HANDLE, printed
    error = printed["error"]
    assert (error["source"], error["reason"], error["message"]) == (
        "worker",
        "INVALID_HANDLE",
        message,
    )
    assert rogue.servicer.released[-1] == lease


#: case -> how the table is spoiled; the worker's message is the Python SDK's.
ROGUE_TABLES: dict[str, Callable[[pb.TensorTable], object]] = {
    "ranks-disagree": lambda t: t.ranks.__setitem__(0, 2),
    "names-short": lambda t: t.names.pop(),
    "nbytes-short": lambda t: t.nbytes.pop(),
    "dtype-index-past-the-end": lambda t: t.dtype_index.__setitem__(1, 2),
}


@pytest.mark.parametrize("case", sorted(ROGUE_TABLES))
def test_a_malformed_table_is_refused_as_by_the_python_sdk(
    cpp_worker: Path, rogue: Rogue, case: str
) -> None:
    def spoil(reply: pb.AcquireResponse) -> None:
        _as_table(reply)
        ROGUE_TABLES[case](reply.tensor_table)

    _serve(rogue, f"lease-table-{case}", spoil)
    with pytest.raises(HandleError) as python:
        view_columns_from_pb(rogue.servicer.reply)

    code, printed = _attach(cpp_worker, rogue)

    assert code == EXIT_INVALID_HANDLE, printed
    assert printed["error"]["reason"] == python.value.reason == "INVALID_HANDLE"
    assert printed["error"]["message"] == str(python.value)
    assert rogue.servicer.released[-1] == f"lease-table-{case}"


def test_trusting_the_daemon_waits_while_a_first_full_load_hashes(
    cpp_worker: Path, daemons: DaemonPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """The model's fingerprint is pending (empty digest) while the daemon hashes its
    shards: the worker asks again instead of sending it (docs/protocol.md)."""
    outcome: dict[str, tuple[int, dict[str, Any]]] = {}
    with racing_daemon(daemons, tmp_path) as racing:
        folder = racing.root / "model"
        shutil.copytree(checkpoints.sharded, folder)
        socket = racing.daemon.socket
        worker = threading.Thread(
            target=lambda: outcome.setdefault(
                "w", run_worker(cpp_worker, socket, "--model", "model")
            )
        )

        def while_loading() -> None:
            assert get_model(socket, "model").fingerprint.digest == ""
            worker.start()
            time.sleep(0.5)  # it asks while the load holds

        preload_changing(
            socket, folder, racing.base / "pause", while_loading, pb.FINGERPRINT_LEVEL_FULL
        )
        worker.join(WORKER_TIMEOUT)
        held = get_model(socket, "model")

    code, printed = outcome["w"]
    assert code == 0, printed
    assert (printed["match"], printed["fingerprint"]) == ("fingerprint", held.fingerprint.digest)
    assert printed_tensors(printed) == expected_tensors(checkpoints.sharded)
