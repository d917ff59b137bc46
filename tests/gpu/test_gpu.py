"""The CUDA IPC backend on a real device: daemons with ``--device cuda:0``, workers in
their own processes, the same checks as the shared-memory tests where they apply.

One difference from shared memory is asserted as it is: a CUDA IPC mapping is shared and
writable, not copy-on-write. A worker that writes to zero-copy weights changes them for
every worker attached to the arena and for every later attach (it writes the daemon's
copy). Only ``mode="copy"`` (or a revoke with ``on_revoke="copy"``) gives a worker private
weights.

Tensors are compared on the CPU: workers save what they got with safetensors (which moves
device tensors to the host) and the test compares those files with a disk load.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import weightcache
from tests.support import (
    Checkpoints,
    Daemon,
    DaemonPool,
    WorkerPool,
    assert_attached,
    assert_bitwise_equal,
    child_env,
    flipped,
    get_model,
    run_cli,
    service_stub,
    wait_until,
)
from weightcache import Placement, Recipe
from weightcache._loader import _acquire_request
from weightcache.core.cuda import device_uuid, is_rocm, local_index
from weightcache.v1 import weight_cache_service_pb2 as pb

pytestmark = pytest.mark.gpu

DEVICE_ARGS = ("--device", "cuda:0")
#: A TTL long enough that an expiry cannot explain a lease ending during a test.
LONG_TTL = 30.0
SHORT_TTL = 1.5
#: Seconds of scheduling slack allowed on top of a lease's validity window.
SLACK = 0.5
UUID_PATTERN = r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"

#: Run in a fresh interpreter: load, then report what only the worker's process can see.
PROBE = r"""
import gc, json, sys
import torch
import weightcache
from weightcache.core import cuda as _cuda

path, socket, mode = sys.argv[1:4]
weights = weightcache.load(path, socket=socket, mode=mode, fallback=False, ttl=30.0)
tensors = weights.tensors
arena = weights._arena
low = arena.base.data_ptr()
high = low + arena.size
filled = [t for t in tensors.values() if t.numel()]
out = {
    "source": weights.source,
    "devices": sorted({str(t.device) for t in tensors.values()}),
    "base_device": str(arena.base.device),
    "in_base": all(low <= t.data_ptr() and t.data_ptr() + t.nbytes <= high for t in filled),
    "policy": None if weights.lease is None else weights.lease.policy,
    "mapped": len(_cuda._opened),
}
weights.close()
del weights, tensors, arena, filled
gc.collect()
torch.cuda.synchronize()
out["mapped_after_close"] = len(_cuda._opened)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def gpu_daemon(module_daemons: DaemonPool, checkpoints: Checkpoints) -> Daemon:
    """Holds ``single`` and ``sharded`` as stored, on cuda:0."""
    return module_daemons.start([checkpoints.single, checkpoints.sharded], args=DEVICE_ARGS)


@pytest.fixture(scope="module")
def gpu_bf16_daemon(module_daemons: DaemonPool, checkpoints: Checkpoints) -> Daemon:
    """Holds ``sharded`` with floating tensors cast to BF16 (fp8 left alone), on cuda:0."""
    return module_daemons.start([checkpoints.sharded], dtype="BF16", args=DEVICE_ARGS)


def server_info(socket: str) -> pb.GetServerInfoResponse:
    with service_stub(socket) as stub:
        reply: pb.GetServerInfoResponse = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return reply


def run_probe(path: Path, socket: str, mode: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(path), socket, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


# -- the device and its handle -----------------------------------------------------------


def test_server_info_names_the_gpu_by_uuid(gpu_daemon: Daemon, smi_uuids: list[str] | None) -> None:
    info = server_info(gpu_daemon.socket)

    assert (info.backend, info.device) == ("cuda_ipc", "cuda:0")
    if not is_rocm():
        assert re.fullmatch(UUID_PATTERN, info.device_uuid), info.device_uuid
    if smi_uuids is not None:
        assert info.device_uuid in smi_uuids
    shown = run_cli("info", "--socket", gpu_daemon.socket)
    assert shown.returncode == 0, shown.stderr
    assert "backend: cuda_ipc\n" in shown.stdout
    assert "device: cuda:0\n" in shown.stdout


def test_device_uuids_are_the_ones_nvidia_smi_prints(smi_uuids: list[str] | None) -> None:
    if smi_uuids is None:
        pytest.skip("needs nvidia-smi (CUDA)")
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        pytest.skip("compares every GPU: run without CUDA_VISIBLE_DEVICES")

    ours = [device_uuid(i) for i in range(torch.cuda.device_count())]

    assert sorted(ours) == sorted(smi_uuids)
    for index, uuid in enumerate(ours):
        assert local_index(uuid) == index
        assert local_index(uuid.removeprefix("GPU-")) == index


def test_acquire_hands_out_a_64_byte_handle_of_the_whole_arena(
    gpu_daemon: Daemon, checkpoints: Checkpoints
) -> None:
    checkpoint = weightcache.open_checkpoint(checkpoints.single)
    fp = weightcache.compute_fingerprint(checkpoint, Recipe(), Placement(), "sampled")
    request = _acquire_request(checkpoint.root, fp, LONG_TTL)

    with service_stub(gpu_daemon.socket) as stub:
        reply: pb.AcquireResponse = stub.Acquire(request, timeout=30)
        stub.Release(pb.ReleaseRequest(lease_id=reply.lease.lease_id), timeout=10)

    info = server_info(gpu_daemon.socket)
    assert reply.storage.WhichOneof("handle") == "cuda_ipc"
    handle = reply.storage.cuda_ipc
    assert len(handle.ipc_handle) == 64
    assert any(handle.ipc_handle)
    assert handle.size == reply.model.size_bytes
    assert handle.size % 256 == 0
    assert handle.device_uuid == info.device_uuid == reply.environment.device_uuid
    assert reply.environment.backend == "cuda_ipc"
    assert sorted(v.name for v in reply.tensors) == sorted(checkpoints.tensors)
    assert get_model(gpu_daemon.socket, "single").lease_count == 0


# -- bitwise the disk load -----------------------------------------------------------------

CASES = [(dtype, mode) for dtype in ("stored", "BF16") for mode in ("zero_copy", "copy")]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_attach_is_bitwise_the_disk_load(
    request: pytest.FixtureRequest,
    workers: WorkerPool,
    checkpoints: Checkpoints,
    tmp_path: Path,
    case: tuple[str, str],
) -> None:
    dtype, mode = case
    daemon: Daemon = request.getfixturevalue(
        "gpu_daemon" if dtype == "stored" else "gpu_bf16_daemon"
    )
    cast = None if dtype == "stored" else dtype
    worker = workers.start()

    reply = worker.load(
        checkpoints.sharded,
        socket=daemon.socket,
        dtype=cast,
        mode=mode,
        ttl=LONG_TTL,
        dump=tmp_path / "w",
    )

    assert_attached(reply)
    disk = weightcache.load_from_disk(checkpoints.sharded, dtype=cast).tensors
    assert {torch.bfloat16, torch.float8_e4m3fn} <= {t.dtype for t in disk.values()}
    assert reply["names"] == list(disk)
    assert_bitwise_equal(load_file(tmp_path / "w"), disk)
    assert reply["in_shared_memory"] is False
    if mode == "zero_copy":
        assert reply["lease"] == {"ttl": LONG_TTL, "validity": LONG_TTL * 2 / 3}
    else:
        assert reply["lease"] is None


@pytest.mark.parametrize("mode", ["zero_copy", "copy"])
def test_tensors_are_on_the_device_and_the_mapping_closes_with_the_last_view(
    gpu_daemon: Daemon, checkpoints: Checkpoints, mode: str
) -> None:
    out = run_probe(checkpoints.single, gpu_daemon.socket, mode)

    assert out["source"] == "cache"
    assert (out["devices"], out["base_device"]) == (["cuda:0"], "cuda:0")
    assert out["in_base"] is True
    if mode == "zero_copy":
        # Views of the one IPC mapping; the device-memory default lease policy.
        assert (out["policy"], out["mapped"]) == ("exit", 1)
    else:
        # A device-to-device copy: the mapping is closed before load() returns.
        assert (out["policy"], out["mapped"]) == (None, 0)
    assert out["mapped_after_close"] == 0
    assert get_model(gpu_daemon.socket, "single").lease_count == 0


# -- sharing -------------------------------------------------------------------------------


def test_two_workers_share_one_mapping_and_see_each_others_writes(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """Not copy-on-write (module docstring): A's write shows in B and in a later attach;
    a worker that took a copy before the write keeps the original bytes."""
    daemon = daemons.start([checkpoints.single], args=DEVICE_ARGS)
    disk = weightcache.load_from_disk(checkpoints.single).tensors
    written = {name: flipped(tensor) for name, tensor in disk.items()}
    a, b, c = workers.start(), workers.start(), workers.start()
    for worker in (a, b):
        assert_attached(worker.load(checkpoints.single, socket=daemon.socket, ttl=LONG_TTL))
    assert_attached(c.load(checkpoints.single, socket=daemon.socket, mode="copy"))
    assert get_model(daemon.socket, "single").lease_count == 2

    assert b.request("dump", key="w", path=str(tmp_path / "b0"))["ok"]
    assert_bitwise_equal(load_file(tmp_path / "b0"), disk)
    assert a.request("invert", key="w")["ok"]
    # Saving copies to the host, which waits for A's kernels: the write has landed.
    assert a.request("dump", key="w", path=str(tmp_path / "a1"))["ok"]
    assert b.request("dump", key="w", path=str(tmp_path / "b1"))["ok"]
    assert c.request("dump", key="w", path=str(tmp_path / "c1"))["ok"]

    assert_bitwise_equal(load_file(tmp_path / "a1"), written)
    assert_bitwise_equal(load_file(tmp_path / "b1"), written)
    assert_bitwise_equal(load_file(tmp_path / "c1"), disk)
    later = workers.start().load(
        checkpoints.single, socket=daemon.socket, ttl=LONG_TTL, dump=tmp_path / "d"
    )
    assert_attached(later)
    assert_bitwise_equal(load_file(tmp_path / "d"), written)


# -- leases --------------------------------------------------------------------------------


def test_killed_worker_ends_its_lease_and_evict_frees_the_arena(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single], args=DEVICE_ARGS)
    worker = workers.start()
    reply = worker.load(checkpoints.single, socket=daemon.socket, ttl=LONG_TTL)
    assert_attached(reply)
    assert worker.request("wait_ack", key="w", seconds=LONG_TTL / 3 + 5)["ok"]
    model = get_model(daemon.socket, "single")
    assert model.lease_count == 1
    assert server_info(daemon.socket).memory_held_bytes == model.size_bytes
    refused = run_cli("evict", "single", "--socket", daemon.socket)
    assert refused.returncode == 1
    assert "LEASES_ACTIVE" in refused.stderr

    assert worker.kill() == -signal.SIGKILL

    waited = wait_until(lambda: get_model(daemon.socket, "single").lease_count == 0, 10.0)
    assert waited < LONG_TTL / 2
    evicted = run_cli("evict", "single", "--socket", daemon.socket)
    assert (evicted.returncode, evicted.stdout) == (0, "evicted single\n")
    assert server_info(daemon.socket).memory_held_bytes == 0


def test_killed_daemon_default_policy_on_cuda_exits_the_worker_with_75(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints
) -> None:
    daemon = daemons.start([checkpoints.single], args=DEVICE_ARGS)
    worker = workers.start()
    reply = worker.load(checkpoints.single, socket=daemon.socket, ttl=SHORT_TTL, lost_callback=True)
    assert_attached(reply)
    validity = reply["lease"]["validity"]
    assert worker.request("wait_ack", key="w", seconds=5)["ok"]

    killed_at = daemon.kill()

    event = worker.event("lease_lost", timeout=validity + 5)
    assert event["error"]["reason"] == "LEASE_LOST"
    assert 0 <= event["t"] - killed_at <= validity + SLACK
    assert worker.proc.wait(timeout=validity + 5) == weightcache.EXIT_LEASE_LOST == 75


def test_copy_mode_releases_at_once_and_outlives_the_arena(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    daemon = daemons.start([checkpoints.sharded], args=DEVICE_ARGS)
    worker = workers.start()

    reply = worker.load(checkpoints.sharded, socket=daemon.socket, mode="copy")

    assert_attached(reply)
    assert reply["lease"] is None
    assert get_model(daemon.socket, "sharded").lease_count == 0
    evicted = run_cli("evict", "sharded", "--socket", daemon.socket)
    assert (evicted.returncode, evicted.stdout) == (0, "evicted sharded\n")
    assert server_info(daemon.socket).memory_held_bytes == 0
    # The arena is freed; the worker's copy is its own.
    assert worker.request("dump", key="w", path=str(tmp_path / "w"))["ok"]
    disk = weightcache.load_from_disk(checkpoints.sharded).tensors
    assert_bitwise_equal(load_file(tmp_path / "w"), disk)


def test_drain_with_on_revoke_copy_keeps_the_worker_computing(
    daemons: DaemonPool, workers: WorkerPool, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    # A drain longer than Daemon.stop waits: a worker that did not release fails the test.
    daemon = daemons.start([checkpoints.single], args=[*DEVICE_ARGS, "--drain-timeout", "60"])
    worker = workers.start()
    reply = worker.load(
        checkpoints.single,
        socket=daemon.socket,
        ttl=LONG_TTL,
        on_revoke="copy",
        lost_callback=True,
    )
    assert_attached(reply)
    assert worker.request("wait_ack", key="w", seconds=LONG_TTL / 3 + 5)["ok"]

    assert daemon.stop() == 0

    assert "leases_left=0" in daemon.log()
    assert worker.proc.poll() is None
    lost = worker.request("wait_lost", key="w", seconds=1)
    assert (lost["fired"], lost["tensors_error"]) == (False, None)
    disk = weightcache.load_from_disk(checkpoints.single).tensors
    assert worker.request("dump", key="w", path=str(tmp_path / "after"))["ok"]
    assert_bitwise_equal(load_file(tmp_path / "after"), disk)
    # Still computing, on memory of its own: the daemon and its arena are gone.
    assert worker.request("invert", key="w")["ok"]
    assert worker.request("dump", key="w", path=str(tmp_path / "inverted"))["ok"]
    written = {name: flipped(tensor) for name, tensor in disk.items()}
    assert_bitwise_equal(load_file(tmp_path / "inverted"), written)
    assert worker.proc.poll() is None


# -- a device the worker cannot see --------------------------------------------------------


@pytest.fixture(params=["none", "another"])
def hidden(
    request: pytest.FixtureRequest,
    gpu_daemon: Daemon,
    smi_uuids: list[str] | None,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[str, str]:
    """``CUDA_VISIBLE_DEVICES`` that hides the daemon's GPU, set for the workers started
    after it (they inherit this process's environment): no device, or another GPU.
    Returns the daemon's UUID and the value."""
    uuid = server_info(gpu_daemon.socket).device_uuid
    if request.param == "none":
        value = ""
    else:
        others = [u for u in smi_uuids or [] if u != uuid]
        if not others:
            pytest.skip("needs a second GPU (and nvidia-smi) to show the worker instead")
        value = others[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    return uuid, value


def test_worker_that_cannot_see_the_device_loads_from_disk_with_the_reason(
    gpu_daemon: Daemon,
    workers: WorkerPool,
    checkpoints: Checkpoints,
    tmp_path: Path,
    hidden: tuple[str, str],
) -> None:
    uuid, value = hidden
    worker = workers.start()

    reply = worker.load(
        checkpoints.single, socket=gpu_daemon.socket, ttl=LONG_TTL, dump=tmp_path / "w"
    )

    assert reply["ok"], reply.get("error")
    assert reply["source"] == "disk"
    reason = reply["fallback_reason"]
    assert reason["code"] == "DEVICE_NOT_VISIBLE"
    assert reason["detail"].startswith(
        f"device {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES={value}; visible: "
    )
    disk = weightcache.load_from_disk(checkpoints.single).tensors
    assert_bitwise_equal(load_file(tmp_path / "w"), disk)
    # The lease granted before the handle was opened was released.
    wait_until(lambda: get_model(gpu_daemon.socket, "single").lease_count == 0, 10.0)
