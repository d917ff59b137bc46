"""weightcache with vLLM: a Llama served by vLLM on the daemon's vLLM-named tensors, next to
vLLM's default loader.

Run with ``make demo-vllm`` (``.venv-vllm/bin/python demo/demo_vllm.py``), in the venv that
has vLLM's CPU build (``make setup-vllm``). Nothing reaches the network.

1. write a random-weight Llama (``--layers`` layers of ``weightcache.testing.llama.MEDIUM``,
   bf16: 4 layers, 0.53 GB) in a temporary folder;
2. start ``weightcache preload MODEL_DIR --recipe vllm:dtype=bfloat16``: the daemon runs
   vLLM once (the export) and holds the model as vLLM's model holds it;
3. run a vLLM engine (``python -m weightcache.testing.vllm_engine``, one process) with
   ``load_format="weightcache"`` on that socket, then one with vLLM's default loader;
4. print each engine's ``load_model`` time (model build + weights + processing), its start
   time, where its tensors lie (bytes in the daemon's segment) and whether the greedy
   tokens are the same;
5. stop the daemon with SIGTERM and check it left nothing in /dev/shm and no socket.

Exits 0 only when the first engine installed the daemon's tensors, the tokens are equal
and the daemon cleaned up after itself.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from weightcache.testing import HarnessError, run_daemon
from weightcache.testing.daemon import child_env
from weightcache.testing.llama import MEDIUM, write_llama

#: Seconds one engine may take (most of it importing vLLM).
ENGINE_TIMEOUT = 600.0
#: Seconds the daemon may take to be ready: the export imports and runs vLLM.
EXPORT_TIMEOUT = 900.0
#: Characters of a failed engine's output shown.
OUTPUT_TAIL_CHARS = 4000
INSTALLED_LINE = "weightcache: installed "
DTYPE = "bfloat16"


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and why."""


def run_engine(model: Path, load_format: str, extra: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run one vLLM engine process; returns what it saved, plus ``installed`` (the loader's
    line when it installed the daemon's tensors, else empty).

    Raises:
        DemoError: it failed, or ran over :data:`ENGINE_TIMEOUT` seconds.
    """
    command = [sys.executable, "-m", "weightcache.testing.vllm_engine", str(model)]
    command += ["--task", "generate", "--load-format", load_format, "--out", str(out)]
    command += ["--extra", json.dumps(extra), "--dtype", DTYPE]
    try:
        done = subprocess.run(
            command,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=ENGINE_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise DemoError(f"{load_format} engine ran over {ENGINE_TIMEOUT:.0f} s") from None
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise DemoError(
            f"{load_format} engine exited {done.returncode}:\n{log[-OUTPUT_TAIL_CHARS:]}"
        )
    result: dict[str, Any] = torch.load(out, weights_only=True)
    lines = [line for line in log.splitlines() if INSTALLED_LINE in line]
    result["installed"] = lines[0][lines[0].index(INSTALLED_LINE) :] if lines else ""
    return result


def print_table(cache: dict[str, Any], disk: dict[str, Any], nbytes: int) -> None:
    """load_model, engine start and where the tensors lie, for both engines."""
    print(f"  {'load format':<26}{'load_model':>12}{'engine start':>15}{'in the segment':>17}")
    for name, run in (("weightcache (vLLM-named)", cache), ("auto (default loader)", disk)):
        held = run["placement"]["segment_bytes"] / 1e6
        print(
            f"  {name:<26}{run['load_model_s']:>10.3f} s{run['engine_s']:>13.2f} s{held:>14.0f} MB"
        )
    print(
        f"  load_model, default / weightcache: {disk['load_model_s'] / cache['load_model_s']:.1f}x"
    )
    print(f"  model: {nbytes / 1e6:.0f} MB of weights; load_model = build the model, get its")
    print("  weights, process them. The default loader reads the files (in the page cache:")
    print("  just written); the weightcache engine builds on the meta device and installs the")
    print("  daemon's tensors without copying them. The loader's own line:")
    print(f"    {cache['installed']}")


def run_demo(tmp: Path, layers: int) -> bool:
    """Steps 1-5 of the module docstring; True when everything checked out.

    Raises:
        DemoError: an engine failed.
        HarnessError: the daemon did not start, or did not stop cleanly.
    """
    shape = replace(MEDIUM, num_hidden_layers=layers)
    model = write_llama(tmp / "llama", shape, dtype=DTYPE)
    nbytes = (model / "model.safetensors").stat().st_size
    print(f"weightcache + vLLM demo: a random Llama ({layers} layers, {DTYPE}), vLLM CPU")
    print(f"  model:  {model} ({nbytes / 1e6:.0f} MB)")
    args = ["--recipe", f"vllm:dtype={DTYPE}"]
    with run_daemon(
        [model], args=args, log_dir=tmp, new_session=True, timeout=EXPORT_TIMEOUT
    ) as daemon:
        print(f"  daemon: pid {daemon.pid}, socket {daemon.socket} (vLLM ran once there)")
        cache = run_engine(model, "weightcache", {"socket": daemon.socket}, tmp / "cache.pt")
        disk = run_engine(model, "auto", {}, tmp / "disk.pt")
    print("  daemon stopped on SIGTERM; socket removed; no segment left in /dev/shm")
    print()
    print_table(cache, disk, nbytes)
    print()
    equal = cache["token_ids"] == disk["token_ids"]
    print(f"  greedy tokens, weightcache vs default loader, equal: {equal}")
    if not cache["installed"]:
        print("  FAILED: the weightcache engine did not install the daemon's tensors")
    return equal and bool(cache["installed"])


def main() -> int:
    """Run the demo in a fresh temporary folder; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    layers = parser.parse_args().layers
    ok = False
    try:
        with tempfile.TemporaryDirectory(prefix="wcdemo-vllm-") as tmp:
            ok = run_demo(Path(tmp), layers)
    except (HarnessError, DemoError) as err:
        print(f"FAILED: {err}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    print("  OK" if ok else "  FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
