"""Helpers of the vLLM tests: the models they serve, and a vLLM engine in its own process
(``python -m weightcache.testing.vllm_engine``), so that no two engines share one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from weightcache.testing.daemon import child_env
from weightcache.testing.llama import write_llama

#: Seconds one engine (its imports, model load and task) may take on a busy 2-CPU machine.
ENGINE_TIMEOUT = 400.0
FALLBACK_LINE = "weightcache: falling back to vLLM's default loader: reason="
ATTACHED_LINE = "weightcache: attached "


def make_tiny_llama(folder: Path) -> Path:
    """Write a tiny random Llama (``weightcache.testing.llama``'s default shape, float32)
    to ``folder``; returns it."""
    return write_llama(folder)


def cast_copy(folder: Path, dest: Path, dtype: torch.dtype) -> Path:
    """A copy of the model ``folder`` whose ``model.safetensors`` holds its floating
    tensors cast to ``dtype`` (what a daemon's ``--dtype`` holds); returns ``dest``."""
    shutil.copytree(folder, dest)
    tensors = load_file(folder / "model.safetensors")
    save_file({n: t.to(dtype) for n, t in tensors.items()}, dest / "model.safetensors")
    return dest


@dataclass
class EngineRun:
    """What one engine process returned: its saved result and its output (vLLM's log)."""

    result: dict[str, Any]
    log: str

    def fallback_reasons(self) -> list[str]:
        """The reason codes of the loader's fallback log lines, in order."""
        return [
            line.split(FALLBACK_LINE, 1)[1].split()[0]
            for line in self.log.splitlines()
            if FALLBACK_LINE in line
        ]

    def attached(self) -> bool:
        """True when the loader logged that it attached from the daemon."""
        return any(
            ATTACHED_LINE in line and "source=cache" in line for line in self.log.splitlines()
        )


class EngineError(AssertionError):
    """An engine process failed; the message holds its output's end."""


def run_engine(
    model: Path,
    task: str,
    load_format: str,
    out: Path,
    extra: dict[str, Any] | None = None,
    *,
    dtype: str = "float32",
    hf_overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    tensor_parallel_size: int = 1,
) -> EngineRun:
    """Run ``python -m weightcache.testing.vllm_engine`` and return what it saved
    (``hf_overrides``: vLLM's, over the model's ``config.json``; ``env``: variables set
    for it; ``tensor_parallel_size``: vLLM's ranks).

    Raises:
        EngineError: it exited non-zero or ran over :data:`ENGINE_TIMEOUT`.
    """
    done = _engine(
        model,
        task,
        load_format,
        out,
        extra or {},
        dtype=dtype,
        overrides=hf_overrides,
        env=env,
        tensor_parallel_size=tensor_parallel_size,
    )
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise EngineError(f"engine exited {done.returncode}:\n{log[-6000:]}")
    result: dict[str, Any] = torch.load(out, weights_only=True)
    return EngineRun(result, log)


def run_engine_failing(
    model: Path,
    task: str,
    load_format: str,
    out: Path,
    extra: dict[str, Any],
    *,
    hf_overrides: dict[str, Any] | None = None,
) -> tuple[int, str]:
    """Run an engine that is expected to fail; its exit status and output.

    Raises:
        EngineError: it ran over :data:`ENGINE_TIMEOUT`.
    """
    done = _engine(model, task, load_format, out, extra, overrides=hf_overrides)
    return done.returncode, done.stdout + done.stderr


def _engine(
    model: Path,
    task: str,
    load_format: str,
    out: Path,
    extra: dict[str, Any],
    *,
    dtype: str = "float32",
    overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    tensor_parallel_size: int = 1,
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "weightcache.testing.vllm_engine", str(model)]
    command += ["--tensor-parallel-size", str(tensor_parallel_size)]
    command += ["--task", task, "--load-format", load_format, "--out", str(out)]
    command += ["--dtype", dtype, "--hf-overrides", json.dumps(overrides or {})]
    command += ["--extra", json.dumps(extra)]
    # Its own process group: vLLM may start helper processes of its own, and a timeout
    # must end them all, not just the engine's first process.
    with subprocess.Popen(
        command,
        env=child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as child:
        try:
            stdout, stderr = child.communicate(timeout=ENGINE_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            raise EngineError(f"engine ran over {ENGINE_TIMEOUT:.0f} s") from exc
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


INSTALLED_LINE = "weightcache: installed "
SKIPPED_LINE = "weightcache: no vLLM-named model, using the checkpoint's tensors: reason="


def installed(run: EngineRun) -> bool:
    """True when the loader logged that it installed the daemon's vLLM-named tensors."""
    return any(INSTALLED_LINE in line for line in run.log.splitlines())


SHARED_LINE = "weightcache: cpu_gemm=shared: on the daemon's tensors, torch.nn.functional.linear, "


def shared_linears(run: EngineRun) -> int:
    """How many linears the loader logged it kept on the daemon's tensors (``cpu_gemm``
    ``"shared"``); 0 when it logged none."""
    counts = [
        int(line.split(SHARED_LINE, 1)[1].split()[0])
        for line in run.log.splitlines()
        if SHARED_LINE in line
    ]
    return sum(counts)


def skipped_reasons(run: EngineRun) -> list[str]:
    """The reason codes of the vLLM-named path's refusals, in order."""
    return [
        line.split(SKIPPED_LINE, 1)[1].split()[0]
        for line in run.log.splitlines()
        if SKIPPED_LINE in line
    ]


def shadow_vllm_version(folder: Path, version: str) -> Path:
    """A folder that, first on ``PYTHONPATH``, makes the distribution metadata say vLLM is
    ``version`` (a ``vllm-VERSION.dist-info``), while ``import vllm`` still imports the
    installed vLLM: what a daemon whose vLLM is another release reports. Returns it."""
    info = folder / f"vllm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n", encoding="utf-8"
    )
    return folder


def bin_only_copy(folder: Path, dest: Path) -> Path:
    """A copy of the model ``folder`` with its weights in ``pytorch_model.bin`` alone (no
    safetensors), which vLLM's default loader reads and weightcache does not."""
    shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(folder / "model.safetensors"), dest / "pytorch_model.bin")
    return dest


def export_dropping(folder: Path, names: list[str]) -> Path:
    """An interpreter for ``$WEIGHTCACHE_VLLM_PYTHON`` (written to ``folder``) that runs
    vLLM's export with this venv's Python, then takes ``names`` out of what it wrote: a
    daemon holding a vLLM-named model that lacks these parameters or buffers (as one from
    another export could). Every other use of it is this Python's. Returns its path."""
    script = folder / "python"
    folder.mkdir(parents=True, exist_ok=True)
    script.write_text(
        f"""#!{sys.executable}
import subprocess, sys
from safetensors import safe_open
from safetensors.torch import load_file, save_file

args = sys.argv[1:]
code = subprocess.run([{sys.executable!r}, *args]).returncode
if code == 0 and args[:2] == ["-m", "weightcache.integrations.vllm.export"]:
    out = args[args.index("--out") + 1]
    with safe_open(out, "pt") as exported:
        metadata = exported.metadata()
    tensors = load_file(out)
    for name in {names!r}:
        del tensors[name]
    save_file(tensors, out, metadata=metadata)
sys.exit(code)
""",
        encoding="utf-8",
    )
    script.chmod(0o755)
    return script


def recording_python(folder: Path) -> tuple[Path, Path]:
    """An interpreter for ``$WEIGHTCACHE_VLLM_PYTHON`` (written to ``folder``) that appends
    its arguments, one JSON line per run, to a log, then runs this venv's Python with them.
    Returns (the interpreter, the log)."""
    folder.mkdir(parents=True, exist_ok=True)
    script, log = folder / "python", folder / "runs.jsonl"
    script.write_text(
        f"""#!{sys.executable}
import json, os, sys
with open({str(log)!r}, "a", encoding="utf-8") as runs:
    runs.write(json.dumps(sys.argv[1:]) + "\\n")
os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])
""",
        encoding="utf-8",
    )
    script.chmod(0o755)
    return script, log
