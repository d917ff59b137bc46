"""When the daemon cannot serve, load() falls back to disk and says why, or raises."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import weightcache
from tests.support import (
    SHARD_1,
    SHARD_2,
    SMALL_TENSOR,
    Checkpoints,
    Daemon,
    DaemonPool,
    Worker,
    WorkerPool,
    assert_bitwise_equal,
    copy_with_zeroed_tensor,
)


@pytest.fixture(scope="module")
def daemon(module_daemons: DaemonPool, checkpoints: Checkpoints) -> Daemon:
    """Holds ``single`` and ``sharded`` as stored."""
    return module_daemons.start([checkpoints.single, checkpoints.sharded])


@pytest.fixture(scope="module")
def absent_socket(module_daemons: DaemonPool) -> str:
    """A socket path nothing listens on (and no file exists at)."""
    return module_daemons.socket("absent")


@pytest.fixture(scope="module")
def worker(
    module_daemons: DaemonPool, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    """One worker process for the module: none of these loads holds a lease."""
    pool = WorkerPool(tmp_path_factory.mktemp("workers"))
    yield pool.start()
    pool.close()


@pytest.fixture(scope="module")
def edited(checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of ``sharded`` whose small tensor in shard 2 is all zeros."""
    folder = tmp_path_factory.mktemp("edited") / "sharded-edited"
    assert copy_with_zeroed_tensor(checkpoints.sharded, folder, SMALL_TENSOR) == SHARD_2
    return folder


def _fallback_logs(reply: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in reply["logs"] if e.get("event") == "loading from disk"]


def _assert_fell_back(
    reply: dict[str, Any], code: str, folder: Path, components: tuple[str, ...] = ()
) -> None:
    assert reply["ok"], reply
    assert reply["source"] == "disk"
    assert reply["model"] is None
    assert reply["lease"] is None
    reason = reply["fallback_reason"]
    assert (reason["code"], tuple(reason["components"])) == (code, components)
    [entry] = _fallback_logs(reply)
    assert entry["log_level"] == "warning"
    assert (entry["reason"], entry["path"]) == (code, str(folder.resolve()))
    assert entry["detail"] == reason["detail"]


def test_no_daemon_is_daemon_unavailable(
    worker: Worker, absent_socket: str, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    reply = worker.load(
        checkpoints.single, socket=absent_socket, capture_logs=True, dump=tmp_path / "w"
    )

    _assert_fell_back(reply, "DAEMON_UNAVAILABLE", checkpoints.single)
    assert_bitwise_equal(load_file(tmp_path / "w"), checkpoints.tensors)


def test_model_not_held_is_model_not_found(
    daemon: Daemon, worker: Worker, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    # ``other`` is one model.safetensors, like the held ``single``, with other tensors.
    reply = worker.load(
        checkpoints.other, socket=daemon.socket, capture_logs=True, dump=tmp_path / "w"
    )

    _assert_fell_back(reply, "MODEL_NOT_FOUND", checkpoints.other)
    assert_bitwise_equal(
        load_file(tmp_path / "w"), weightcache.load_from_disk(checkpoints.other).tensors
    )


def test_fine_tune_with_the_same_layout_is_fingerprint_mismatch(
    daemon: Daemon, worker: Worker, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    # Same shard files, tensor names, dtypes and shapes as ``sharded``; other bytes.
    reply = worker.load(
        checkpoints.other_sharded, socket=daemon.socket, capture_logs=True, dump=tmp_path / "w"
    )

    _assert_fell_back(
        reply,
        "FINGERPRINT_MISMATCH",
        checkpoints.other_sharded,
        (f"checkpoint/{SHARD_1}", f"checkpoint/{SHARD_2}"),
    )
    assert_bitwise_equal(
        load_file(tmp_path / "w"), weightcache.load_from_disk(checkpoints.other_sharded).tensors
    )


def test_edited_copy_is_fingerprint_mismatch_and_loads_the_edit(
    daemon: Daemon, worker: Worker, checkpoints: Checkpoints, edited: Path, tmp_path: Path
) -> None:
    reply = worker.load(edited, socket=daemon.socket, capture_logs=True, dump=tmp_path / "w")

    _assert_fell_back(reply, "FINGERPRINT_MISMATCH", edited, (f"checkpoint/{SHARD_2}",))
    assert "'sharded'" in reply["fallback_reason"]["detail"]
    got = load_file(tmp_path / "w")
    assert not got[SMALL_TENSOR].any()
    expected = dict(checkpoints.tensors)
    expected[SMALL_TENSOR] = torch.zeros_like(expected[SMALL_TENSOR])
    assert_bitwise_equal(got, expected)


def test_other_recipe_is_fingerprint_mismatch_on_recipe(
    daemon: Daemon, worker: Worker, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    reply = worker.load(
        checkpoints.sharded,
        socket=daemon.socket,
        dtype="F16",
        capture_logs=True,
        dump=tmp_path / "w",
    )

    _assert_fell_back(reply, "FINGERPRINT_MISMATCH", checkpoints.sharded, ("recipe",))
    expected = weightcache.load_from_disk(checkpoints.sharded, dtype="F16").tensors
    assert expected["embed.weight"].dtype == torch.float16
    assert_bitwise_equal(load_file(tmp_path / "w"), expected)


def test_without_fallback_no_daemon_raises_after_waiting(
    worker: Worker, absent_socket: str, checkpoints: Checkpoints
) -> None:
    reply = worker.load(checkpoints.single, socket=absent_socket, fallback=False, wait_timeout=0.5)

    assert not reply["ok"]
    assert reply["error"]["type"] == weightcache.DaemonUnavailableError.__name__
    assert reply["error"]["reason"] == "DAEMON_UNAVAILABLE"
    assert 0.4 <= reply["elapsed"] < 10


def test_without_fallback_mismatch_raises_with_components(
    daemon: Daemon, worker: Worker, edited: Path
) -> None:
    reply = worker.load(edited, socket=daemon.socket, fallback=False, wait_timeout=1.0)

    assert not reply["ok"]
    error = reply["error"]
    assert error["type"] == weightcache.FingerprintMismatchError.__name__
    assert error["reason"] == "FINGERPRINT_MISMATCH"
    assert error["components"] == [f"checkpoint/{SHARD_2}"]
    assert error["metadata"]["model"] == "sharded"


def test_without_fallback_recipe_mismatch_raises_with_components(
    daemon: Daemon, worker: Worker, checkpoints: Checkpoints
) -> None:
    reply = worker.load(
        checkpoints.sharded, socket=daemon.socket, dtype="BF16", fallback=False, wait_timeout=1.0
    )

    assert not reply["ok"]
    assert reply["error"]["type"] == weightcache.FingerprintMismatchError.__name__
    assert reply["error"]["components"] == ["recipe"]


def test_without_fallback_model_not_held_raises_model_not_found(
    daemon: Daemon, worker: Worker, checkpoints: Checkpoints
) -> None:
    reply = worker.load(checkpoints.other, socket=daemon.socket, fallback=False, wait_timeout=1.0)

    assert not reply["ok"]
    assert reply["error"]["type"] == weightcache.ModelNotFoundError.__name__
    assert reply["error"]["reason"] == "MODEL_NOT_FOUND"


# -- a GPU worker without CUDA (issue 15): no socket can be named, so it falls back --------

WITHOUT_CUDA = pytest.mark.skipif(
    torch.cuda.is_available(), reason="asserts what a worker that sees no GPU gets"
)


@WITHOUT_CUDA
def test_cuda_device_without_cuda_is_device_not_visible(
    worker: Worker, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """``device="cuda:0"`` and no ``socket=``: the socket is named after the GPU's UUID,
    which this process cannot read; the worker loads from disk with the reason."""
    reply = worker.load(checkpoints.single, device="cuda:0", capture_logs=True, dump=tmp_path / "w")

    _assert_fell_back(reply, "DEVICE_NOT_VISIBLE", checkpoints.single)
    detail = reply["fallback_reason"]["detail"]
    assert detail.startswith(
        f"device cuda:0: torch {torch.__version__} sees no CUDA/ROCm device, so its UUID "
        "(which names its daemon's socket) cannot be read (CUDA_VISIBLE_DEVICES="
    )
    assert_bitwise_equal(load_file(tmp_path / "w"), checkpoints.tensors)


@WITHOUT_CUDA
def test_cuda_device_without_cuda_and_without_fallback_raises_device_not_visible(
    worker: Worker, checkpoints: Checkpoints
) -> None:
    reply = worker.load(checkpoints.single, device=1, fallback=False, wait_timeout=0.5)

    assert not reply["ok"]
    assert reply["error"]["type"] == weightcache.DeviceNotVisibleError.__name__
    assert reply["error"]["reason"] == "DEVICE_NOT_VISIBLE"
    assert reply["error"]["detail"].startswith("device cuda:1: torch ")


def test_a_given_socket_wins_over_the_device(
    worker: Worker, daemon: Daemon, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """``socket=`` is used as given: the device's UUID is never read (no fallback here even
    without CUDA)."""
    reply = worker.load(
        checkpoints.single, socket=daemon.socket, device="cuda:0", mode="copy", dump=tmp_path / "w"
    )

    assert (reply["ok"], reply["source"], reply["fallback_reason"]) == (True, "cache", None)
    assert_bitwise_equal(load_file(tmp_path / "w"), checkpoints.tensors)


def test_every_fallback_code_is_documented() -> None:
    """``FallbackReason.CODES`` is what falls back, and its docstring names each code."""
    from weightcache._loader import _FALLBACK_REASONS

    codes = weightcache.FallbackReason.CODES
    assert set(codes) == _FALLBACK_REASONS
    assert len(codes) == len(set(codes)) == 11
    doc = weightcache.FallbackReason.__doc__ or ""
    assert [c for c in codes if f"``{c}``" not in doc] == []
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert [c for c in codes if f"- `{c}`: " not in readme] == []


def test_other_fingerprint_level_than_the_daemons_falls_back(
    daemon: Daemon, worker: Worker, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """The daemon fingerprinted ``single`` at its default level, ``full``; a worker at
    ``layout`` computes another fingerprint and does not attach (README: the levels must
    match). The detail names the daemon's level."""
    reply = worker.load(
        checkpoints.single,
        socket=daemon.socket,
        fingerprint_level="layout",
        capture_logs=True,
        dump=tmp_path / "w",
    )

    _assert_fell_back(
        reply,
        "FINGERPRINT_MISMATCH",
        checkpoints.single,
        ("checkpoint/model.safetensors", "format"),
    )
    assert reply["fallback_reason"]["detail"].startswith(
        "held model 'single' was fingerprinted at level 'full', this request at level 'layout': "
    )
    assert reply["fallback_reason"]["detail"].endswith(
        "load with fingerprint_level='full' (the daemon's --fingerprint-level)"
    )
    assert_bitwise_equal(load_file(tmp_path / "w"), checkpoints.tensors)
