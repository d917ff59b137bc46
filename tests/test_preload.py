"""Remote Preload: off by default, confined to --model-root, and safe on malformed files."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

import weightcache
from tests.fault_support import write_sized_checkpoint
from tests.race_support import (
    Racing,
    pause_step,
    preload_changing,
    racing_daemon,
    rewrite_data_in_place,
)
from tests.recipe_support import recipe_json
from tests.support import (
    MALFORMED,
    SHARD_2,
    SINGLE_FILE,
    Checkpoints,
    Daemon,
    DaemonPool,
    RpcFailure,
    WorkerPool,
    assert_attached,
    assert_bitwise_equal,
    health,
    private_segments,
    private_shm,
    rpc_failure,
    service_stub,
    shm_segments,
    write_malformed,
)
from weightcache.testing.daemon import list_models
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache_service.store import MAX_FAILED


@dataclass(frozen=True)
class Roots:
    """Folders for remote Preload.

    Attributes:
        root: the daemon's ``--model-root``.
        inside: a copy of ``single`` inside the root, not preloaded at start.
        good: a copy of ``other-sharded`` inside the root, preloaded at start.
        outside: a copy of ``single`` outside the root.
        link: a symlink inside the root to ``outside``.
    """

    root: Path
    inside: Path
    good: Path
    outside: Path
    link: Path


@pytest.fixture(scope="module")
def roots(checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Roots:
    base = tmp_path_factory.mktemp("roots")
    root = base / "root"
    root.mkdir()
    outside = base / "outside" / "elsewhere"
    shutil.copytree(checkpoints.single, outside)
    shutil.copytree(checkpoints.single, root / "inside")
    shutil.copytree(checkpoints.other_sharded, root / "good")
    (root / "link").symlink_to(outside, target_is_directory=True)
    for case in MALFORMED:
        write_malformed(root / case, case)
    return Roots(root, root / "inside", root / "good", outside, root / "link")


@pytest.fixture(scope="module")
def locked_daemon(module_daemons: DaemonPool) -> Daemon:
    """Started without --allow-remote-preload."""
    return module_daemons.start()


@pytest.fixture(scope="module")
def open_daemon(module_daemons: DaemonPool, roots: Roots) -> Daemon:
    """Accepts remote Preload under ``roots.root``; holds ``good`` from the start."""
    return module_daemons.start(
        [roots.good], args=["--allow-remote-preload", "--model-root", str(roots.root)]
    )


def preload(socket: str, path: str | os.PathLike[str]) -> list[pb.PreloadResponse]:
    """Run a Preload stream to its end."""
    with service_stub(socket) as stub:
        return list(stub.Preload(pb.PreloadRequest(path=str(path)), timeout=60))


def refused_preload(socket: str, path: str | os.PathLike[str]) -> RpcFailure:
    """Run a Preload stream that must fail; its status and ErrorInfo."""
    with pytest.raises(grpc.RpcError) as raised:
        preload(socket, path)
    failure = rpc_failure(raised.value)
    assert failure.domain == "weightcache.v1"
    return failure


def models(socket: str) -> list[pb.Model]:
    with service_stub(socket) as stub:
        return list(stub.ListModels(pb.ListModelsRequest(), timeout=10).models)


def model_paths(socket: str) -> list[str]:
    return [m.path for m in models(socket)]


def test_remote_preload_is_refused_by_default(
    locked_daemon: Daemon, checkpoints: Checkpoints
) -> None:
    failure = refused_preload(locked_daemon.socket, checkpoints.single)

    assert (failure.code, failure.reason) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "PERMISSION_DENIED",
    )
    assert "--allow-remote-preload" in failure.message
    assert models(locked_daemon.socket) == []


@pytest.mark.parametrize(
    "which", ["outside", "dotdot", "symlink"], ids=["outside", "dotdot", "symlink-inside-root"]
)
def test_remote_preload_outside_model_root_is_refused(
    open_daemon: Daemon, roots: Roots, which: str
) -> None:
    path = {
        "outside": roots.outside,
        "dotdot": roots.root / ".." / "outside" / "elsewhere",
        "symlink": roots.link,
    }[which]

    failure = refused_preload(open_daemon.socket, path)

    assert (failure.code, failure.reason) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "PERMISSION_DENIED",
    )
    assert failure.metadata["path"] == str(roots.outside.resolve())
    assert str(roots.outside.resolve()) not in model_paths(open_daemon.socket)


def test_remote_preload_inside_model_root_loads_and_attaches_bitwise(
    open_daemon: Daemon, workers: WorkerPool, roots: Roots, tmp_path: Path
) -> None:
    responses = preload(open_daemon.socket, roots.inside)

    last = responses[-1]
    assert (last.model, last.state) == ("inside", pb.MODEL_STATE_READY)
    assert all(r.state == pb.MODEL_STATE_LOADING for r in responses[:-1])
    assert last.progress.tensors_done == last.progress.tensors_total == 9
    nbytes = weightcache.open_checkpoint(roots.inside).nbytes
    assert last.progress.bytes_done == last.progress.bytes_total == nbytes
    with service_stub(open_daemon.socket) as stub:
        model = stub.GetModel(pb.GetModelRequest(name="inside"), timeout=10).model
    assert (model.state, model.path) == (pb.MODEL_STATE_READY, str(roots.inside.resolve()))
    assert model.size_bytes >= nbytes  # the arena, alignment padding included
    assert dict(model.metadata) == weightcache.open_checkpoint(roots.inside).metadata

    reply = workers.start().load(roots.inside, socket=open_daemon.socket, dump=tmp_path / "w")
    assert_attached(reply)
    assert reply["model"] == "inside"
    assert_bitwise_equal(
        load_file(tmp_path / "w"), weightcache.load_from_disk(roots.inside).tensors
    )

    again = refused_preload(open_daemon.socket, roots.inside)
    assert (again.code, again.reason) == (grpc.StatusCode.ALREADY_EXISTS, "MODEL_EXISTS")
    assert again.metadata["model"] == "inside"


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_remote_preload_refuses_malformed_checkpoint(
    open_daemon: Daemon, roots: Roots, case: str
) -> None:
    failure = refused_preload(open_daemon.socket, roots.root / case)

    assert (failure.code, failure.reason) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_CHECKPOINT",
    )
    assert MALFORMED[case].message in failure.message
    assert health(open_daemon.socket) == "SERVING"
    assert str((roots.root / case).resolve()) not in model_paths(open_daemon.socket)


def test_daemon_keeps_serving_after_malformed_preloads(
    open_daemon: Daemon, workers: WorkerPool, roots: Roots, tmp_path: Path
) -> None:
    for case in MALFORMED:
        assert refused_preload(open_daemon.socket, roots.root / case).reason == (
            "INVALID_CHECKPOINT"
        )

    assert health(open_daemon.socket) == "SERVING"
    assert open_daemon.proc.poll() is None
    reply = workers.start().load(roots.good, socket=open_daemon.socket, dump=tmp_path / "w")
    assert_attached(reply)
    assert reply["model"] == "good"
    assert_bitwise_equal(load_file(tmp_path / "w"), weightcache.load_from_disk(roots.good).tensors)


# -- a shard rewritten while it loads (issue 9, item 2) -------------------------------


@pytest.fixture
def racing(daemons: DaemonPool, tmp_path: Path) -> Iterator[Racing]:
    with racing_daemon(daemons, tmp_path) as race:
        yield race


@pytest.mark.parametrize(
    ("level", "level_name"),
    [(pb.FINGERPRINT_LEVEL_SAMPLED, "sampled"), (pb.FINGERPRINT_LEVEL_FULL, "full")],
)
def test_shard_rewritten_during_preload_is_never_served_as_cache(
    racing: Racing, checkpoints: Checkpoints, tmp_path: Path, level: int, level_name: str
) -> None:
    folder = racing.root / "model"
    shutil.copytree(checkpoints.sharded, folder)
    original = racing.base / "original"  # what a worker holds: the bytes before the rewrite
    shutil.copytree(checkpoints.sharded, original)
    pause = racing.base / "pause"
    inode = os.stat(folder / SHARD_2).st_ino

    outcome = preload_changing(
        racing.daemon.socket, folder, pause, lambda: rewrite_data_in_place(folder / SHARD_2), level
    )

    assert os.stat(folder / SHARD_2).st_ino == inode  # rewritten in place, not replaced
    assert isinstance(outcome, RpcFailure), outcome
    assert (outcome.code, outcome.reason) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_CHECKPOINT",
    )
    assert f"{SHARD_2}: the file changed while it was being loaded" in outcome.message
    [model] = models(racing.daemon.socket)
    assert (model.name, model.state) == ("model", pb.MODEL_STATE_FAILED)
    assert shm_segments(racing.daemon.tag) == []  # its arena is freed
    reply = racing.worker.load(
        original,
        recipe=recipe_json(plugins=[pause_step(pause)]),
        socket=racing.daemon.socket,
        fingerprint_level=level_name,
        dump=tmp_path / "w",
    )
    assert reply["ok"], reply
    assert (reply["source"], reply["fallback_reason"]["code"]) == ("disk", "MODEL_FAILED")
    assert_bitwise_equal(load_file(tmp_path / "w"), checkpoints.tensors)
    assert health(racing.daemon.socket) == "SERVING"


def _preload_outcome(socket: str, path: Path) -> pb.PreloadResponse | RpcFailure:
    try:
        return preload(socket, path)[-1]
    except grpc.RpcError as exc:
        return rpc_failure(exc)


def test_two_concurrent_preloads_that_fit_only_one_at_a_time_one_is_refused(
    daemons: DaemonPool, tmp_path: Path
) -> None:
    """A 384 MiB /dev/shm (a private tmpfs) and two 256 MiB models: each fits alone, not
    both. Admitted together, both used to count on the same free bytes and then run into
    ENOSPC; the second admission must see the first's reservation."""
    mib = 2**20
    size = 256 * mib
    shm = private_shm("384m", 1024)
    root = tmp_path / "root"
    paths = [write_sized_checkpoint(root / name, size, seed=i) for i, name in enumerate("ab")]
    daemon = daemons.start(
        args=["--allow-remote-preload", "--model-root", str(root), "--headroom", "0"],
        wrap=shm,
    )

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda p: _preload_outcome(daemon.socket, p), paths))

    ready = [o for o in outcomes if isinstance(o, pb.PreloadResponse)]
    refusals = [o for o in outcomes if isinstance(o, RpcFailure)]
    assert len(ready) == len(refusals) == 1, outcomes
    assert ready[0].state == pb.MODEL_STATE_READY
    [refusal] = refusals
    assert (refusal.code, refusal.reason) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "RESOURCE_EXHAUSTED",
    )
    # Refused at admission (what the budget saw), not by ENOSPC half way into an arena.
    available = int(refusal.metadata["available"])
    assert refusal.metadata == {
        "needed": str(size),
        "headroom": "0",
        "available": str(available),
    }
    assert available < size
    listed = {m.name: m.state for m in models(daemon.socket)}
    loser = "b" if ready[0].model == "a" else "a"
    assert listed == {ready[0].model: pb.MODEL_STATE_READY, loser: pb.MODEL_STATE_FAILED}
    assert len(private_segments(daemon.pid)) == 1
    assert daemon.stop() == 0


def test_failed_remote_preloads_are_kept_up_to_a_bound(daemons: DaemonPool, tmp_path: Path) -> None:
    # Before (issue 37, item 10): every FAILED remote Preload was kept forever, a name in
    # ListModels and six labelled series on /metrics each. Now the newest MAX_FAILED.
    root = tmp_path / "models"
    count = MAX_FAILED + 8
    for i in range(count):
        (root / f"m{i:02d}").mkdir(parents=True)
        save_file({"w": torch.full((4,), float(i))}, root / f"m{i:02d}" / SINGLE_FILE)
    daemon = daemons.start(
        args=["--allow-remote-preload", "--model-root", str(root), "--headroom", str(2**50)]
    )
    codes = []
    with service_stub(daemon.socket) as stub:
        for i in range(count):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Preload(pb.PreloadRequest(path=str(root / f"m{i:02d}")), timeout=30))
            codes.append(rpc_failure(info.value).reason)

    models = list_models(daemon.socket)
    assert codes == ["RESOURCE_EXHAUSTED"] * count
    assert sorted(m.name for m in models) == [f"m{i:02d}" for i in range(8, count)]
    assert {m.state for m in models} == {pb.MODEL_STATE_FAILED}
