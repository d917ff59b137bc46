"""A GPU daemon and its workers meet on the device's default socket (issue 15): the daemon
is started with ``--device cuda:N`` and no ``--socket``; the worker calls
``weightcache.load(path, device=...)`` with no ``socket=``; both name
``<runtime dir>/GPU-<uuid>.sock`` by the rule of ``weightcache.core.sockets``."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support import (
    POLL,
    READY_TIMEOUT,
    Checkpoints,
    assert_bitwise_equal,
    child_env,
    cli_command,
    health,
    short_tempdir,
)
from weightcache.testing.daemon import wait_or_kill

pytestmark = pytest.mark.gpu

RULE_VARIABLES = ("WEIGHTCACHE_SOCKET", "WEIGHTCACHE_RUNTIME_DIR", "XDG_RUNTIME_DIR")

#: A worker: load with no socket, save what it got, report where it came from.
WORKER = r"""
import json, sys
import weightcache
from safetensors.torch import save_file

path, device, dump = sys.argv[1:4]
with weightcache.load(path, device=device, fallback=False, wait_timeout=10.0) as weights:
    save_file({k: v.cpu().contiguous() for k, v in weights.tensors.items()}, dump)
    print(json.dumps({
        "source": weights.source,
        "socket": weights.socket,
        "devices": sorted({str(t.device) for t in weights.tensors.values()}),
    }))
"""


@pytest.fixture
def runtime_env() -> Iterator[tuple[Path, dict[str, str]]]:
    """A private runtime dir, and an environment that names it (and nothing else of the
    rule); GPUs numbered by PCI bus, as the systemd unit numbers them."""
    runtime = short_tempdir()
    env = {k: v for k, v in child_env().items() if k not in RULE_VARIABLES}
    env["WEIGHTCACHE_RUNTIME_DIR"] = str(runtime)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    try:
        yield runtime, env
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


@contextlib.contextmanager
def gpu_daemon(
    models: list[str], device: str, env: dict[str, str], socket: str, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """``weightcache preload MODELS --device DEVICE`` without ``--socket``, ready on
    ``socket``; SIGTERMed after, and it must exit 0 and remove the socket."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*cli_command(), "preload", *models, "--device", device],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while health(socket) != "SERVING":
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(POLL)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        assert not wait_or_kill(proc), "ignored SIGTERM: " + log.read_text(errors="replace")
        assert proc.returncode == 0, log.read_text(errors="replace")
    assert not Path(socket).exists()


def run_worker(path: Path, device: str, env: dict[str, str], dump: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(path), device, str(dump)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def physical_uuid(index: int) -> str:
    """The UUID of PCI-ordered GPU ``index``, read in a process numbering GPUs that way."""
    code = f"from weightcache.core.cuda import device_uuid; print(device_uuid({index}))"
    env = {**child_env(), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    return done.stdout.strip()


def test_daemon_and_worker_meet_on_the_gpus_default_socket(
    runtime_env: tuple[Path, dict[str, str]], checkpoints: Checkpoints, tmp_path: Path
) -> None:
    runtime, env = runtime_env
    socket = str(runtime / f"{physical_uuid(0)}.sock")

    with gpu_daemon([str(checkpoints.single)], "cuda:0", env, socket, tmp_path / "d.log"):
        got = run_worker(checkpoints.single, "cuda:0", env, tmp_path / "w")
        listed = subprocess.run(
            [*cli_command(), "ls", "--device", "cuda:0"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )

    assert got == {"source": "cache", "socket": socket, "devices": ["cuda:0"]}
    assert_bitwise_equal(load_file(tmp_path / "w"), checkpoints.tensors)
    assert (listed.returncode, listed.stderr) == (0, "")
    assert listed.stdout.splitlines()[1].split()[:2] == ["single", "READY"]


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_a_worker_with_renumbered_gpus_finds_the_daemon_of_the_same_gpu(
    runtime_env: tuple[Path, dict[str, str]], checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """The daemon serves PCI GPU 1 (``--device cuda:1``); the worker sees only that GPU
    (``CUDA_VISIBLE_DEVICES=1``), as its ``cuda:0``: the UUID names the same socket."""
    runtime, env = runtime_env
    socket = str(runtime / f"{physical_uuid(1)}.sock")

    with gpu_daemon([str(checkpoints.single)], "cuda:1", env, socket, tmp_path / "d.log"):
        got = run_worker(
            checkpoints.single, "cuda:0", {**env, "CUDA_VISIBLE_DEVICES": "1"}, tmp_path / "w"
        )

    assert got == {"source": "cache", "socket": socket, "devices": ["cuda:0"]}
    assert_bitwise_equal(load_file(tmp_path / "w"), checkpoints.tensors)
