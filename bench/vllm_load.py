"""vLLM's ``load_model`` on the daemon's vLLM-named tensors vs the checkpoint's tensors vs
vLLM's default loader, and the host's memory with several engines on one model.

Run in the vLLM venv: ``.venv-vllm/bin/python bench/vllm_load.py [options]``
(``make setup-vllm`` makes it).

1. write a random-weight Llama (``--layers`` layers of hidden size 2048, MiniLM's
   tokenizer, ``--dtype``; 12 layers: 666 M parameters, 1.33 GB in bf16) under /tmp;
2. start two daemons on it: one holding the checkpoint's tensors, one with
   ``--recipe vllm:dtype=DTYPE`` (vLLM's names, loaded by vLLM);
3. ``--rounds`` rounds, interleaved, of one fresh process per path, each timing vLLM's
   ``load_model`` alone (create the model + load + ``process_weights_after_loading``) as a
   worker calls it, after vLLM's imports and configuration:
   ``vllm`` (load format ``weightcache``, the vLLM-named path), ``checkpoint`` (load format
   ``weightcache`` with ``"recipe": "checkpoint"``: vLLM's weight loaders copy the
   daemon's checkpoint tensors) and ``auto`` (vLLM's default loader, the files in the page
   cache);
4. with ``--engines 1,2,4``: for ``vllm`` and ``auto``, N such processes at once, each
   holding its loaded model; the host's memory is the sum of their PSS
   (``/proc/PID/smaps_rollup``) plus the daemon's (its arena mapping: shared pages are
   counted once over all), and what each engine beyond the first adds;
5. ``--first-token``: one real engine per path (``weightcache.testing.vllm_engine``:
   ``vllm.LLM`` + one greedy generation), interleaved: the process's start to its first
   tokens.

Goals (issue 25): ``load_model`` at least 3x faster than the default loader in bf16; each
engine beyond the first adds less than 10 % of the model's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PATHS = ("vllm", "checkpoint", "auto")

WORKER = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
model, path, socket, dtype = sys.argv[1:5]
import torch
from vllm.config import set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized
from vllm.model_executor.model_loader import get_model_loader
from vllm.plugins import load_general_plugins
from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop
from weightcache.integrations.vllm.export import engine_config
load_general_plugins()
_set_torch_accelerator_to_noop()  # as vLLM's CPU model runner does before it loads
extra = {"socket": socket, "recipe": path} if path != "auto" else {}
config = engine_config(model, dtype, "none", "auto" if path == "auto" else "weightcache", extra)
with set_current_vllm_config(config):
    ensure_model_parallel_initialized(1, 1)
    loader = get_model_loader(config.load_config)
    begin = time.perf_counter()
    built = loader.load_model(vllm_config=config, model_config=config.model_config)
    took = time.perf_counter() - begin
    # A digest of what the engine would compute with: every tensor the model holds.
    probe = sum(t.float().sum().item() for t in built.state_dict().values() if t.numel())
print(json.dumps({"load_model_s": took, "probe": probe}), flush=True)
sys.stdin.readline()  # held until told to exit, for the memory measure
"""


def write_model(folder: Path, layers: int, dtype: str) -> Path:
    """The benchmark's random Llama (``weightcache.testing.llama.MEDIUM``, ``layers``)."""
    from weightcache.testing.llama import MEDIUM, write_llama

    return write_llama(folder, replace(MEDIUM, num_hidden_layers=layers), dtype=dtype)


def bench_model(tmp: Path, layers: int, dtype: str) -> tuple[Path, Path, int]:
    """In ``tmp``: a folder for the daemons' sockets (mode 0700), the benchmark's model
    (:func:`write_model`) and its size in bytes."""
    sockets = tmp / "s"
    sockets.mkdir(mode=0o700)
    model = write_model(tmp / "llama", layers, dtype)
    return sockets, model, (model / "model.safetensors").stat().st_size


def pss(pid: int) -> int:
    """The process's proportional set size in bytes (``/proc/PID/smaps_rollup``)."""
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss for {pid}")


@contextmanager
def workers(model: Path, path: str, socket: str, dtype: str, n: int) -> Iterator[list[Any]]:
    """``n`` worker processes of ``path``, each loaded; their results, while they hold."""
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    with ExitStack() as stack:
        procs = []
        for _ in range(n):
            proc = subprocess.Popen(
                [sys.executable, "-c", WORKER, str(model), path, socket, dtype],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, env=env,
            )  # fmt: skip
            stack.callback(_end, proc)
            procs.append(proc)
        results = []
        for proc in procs:
            results.append({"pid": proc.pid, **_result(proc, path)})
        yield results


def _result(proc: subprocess.Popen[str], path: str) -> dict[str, Any]:
    """The worker's JSON line (vLLM prints other lines to stdout too)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            result: dict[str, Any] = json.loads(line)
            return result
    raise RuntimeError(f"a {path} worker exited {proc.wait()} before loading")


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.stdin:
        proc.stdin.close()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_daemon(model: Path, socket: str, args: Sequence[str]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "weightcache_service.cli", "preload", str(model)]
    command += ["--socket", socket, *args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(socket: str, timeout: float = 1800.0) -> float:
    from weightcache.testing.daemon import list_models

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            models = list_models(socket)
            if models and all(m.state == 2 for m in models):  # READY
                return time.monotonic() - start
        except Exception:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"daemon at {socket} not ready in {timeout:.0f} s")


def first_token(model: Path, path: str, socket: str, dtype: str, out: Path) -> dict[str, Any]:
    extra = {"socket": socket, "recipe": path} if path != "auto" else {}
    fmt = "auto" if path == "auto" else "weightcache"
    command = [sys.executable, "-m", "weightcache.testing.vllm_engine", str(model)]
    command += ["--task", "generate", "--load-format", fmt, "--extra", json.dumps(extra)]
    command += ["--out", str(out), "--dtype", dtype]
    begin = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - begin
    import torch

    result = torch.load(out, weights_only=True)
    return {"wall_s": wall, "engine_s": result["engine_s"], "load_model_s": result["load_model_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="1,2,4", help="N for the memory measure; '' skips")
    parser.add_argument("--first-token", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wc-vllm-bench-") as tmp:
        run(Path(tmp), args)


def run(tmp: Path, args: argparse.Namespace) -> None:
    sockets, model, nbytes = bench_model(tmp, args.layers, args.dtype)
    print(f"model: {args.layers} layers, {nbytes / 1e9:.2f} GB {args.dtype}; {os.cpu_count()} CPUs")
    raw_sock, vllm_sock = str(sockets / "raw.sock"), str(sockets / "vllm.sock")
    daemons = [start_daemon(model, raw_sock, [])]
    try:
        print(f"daemon (checkpoint tensors) ready in {wait_ready(raw_sock):.1f} s")
        daemons.append(start_daemon(model, vllm_sock, ["--recipe", f"vllm:dtype={args.dtype}"]))
        print(f"daemon (--recipe vllm, export included) ready in {wait_ready(vllm_sock):.1f} s")
        socket_of = {"vllm": vllm_sock, "checkpoint": raw_sock, "auto": raw_sock}
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        probes: dict[str, set[float]] = {p: set() for p in PATHS}
        for _ in range(args.rounds):
            for path in PATHS:
                with workers(model, path, socket_of[path], args.dtype, 1) as (result,):
                    times[path].append(result["load_model_s"])
                    probes[path].add(result["probe"])
        print("\nload_model (create + load + process), seconds, fresh process each:")
        print(f"{'path':<12}{'median':>9}{'min':>9}   runs")
        for path in PATHS:
            runs = " ".join(f"{t:.3f}" for t in times[path])
            print(
                f"{path:<12}{statistics.median(times[path]):>9.3f}{min(times[path]):>9.3f}   {runs}"
            )
        auto = statistics.median(times["auto"])
        for path in ("vllm", "checkpoint"):
            print(f"default / {path}: {auto / statistics.median(times[path]):.2f}x")
        print(f"same embeddings probe on every path: {len(set.union(*probes.values())) == 1}")
        if args.engines:
            memory(model, socket_of, args, nbytes, daemons[1].pid)
        if args.first_token:
            print("\nprocess start to first tokens (vllm.LLM + one greedy generation), seconds:")
            for r in range(args.rounds):
                for path in PATHS:
                    got = first_token(model, path, socket_of[path], args.dtype, tmp / "out.pt")
                    line = f"  round {r} {path:<12} wall {got['wall_s']:.2f}"
                    line += f"  engine {got['engine_s']:.2f}  load_model {got['load_model_s']:.3f}"
                    print(line)
    finally:
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(timeout=120)


def memory(
    model: Path, socket_of: dict[str, str], args: argparse.Namespace, nbytes: int, daemon: int
) -> None:
    counts = [int(n) for n in args.engines.split(",")]
    print("\nhost memory with N engines holding the model (sum of PSS; vllm: the daemon's too):")
    print(
        f"{'path':<8}"
        + "".join(f"{'N=' + str(n):>12}" for n in counts)
        + "   added per engine beyond the first"
    )
    for path in ("vllm", "auto"):
        totals = []
        for n in counts:
            with workers(model, path, socket_of[path], args.dtype, n) as held:
                time.sleep(1.0)
                total = sum(pss(w["pid"]) for w in held)
                if path == "vllm":
                    total += pss(daemon)
                totals.append(total)
        added = (totals[-1] - totals[0]) / max(counts[-1] - counts[0], 1)
        cells = "".join(f"{t / 2**30:>9.2f} GiB" for t in totals)
        print(f"{path:<8}{cells}   {added / 2**30:.2f} GiB = {added / nbytes:.0%} of the model")


if __name__ == "__main__":
    main()
