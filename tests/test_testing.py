"""The public test harness, ``weightcache.testing``, as a user's test would use it.

Real daemons on real sockets and workers in real processes, through the harness's own
entry points (not the suite's fixtures): what it promises is what is checked here.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import weightcache
from weightcache.testing import (
    SHARD_1,
    SHARD_2,
    Checkpoints,
    DaemonPool,
    DaemonStartError,
    WorkerDiedError,
    WorkerPool,
    assert_bitwise_equal,
    list_models,
    make_checkpoints,
    reference_tensors,
    run_daemon,
    segment_tag,
    shm_segments,
    worker_pool,
)
from weightcache.v1 import weight_cache_service_pb2 as pb


def _socket_from_log(log: str) -> str:
    """The socket a daemon said it listens on (its ``listening`` line)."""
    match = re.search(r"listening .* socket=(\S+)", log)
    assert match, log
    return match.group(1)


def test_daemon_checkpoint_worker_round_trip_leaves_nothing(tmp_path: Path) -> None:
    ckpt = make_checkpoints(tmp_path / "ckpt")
    dump = tmp_path / "got.safetensors"

    with run_daemon([ckpt.sharded]) as daemon, worker_pool(tmp_path) as workers:
        socket, pid, tag = daemon.socket, daemon.pid, daemon.tag
        assert os.path.exists(socket)
        assert len(daemon.segments()) == 1, daemon.log()
        assert daemon.ready_seconds is not None and daemon.ready_seconds > 0
        assert "ready" in daemon.log()
        reply = workers.start().load(ckpt.sharded, socket=socket, fallback=False, dump=dump)
        assert reply["ok"], reply
        assert (reply["source"], reply["fallback_reason"]) == ("cache", None)
        assert reply["in_shared_memory"] is True

    assert_bitwise_equal(load_file(dump), ckpt.tensors)
    assert_bitwise_equal(ckpt.tensors, reference_tensors(seed=0))
    assert not os.path.lexists(socket)
    assert not os.path.exists(os.path.dirname(socket))
    assert shm_segments(tag) == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_checkpoints_are_deterministic_single_and_sharded(tmp_path: Path) -> None:
    first, second = make_checkpoints(tmp_path / "a"), make_checkpoints(tmp_path / "b")

    assert sorted(os.listdir(first.sharded)) == sorted(
        [SHARD_1, SHARD_2, "model.safetensors.index.json"]
    )
    for name in (SHARD_1, SHARD_2):
        assert (first.sharded / name).read_bytes() == (second.sharded / name).read_bytes()
    single = (first.single / "model.safetensors").read_bytes()
    assert single == (second.single / "model.safetensors").read_bytes()
    assert_bitwise_equal(weightcache.load_from_disk(first.single).tensors, first.tensors)
    assert_bitwise_equal(weightcache.load_from_disk(first.sharded).tensors, first.tensors)


def test_a_bad_model_path_fails_the_start_with_the_daemons_reason(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"

    with pytest.raises(DaemonStartError) as info, run_daemon([missing]):
        pytest.fail("the block must not run")

    err = info.value
    assert err.returncode is None  # it was running: it refused the path, then served
    # A failed start-up model is listed, FAILED with its reason (issue 28).
    assert (
        "daemon ready with 0 of 1 models READY: "
        "['no-such-model MODEL_STATE_FAILED INVALID_CHECKPOINT: "
    ) in str(err)
    assert f"{missing}: no such checkpoint folder or file" in err.log
    assert "reason=INVALID_CHECKPOINT" in err.log
    socket = _socket_from_log(err.log)
    assert not os.path.lexists(socket)
    assert shm_segments(segment_tag(socket)) == []


def test_a_daemon_that_exits_fails_the_start_with_its_status(tmp_path: Path) -> None:
    with pytest.raises(DaemonStartError) as info, run_daemon(args=["--no-such-flag"]):
        pytest.fail("the block must not run")

    assert info.value.returncode == 2  # argparse's usage error
    assert "daemon exited with 2 before ready" in str(info.value)
    assert "unrecognized arguments: --no-such-flag" in info.value.log


@pytest.mark.parametrize("name", ["x/d.sock", "x/../x/d.sock", "link/d.sock"])
def test_segment_tag_resolves_the_socket_folder(tmp_path: Path, name: str) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "x")
    resolved = os.path.join(os.path.realpath(tmp_path / "x"), "d.sock")
    namespace = os.stat("/proc/self/ns/mnt")
    text = f"{namespace.st_dev}:{namespace.st_ino}\0{resolved}"

    assert segment_tag(str(tmp_path / name)) == hashlib.sha256(text.encode()).hexdigest()[:12]


def test_plugin_fixtures_give_exact_errors(
    wc_checkpoints: Checkpoints, wc_daemons: DaemonPool, wc_workers: WorkerPool
) -> None:
    daemon = wc_daemons.start([wc_checkpoints.single])
    worker = wc_workers.start()

    reply = worker.load(wc_checkpoints.other, socket=daemon.socket, fallback=False)
    fell_back = worker.load(wc_checkpoints.other, key="o", socket=daemon.socket)

    assert not reply["ok"]
    assert reply["error"]["type"] == weightcache.ModelNotFoundError.__name__
    assert reply["error"]["reason"] == "MODEL_NOT_FOUND"
    assert (fell_back["source"], fell_back["fallback_reason"]["code"]) == (
        "disk",
        "MODEL_NOT_FOUND",
    )


def test_a_dead_worker_is_reported_with_its_status(tmp_path: Path) -> None:
    with worker_pool(tmp_path) as workers:
        worker = workers.start()
        assert worker.kill() == -9

        with pytest.raises(WorkerDiedError, match=rf"worker pid {worker.pid} ended with -9"):
            worker.request("close", key="w")


def test_importing_the_harness_imports_neither_pytest_nor_the_daemon() -> None:
    code = (
        "import sys, weightcache.testing\n"
        "print(sorted(m for m in sys.modules"
        " if m == 'pytest' or m.startswith('weightcache_service')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )

    assert done.stdout.strip() == "[]"


def test_a_path_preloaded_at_every_tensor_parallel_rank_is_ready(tmp_path: Path) -> None:
    """One path with --tp-size 2 is two models (one per rank): both READY is a ready start."""
    checkpoints = make_checkpoints(tmp_path)
    plan = tmp_path / "plan.json"
    plan.write_text('{"embed.weight": "colwise"}')
    args = ["--tp-size", "2", "--tp-plan", str(plan)]

    with run_daemon([checkpoints.single], args=args) as daemon:
        held = list_models(daemon.socket)
        socket = daemon.socket

    assert sorted(m.name for m in held) == ["single-tp0of2", "single-tp1of2"]
    assert {m.state for m in held} == {pb.MODEL_STATE_READY}
    assert not os.path.lexists(socket)
    assert shm_segments(segment_tag(socket)) == []


def test_plugin_processes_remember_digests_in_the_sessions_folder(
    wc_hash_cache: Path, wc_checkpoints: Checkpoints, wc_daemons: DaemonPool
) -> None:
    shard = wc_checkpoints.single / "model.safetensors"
    info = os.stat(shard)
    key = f"{info.st_dev}-{info.st_ino}-{info.st_size}-{info.st_mtime_ns}-{info.st_ctime_ns}"

    wc_daemons.start([wc_checkpoints.single])  # fingerprints at the default level, full

    assert os.environ["WEIGHTCACHE_HASH_CACHE"] == str(wc_hash_cache)
    # An entry is "<sha256> <when its read began>" (weightcache.core.hashcache).
    digest, _ = (wc_hash_cache / key).read_text().split()
    assert digest == hashlib.sha256(shard.read_bytes()).hexdigest()
