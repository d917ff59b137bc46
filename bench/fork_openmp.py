"""Evidence: can a ``vllm serve`` start fork its engine core and worker from a pre-imported
process (``multiprocessing``'s forkserver) on vLLM's CPU build? (issue 38, Build 4)

    .venv-vllm/bin/python bench/fork_openmp.py

vLLM's CPU executor gives each worker its OpenMP threads through the environment: around
the worker's ``Process.start()`` its ``OMPProcessManager.configure_omp_envs``
(``vllm/utils/ompmultiprocessing.py``) sets ``OMP_NUM_THREADS``, and ``OMP_PLACES`` with
``OMP_PROC_BIND`` (GNU OpenMP, the one torch's wheel loads), and vLLM's CPU platform
forces the ``spawn`` start method so that the worker's OpenMP runtime reads them when
torch loads it. This starts the same child three ways, with the environment vLLM sets for
a worker on the last CPU set in the parent after the server started (as an early-started
forkserver would be), and prints what the child's torch runs with:

- ``spawn``: vLLM's way;
- ``forkserver``: a forkserver that preloaded ``torch``;
- ``forkserver-env``: the same, the parent's environment copied into the child before it
  touches torch (the most a wrapper could carry over).

Then it counts the threads of one process after importing what the engine core and the
worker import (a forkserver's preload): :func:`os.fork` copies only the calling thread.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing import forkserver
from multiprocessing.process import BaseProcess


def threads() -> int:
    """The threads of this process (native ones included)."""
    return len(os.listdir("/proc/self/task"))


def report(how: str, env: dict[str, str] | None) -> None:
    """Run a parallel region in torch and print its thread count and CPU affinities."""
    if env is not None:
        os.environ.update(env)
    import torch

    a = torch.randn(512, 512)
    for _ in range(20):
        a @ a
    tasks = os.listdir("/proc/self/task")
    affinity = sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in tasks})
    print(
        f"{how:<15} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')!s:<5}"
        f" torch.get_num_threads()={torch.get_num_threads()} threads={len(tasks)}"
        f" CPUs of each thread={affinity}",
        flush=True,
    )


def child(how: str) -> None:
    """Start :func:`report` in a child started the ``how`` way."""
    process_class: type[BaseProcess]
    if how == "spawn":
        process_class = multiprocessing.get_context("spawn").Process
    else:
        process_class = multiprocessing.get_context("forkserver").Process
        forkserver.ensure_running()
    last = str(max(os.sched_getaffinity(0)))
    worker_env = {"OMP_NUM_THREADS": "1", "OMP_PLACES": "{" + last + "}", "OMP_PROC_BIND": "true"}
    saved = {k: os.environ.get(k) for k in worker_env}
    os.environ.update(worker_env)
    try:
        carried = dict(os.environ) if how.endswith("-env") else None
        process = process_class(target=report, args=(how, carried))
        process.start()
        process.join()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    multiprocessing.set_forkserver_preload(["torch"])
    last = max(os.sched_getaffinity(0))
    print(f"{os.cpu_count()} CPUs; the worker's environment names CPU {last}")
    for how in ("spawn", "forkserver", "forkserver-env"):
        child(how)
    counts = [f"start {threads()}"]
    for module in (
        "numpy",
        "scipy.linalg",
        "torch",
        "vllm.v1.engine.core",
        "vllm.v1.executor.multiproc_executor",
        "vllm.v1.worker.cpu_worker",
    ):
        __import__(module)
        counts.append(f"{module} {threads()}")
    print(f"threads after imports: {', '.join(counts)}; cv2 imported: {'cv2' in sys.modules}")


if __name__ == "__main__":
    main()
