"""Helpers for the tests, on top of :mod:`weightcache.testing` (the harness the package
ships: real daemons on real sockets, workers in real processes, checkpoints).

Nothing here mocks a weightcache component. What this adds is test-specific: CLI runs,
private /dev/shm mounts, raw RPCs and their rich errors, malformed checkpoints. The
harness names the tests use are re-exported from here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from safetensors.torch import save_file

import weightcache
from weightcache.core.sockets import SHM_DIR
from weightcache.testing.checkpoints import (  # noqa: F401 - re-exported for the tests
    INDEX_FILE,
    METADATA,
    SHARD_1,
    SHARD_2,
    SHARD_OF,
    SINGLE_FILE,
    SMALL_TENSOR,
    Checkpoints,
    assert_bitwise_equal,
    make_checkpoints,
    raw_bytes,
    reference_tensors,
)
from weightcache.testing.daemon import (  # noqa: F401 - re-exported for the tests
    POLL,
    READY_TIMEOUT,
    REMOVED_SEGMENT,
    STOP_TIMEOUT,
    Daemon,
    DaemonPool,
    child_env,
    health,
    shm_segments,
    short_tempdir,
)
from weightcache.testing.driver import (  # noqa: F401 - re-exported for the tests
    WORKER_TIMEOUT,
    Worker,
    WorkerDiedError,
    WorkerPool,
)
from weightcache.testing.protocol import (  # noqa: F401 - re-exported for the tests
    next_event,
    next_reply,
)
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc

TESTS = Path(__file__).resolve().parent


# -- processes -----------------------------------------------------------------------


def cli_command() -> list[str]:
    """The installed ``weightcache`` console script (or the module, without one)."""
    script = Path(sys.executable).with_name("weightcache")
    return [str(script)] if script.exists() else [sys.executable, "-m", "weightcache_service.cli"]


def run_cli(
    *args: str, timeout: float = 60.0, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``weightcache ARGS...`` (in ``cwd``) to completion and capture its output."""
    return subprocess.run(
        [*cli_command(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        check=False,
        cwd=cwd,
    )


def private_shm(size: str, inodes: int) -> list[str]:
    """A command prefix that runs its command (by exec, same pid) in a private mount
    namespace with a fresh tmpfs of ``size`` bytes (mount(8) units) and ``inodes`` inodes
    on /dev/shm, seen from outside as ``/proc/PID/root/dev/shm``; the tmpfs vanishes with
    the process. Skips the test where unshare(1) or mount(8) is not permitted (not root)."""
    probe = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs -o size=1m weightcache-probe /dev/shm",
        ],
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs: {probe.stderr.decode(errors='replace')}")
    script = (
        f'mount -t tmpfs -o size={size},nr_inodes={inodes} weightcache-test /dev/shm && exec "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]


def private_segments(pid: int) -> list[str]:
    """Names of the segments in the private /dev/shm of process ``pid`` (:func:`private_shm`)."""
    return sorted(os.listdir(f"/proc/{pid}/root{SHM_DIR}"))


@contextlib.contextmanager
def service_stub(socket: str) -> Iterator[pb_grpc.WeightCacheServiceStub]:
    """A gRPC stub for the daemon at ``socket``; the channel closes on exit."""
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        yield pb_grpc.WeightCacheServiceStub(channel)


@dataclass(frozen=True)
class RpcFailure:
    """A failed RPC as the wire carries it: status code plus the one ErrorInfo."""

    code: grpc.StatusCode
    reason: str
    domain: str
    metadata: dict[str, str]
    message: str


@contextlib.contextmanager
def serve_on_unix(servicer: pb_grpc.WeightCacheServiceServicer, workers: int) -> Iterator[str]:
    """Serve ``servicer`` (a stand-in daemon: a rogue or broken one) with ``workers``
    threads on a Unix socket in a fresh short folder; yields the socket's path, then stops
    the server and removes the folder."""
    folder = tempfile.mkdtemp(prefix="wcr", dir="/tmp")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    pb_grpc.add_WeightCacheServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{folder}/d.sock")
    server.start()
    try:
        yield f"{folder}/d.sock"
    finally:
        server.stop(None)
        shutil.rmtree(folder, ignore_errors=True)


def rpc_failure(exc: grpc.RpcError) -> RpcFailure:
    """Parse the ``google.rpc.Status`` of a failed call; asserts it holds one ErrorInfo."""
    assert isinstance(exc, grpc.Call), exc
    status = rpc_status.from_call(exc)
    assert status is not None, f"no rich status on {exc.code()}: {exc.details()}"
    infos = []
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            infos.append(info)
    assert len(infos) == 1, status
    return RpcFailure(
        code=exc.code(),
        reason=infos[0].reason,
        domain=infos[0].domain,
        metadata=dict(infos[0].metadata),
        message=status.message,
    )


# -- checkpoints ---------------------------------------------------------------------


def copy_with_zeroed_tensor(src: Path, dst: Path, name: str) -> str:
    """Copy a checkpoint and overwrite one tensor's bytes with zeros, header untouched.

    Returns the name of the shard file that changed.
    """
    shutil.copytree(src, dst)
    info = weightcache.open_checkpoint(dst).tensors[name]
    with open(dst / info.shard, "r+b") as fh:
        fh.seek(info.begin)
        assert any(fh.read(info.nbytes)), "the tensor to zero is zero already"
        fh.seek(info.begin)
        fh.write(bytes(info.nbytes))
    return info.shard


def _raw_file(path: Path, header: bytes, data: bytes = b"", header_len: int | None = None) -> None:
    length = len(header) if header_len is None else header_len
    path.write_bytes(length.to_bytes(8, "little") + header + data)


def _json(header: Mapping[str, Any]) -> bytes:
    return json.dumps(header).encode()


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _bad_header_length(folder: Path) -> None:
    header = _json({"a": _entry("F32", [4], 0, 16)})
    _raw_file(folder / SINGLE_FILE, header, bytes(16), header_len=10_000)


def _offsets_past_end(folder: Path) -> None:
    _raw_file(folder / SINGLE_FILE, _json({"a": _entry("F32", [16], 0, 64)}), bytes(16))


def _invalid_json(folder: Path) -> None:
    _raw_file(folder / SINGLE_FILE, b'{"a": {"dtype": "F32", "shape": [4], ', bytes(16))


def _unknown_dtype(folder: Path) -> None:
    _raw_file(folder / SINGLE_FILE, _json({"a": _entry("F7", [4], 0, 16)}), bytes(16))


def _shape_bytes_disagree(folder: Path) -> None:
    _raw_file(folder / SINGLE_FILE, _json({"a": _entry("F32", [3], 0, 16)}), bytes(16))


def _overlapping_offsets(folder: Path) -> None:
    header = _json({"a": _entry("F32", [4], 0, 16), "b": _entry("F32", [4], 8, 24)})
    _raw_file(folder / SINGLE_FILE, header, bytes(24))


def _index_names_missing_shard(folder: Path) -> None:
    save_file({"a": torch.ones(4)}, str(folder / SHARD_1))
    index = {"metadata": {}, "weight_map": {"a": SHARD_1, "b": SHARD_2}}
    (folder / INDEX_FILE).write_text(json.dumps(index))


def _duplicate_tensor_name(folder: Path) -> None:
    entry = json.dumps(_entry("F32", [4], 0, 16))
    header = f'{{"a": {entry}, "a": {entry}}}'.encode()
    _raw_file(folder / SINGLE_FILE, header, bytes(16))


def _gap_between_tensors(folder: Path) -> None:
    header = _json({"a": _entry("F32", [4], 0, 16), "b": _entry("F32", [4], 24, 40)})
    _raw_file(folder / SINGLE_FILE, header, bytes(40))


def _trailing_bytes(folder: Path) -> None:
    _raw_file(folder / SINGLE_FILE, _json({"a": _entry("F32", [4], 0, 16)}), bytes(20))


def _empty_weight_map(folder: Path) -> None:
    save_file({"a": torch.ones(4)}, str(folder / SHARD_1))
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {}}))


def _dtype_not_a_string(folder: Path) -> None:
    header = _json({"a": {"dtype": [], "shape": [4], "data_offsets": [0, 16]}})
    _raw_file(folder / SINGLE_FILE, header, bytes(16))


def _sub_byte_dtype(folder: Path) -> None:
    _raw_file(folder / SINGLE_FILE, _json({"a": _entry("F4", [4], 0, 2)}), bytes(2))


@dataclass(frozen=True)
class Malformed:
    """A way to break a checkpoint, and what the refusal must say about it."""

    write: Callable[[Path], None]
    message: str


MALFORMED: dict[str, Malformed] = {
    "bad-header-length": Malformed(_bad_header_length, "runs past the end"),
    "offsets-past-end": Malformed(_offsets_past_end, "past the end of the"),
    "invalid-json": Malformed(_invalid_json, "not valid JSON"),
    "unknown-dtype": Malformed(_unknown_dtype, "unknown dtype 'F7'"),
    "shape-bytes-disagree": Malformed(_shape_bytes_disagree, "needs 12"),
    "overlapping-offsets": Malformed(_overlapping_offsets, "overlaps another"),
    "index-missing-shard": Malformed(_index_names_missing_shard, "which is missing"),
    # What the safetensors reader refuses too (its format rules; issue 9, item 10).
    "duplicate-tensor-name": Malformed(_duplicate_tensor_name, "names 'a' twice"),
    "gap-between-tensors": Malformed(
        _gap_between_tensors, "8 bytes of no tensor before tensor 'b'"
    ),
    "trailing-bytes": Malformed(_trailing_bytes, "4 trailing bytes after the last tensor"),
    "empty-weight-map": Malformed(_empty_weight_map, "'weight_map' maps no tensor"),
    "sub-byte-dtype": Malformed(_sub_byte_dtype, "dtype F4 packs elements below a byte"),
    "dtype-not-a-string": Malformed(_dtype_not_a_string, "unknown dtype []"),
}


def write_malformed(folder: Path, case: str) -> Path:
    """A checkpoint folder broken the way ``case`` (a key of :data:`MALFORMED`) says."""
    folder.mkdir(parents=True)
    MALFORMED[case].write(folder)
    return folder


# -- comparing -----------------------------------------------------------------------


def flipped(tensor: torch.Tensor) -> torch.Tensor:
    """What the worker's ``invert`` command turns a tensor into (see weightcache.testing.worker)."""
    if tensor.dtype == torch.bool:
        return torch.logical_not(tensor)
    out = tensor.clone()
    if out.numel():
        out.reshape(-1).view(torch.uint8).bitwise_not_()
    return out


def assert_attached(reply: dict[str, Any]) -> None:
    """A worker's load reply says it got the weights from the daemon (else: why not)."""
    assert reply["ok"], reply.get("error")
    assert reply["source"] == "cache", reply["fallback_reason"]
    assert reply["fallback_reason"] is None


def get_model(socket: str, name: str) -> pb.Model:
    """The daemon's view of one held model."""
    with service_stub(socket) as stub:
        reply: pb.GetModelResponse = stub.GetModel(pb.GetModelRequest(name=name), timeout=10)
    return reply.model


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = POLL) -> float:
    """Poll ``predicate`` until true; returns the seconds it took.

    Raises:
        AssertionError: still false after ``timeout`` seconds.
    """
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition still false after {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start
