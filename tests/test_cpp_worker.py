"""The C++ worker of examples/cpp/, built with CMake against the distribution's gRPC and run
as its own process against a real daemon: the tensors it reads from shared memory are
bitwise what Python's safetensors reads from the checkpoint files, a wrong model gets the
daemon's exact reason, and every lease it took is released when it exits."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from tests.support import (
    INDEX_FILE,
    SMALL_TENSOR,
    Checkpoints,
    Daemon,
    DaemonPool,
    get_model,
    pb,
    raw_bytes,
    service_stub,
    wait_until,
)
from weightcache.testing import list_models

# A cold build takes minutes on a loaded 2-core machine; `make test` builds it first.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "examples" / "cpp"
BUILD = ROOT / ".build" / "cpp"
WORKER_TIMEOUT = 60.0

# The worker's exit codes (examples/cpp/src/failure.h).
EXIT_REFUSED = 3
EXIT_LEASE_LOST = 6
EXIT_TENSOR_NOT_FOUND = 7
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


def run_worker(worker: Path, socket: str, *args: str) -> tuple[int, dict[str, Any]]:
    """Run the worker to completion; returns its exit code and the JSON it printed."""
    done = subprocess.run(
        [str(worker), "--socket", socket, *args],
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT,
        check=False,
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
