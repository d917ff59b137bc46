"""vLLM's load format ``weightcache`` against vLLM's own default loader, on CPU.

Each engine runs in a process of its own (``weightcache.testing.vllm_engine``), attached
to a real daemon on a real socket. The outputs of an engine loaded through the daemon must
be bitwise those of an engine loaded by vLLM's default loader (``load_format="auto"``):
MiniLM's embeddings, and a tiny random Llama's greedy tokens. When the daemon cannot
serve, the engine loads from disk with the default loader, logs the reason code, and its
outputs are the same again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vllm.support import (
    ATTACHED_LINE,
    ENGINE_TIMEOUT,
    EngineRun,
    cast_copy,
    recording_python,
    run_engine,
    run_engine_failing,
    skipped_reasons,
)
from weightcache.testing import DaemonPool
from weightcache.testing.daemon import child_env, list_models
from weightcache.testing.llama import minilm_dir

# Each engine takes tens of seconds on a small shared CPU, most of it importing vLLM.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WEIGHTCACHE = "weightcache"
#: Registers through vLLM's plugin loader, then again by hand; prints what vLLM's
#: registry logged (each message once) and the loader class it returns.
REGISTER_TWICE = """
import logging
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("vllm.model_executor.model_loader").addHandler(handler)
logging.getLogger("vllm.model_executor.model_loader").setLevel(logging.DEBUG)
from vllm.plugins import load_general_plugins
load_general_plugins()
from weightcache.integrations.vllm import register
register()
register()
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
loader = get_model_loader(LoadConfig(load_format="weightcache"))
print("LOADER", type(loader).__module__, type(loader).__name__)
for message in records:
    print("LOGGED", message)
"""


def test_the_plugin_registers_the_load_format_once() -> None:
    done = subprocess.run(
        [sys.executable, "-c", REGISTER_TWICE],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("LOADER", "LOGGED"))]
    assert lines == [
        "LOADER weightcache.integrations.vllm.loader WeightcacheModelLoader",
        "LOGGED Registered model loader `<class "
        "'weightcache.integrations.vllm.loader.WeightcacheModelLoader'>` "
        "with load format `weightcache`",
    ]


def assert_no_leases(socket: str) -> None:
    """The engine released its lease once its weights were loaded."""
    models = list_models(socket)
    assert [m.lease_count for m in models] == [0] * len(models)


def test_minilm_embeddings_from_the_daemon_equal_the_default_loaders(
    daemons: DaemonPool, minilm_default: EngineRun, tmp_path: Path
) -> None:
    daemon = daemons.start([minilm_dir()])
    extra = {"socket": daemon.socket}
    run = run_engine(minilm_dir(), "embed", WEIGHTCACHE, tmp_path / "out.pt", extra)

    assert run.attached(), run.log[-4000:]
    assert run.fallback_reasons() == []
    got: torch.Tensor = run.result["embeddings"]
    want: torch.Tensor = minilm_default.result["embeddings"]
    assert got.shape == want.shape == (5, 384)
    assert torch.equal(got, want)
    assert_no_leases(daemon.socket)


def test_llama_generates_the_default_loaders_tokens_from_the_daemon(
    daemons: DaemonPool, llama: Path, llama_default: EngineRun, tmp_path: Path
) -> None:
    daemon = daemons.start([llama])
    extra = {"socket": daemon.socket, "fingerprint_level": "full"}
    run = run_engine(llama, "generate", WEIGHTCACHE, tmp_path / "out.pt", extra)

    assert run.attached(), run.log[-4000:]
    assert run.fallback_reasons() == []
    tokens: list[list[int]] = run.result["token_ids"]
    assert [len(t) for t in tokens] == [12, 12]
    assert len({*tokens[0], *tokens[1]}) > 2  # a model that repeats one token proves little
    assert tokens == llama_default.result["token_ids"]
    assert_no_leases(daemon.socket)


def test_a_daemons_cast_is_attached_as_the_default_loader_reads_a_cast_checkpoint(
    daemons: DaemonPool, llama: Path, tmp_path: Path
) -> None:
    # The daemon holds a BF16 cast; the engine (float32) asks for it with "dtype", and
    # must generate what the default loader generates from the same cast written to disk.
    daemon = daemons.start([llama], dtype="BF16")
    extra = {"socket": daemon.socket, "dtype": "BF16"}
    run = run_engine(llama, "generate", WEIGHTCACHE, tmp_path / "cache.pt", extra)
    bf16 = cast_copy(llama, tmp_path / "tiny-llama-bf16", torch.bfloat16)
    want = run_engine(bf16, "generate", "auto", tmp_path / "disk.pt")

    assert run.attached(), run.log[-4000:]
    assert run.result["token_ids"] == want.result["token_ids"]
    assert_no_leases(daemon.socket)


def test_without_a_daemon_the_default_loader_loads_and_the_reason_is_logged(
    daemons: DaemonPool, llama: Path, llama_default: EngineRun, tmp_path: Path
) -> None:
    extra = {"socket": daemons.socket("absent")}  # no daemon was started there
    # Issue 38: the engine computes the vllm recipe's identity and runs no export (that
    # is the daemon's): vLLM's interpreter, a wrapper recording its runs, is never started
    # (the engine's own vllm.__version__ names the version), and no export's temporary
    # folder appears.
    python, runs = recording_python(tmp_path / "python")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"WEIGHTCACHE_VLLM_PYTHON": str(python), "TMPDIR": str(scratch)}
    run = run_engine(llama, "generate", WEIGHTCACHE, tmp_path / "out.pt", extra, env=env)

    assert skipped_reasons(run) == ["DAEMON_UNAVAILABLE"], run.log[-4000:]
    assert run.fallback_reasons() == ["DAEMON_UNAVAILABLE"]
    assert not run.attached()
    assert run.result["token_ids"] == llama_default.result["token_ids"]
    assert not runs.exists()
    assert [p.name for p in scratch.iterdir() if p.name.startswith("weightcache-vllm-")] == []


def test_a_fingerprint_mismatch_falls_back_to_the_default_loader(
    daemons: DaemonPool, llama: Path, llama_default: EngineRun, tmp_path: Path
) -> None:
    # The daemon holds the model cast to BF16; the engine asks for the checkpoint's bytes.
    daemon = daemons.start([llama], dtype="BF16")
    extra: dict[str, Any] = {"socket": daemon.socket}
    run = run_engine(llama, "generate", WEIGHTCACHE, tmp_path / "out.pt", extra)

    assert run.fallback_reasons() == ["FINGERPRINT_MISMATCH"], run.log[-4000:]
    assert run.result["token_ids"] == llama_default.result["token_ids"]
    assert_no_leases(daemon.socket)


def test_without_fallback_the_engine_fails_with_the_reason(
    daemons: DaemonPool, tmp_path: Path
) -> None:
    socket = daemons.socket("absent")
    # wait_timeout 0: without fallback the loader would wait 300 s for a daemon to start.
    extra = {"socket": socket, "fallback": False, "wait_timeout": 0}
    rc, log = run_engine_failing(minilm_dir(), "embed", WEIGHTCACHE, tmp_path / "out.pt", extra)

    assert rc != 0
    assert f"DaemonUnavailableError: no daemon socket at {socket}" in log, log[-4000:]
    assert not (tmp_path / "out.pt").exists()


def test_tensor_parallel_ranks_attach_the_checkpoint_tensors_without_fallback(
    daemons: DaemonPool, llama: Path, tmp_path: Path
) -> None:
    """docs/vllm.md, "Tensor parallelism", on a 2-rank engine with ``"fallback": false``:
    each rank is refused the vLLM-named model (``INVALID_RECIPE``, before any daemon
    call), goes on to the checkpoint tensors, attaches the daemon's full tensors (which
    vLLM's weight loaders shard by rank) and never falls back; the tokens are those of
    vLLM's default loader on the same 2 ranks."""
    daemon = daemons.start([llama])
    # vLLM's automatic OpenMP binding wants a NUMA node per rank; give each rank a CPU.
    cpus = sorted(os.sched_getaffinity(0))
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[-1]}"}
    extra: dict[str, Any] = {"socket": daemon.socket, "fallback": False}
    run = run_engine(
        llama, "generate", WEIGHTCACHE, tmp_path / "wc.pt", extra, env=env, tensor_parallel_size=2
    )
    default = run_engine(
        llama, "generate", "auto", tmp_path / "auto.pt", env=env, tensor_parallel_size=2
    )

    assert skipped_reasons(run) == ["INVALID_RECIPE", "INVALID_RECIPE"], run.log[-4000:]
    assert run.fallback_reasons() == []
    attached = [line for line in run.log.splitlines() if ATTACHED_LINE in line]
    assert len(attached) == 2, run.log[-4000:]
    assert all("source=cache" in line for line in attached)
    assert "weightcache: tensor_parallel_size 2: every rank attaches the full tensors" in run.log
    assert run.result["token_ids"] == default.result["token_ids"]
    assert_no_leases(daemon.socket)
