"""Demo fleet: forked worker processes, timed one at a time, then held N at once.

Run by ``demo.py`` as ``python demo/fleet.py SPEC.json OUT.json``, once the daemons are
ready. This process imports torch, transformers, safetensors and weightcache once, then
forks every worker from itself (as gunicorn, torch's DataLoader or a serving engine's
launcher fork theirs): each worker does one :class:`worker.Job` and reports back through
a pipe. It never calls gRPC itself, so each worker opens its own channel.

1. timings: ``rounds`` rounds; in each, every job of :func:`timed_jobs` once, one worker
   after the other (loaders interleaved), each worker exiting after its report;
2. memory: for each loader of :data:`MEMORY_LOADERS`, workers are forked until ``N`` of
   them hold the model (after one embedding) at once, for each N of ``workers``; then
   the proportional set size (``Pss`` of ``/proc/PID/smaps_rollup``, kB -> MiB) of every
   process taking part is summed: this process, its N workers and, for the cache, the
   daemon holding the model (its shared-memory segment included). ``idle`` workers hold
   nothing: the baseline of the processes themselves.

SPEC: ``{"model": DIR, "many": DIR, "sockets": {"F32": S, "BF16": S, "many": S},
"daemons": {"F32": PID, "BF16": PID}, "rounds": R, "workers": [1, 4, 8]}``.
OUT: ``{"timings": [...], "memory": [...], "equal": {...}}`` (see :func:`main`).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from worker import MANY_SOURCES, MODEL_SOURCES, Job, run_job, warm_imports

#: (source, dtype) whose memory is measured; ``idle`` loads nothing.
MEMORY_LOADERS = (
    ("idle", "F32"),
    ("cache", "F32"),
    ("from_pretrained", "F32"),
    ("cache", "BF16"),
    ("from_pretrained", "BF16"),
)
STARTED = time.monotonic()


class FleetError(RuntimeError):
    """A worker failed, or reported something unexpected."""


@dataclass
class Worker:
    """A forked worker: its pid, the pipe it reports on, and the one that releases it."""

    pid: int
    report: int
    release: int


def _child(job: Job, report: int, release: int) -> None:
    """In the forked worker: run the job, report, wait for the release (or the parent's
    end), drop the model and its lease, exit. Never returns."""
    status = 0
    keep: list[Any] = []
    try:
        result = run_job(job)
        keep = result.keep
        message: dict[str, Any] = {
            "ok": True,
            "ready_s": result.ready_s,
            "embed_s": result.embed_s,
            "got": result.got,
            "fallback": result.fallback,
            "embeddings": result.embeddings,
        }
    except BaseException:  # reported to the parent, which raises
        message = {"ok": False, "error": traceback.format_exc()}
        status = 1
    try:
        with os.fdopen(report, "wb") as out:
            out.write(pickle.dumps(message))
        os.read(release, 1)  # b"" when the parent closes its end, or exits
        for item in keep:
            close = getattr(item, "close", None)
            if close is not None:
                close()
    except BaseException:
        status = 1
    finally:
        os._exit(status)


#: This process's ends of the pipes of its workers still running: a worker forked later
#: closes its copies, so that each worker's release pipe has one writer, this process
#: (whose end, closing, releases the worker).
_OURS: set[int] = set()


def fork(job: Job) -> Worker:
    """Fork a worker doing ``job``."""
    report_r, report_w = os.pipe()
    release_r, release_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the worker
        for fd in (*_OURS, report_r, release_w):
            os.close(fd)
        _child(job, report_w, release_r)
    os.close(report_w)
    os.close(release_r)
    _OURS.update((report_r, release_w))
    return Worker(pid, report_r, release_w)


def progress(what: str) -> None:
    """One line on stderr: seconds since the fleet started, and what it just did."""
    print(f"fleet {time.monotonic() - STARTED:7.1f} s: {what}", file=sys.stderr, flush=True)


def collect(worker: Worker, job: Job) -> dict[str, Any]:
    """The worker's report (it keeps running until :func:`release`).

    Raises:
        FleetError: it failed, died, or fell back to disk where it should not have.
    """
    _OURS.discard(worker.report)
    with os.fdopen(worker.report, "rb") as reader:
        data = reader.read()
    if not data:
        raise FleetError(f"{job.source} worker {worker.pid} died without a report")
    message: dict[str, Any] = pickle.loads(data)
    if not message["ok"]:
        raise FleetError(f"{job.source} worker failed:\n{message['error']}")
    if job.source == "cache" and message["got"] != "cache":
        raise FleetError(f"the cache worker fell back to disk: {message['fallback']}")
    progress(f"{job.kind} {job.source} {job.dtype}: ready {message['ready_s'] * 1e3:.1f} ms")
    return message


def release(worker: Worker) -> None:
    """Let the worker drop its model and exit, and reap it.

    Raises:
        FleetError: it exited with a non-zero status.
    """
    _OURS.discard(worker.release)
    os.close(worker.release)
    _, status = os.waitpid(worker.pid, 0)
    if status != 0:
        raise FleetError(f"worker {worker.pid} exited with wait status {status}")


def pss_mib(pid: int) -> float:
    """A process's proportional set size (``Pss`` of /proc/PID/smaps_rollup), in MiB."""
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise FleetError(f"/proc/{pid}/smaps_rollup has no Pss line")


def timed_jobs(spec: dict[str, Any]) -> list[Job]:
    """The jobs of one timing round: every model loader in float32, the cache and
    ``from_pretrained`` in bfloat16, and every loader of the many-tensor checkpoint."""
    model, sockets = spec["model"], spec["sockets"]
    jobs = [Job(s, "model", model, sockets["F32"]) for s in MODEL_SOURCES]
    jobs += [Job(s, "model", model, sockets["BF16"], "BF16") for s in MODEL_SOURCES[:3]]
    jobs += [Job(s, "many", spec["many"], sockets["many"]) for s in MANY_SOURCES]
    return jobs


def run_timings(spec: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Phase 1: the timing rows, and whether each loader's embeddings are bitwise those
    of ``from_pretrained`` in the same dtype (with the largest difference)."""
    rows: list[dict[str, Any]] = []
    embeddings: dict[tuple[str, str], torch.Tensor] = {}
    for round_ in range(spec["rounds"]):
        for job in timed_jobs(spec):
            worker = fork(job)
            try:
                message = collect(worker, job)
            finally:
                release(worker)
            if message["embeddings"] is not None:
                embeddings.setdefault((job.source, job.dtype), message["embeddings"])
            rows.append(
                {
                    "kind": job.kind,
                    "source": job.source,
                    "dtype": job.dtype,
                    "round": round_,
                    "ready_s": message["ready_s"],
                    "embed_s": message["embed_s"],
                    "got": message["got"],
                }
            )
    equal: dict[str, Any] = {}
    for (source, dtype), tensor in sorted(embeddings.items()):
        reference = embeddings[("from_pretrained", dtype)]
        equal[f"{source} {dtype}"] = {
            "equal": bool(torch.equal(tensor, reference)),
            "max_abs_diff": float((tensor - reference).abs().max()),
        }
    return rows, equal


def run_memory(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Phase 2: one row per loader and N (module docstring)."""
    rows: list[dict[str, Any]] = []
    for source, dtype in MEMORY_LOADERS:
        kind = "idle" if source == "idle" else "model"
        job = Job(source, kind, spec["model"], spec["sockets"][dtype], dtype)
        held: list[Worker] = []
        try:
            for n in spec["workers"]:
                batch = [fork(job) for _ in range(n - len(held))]
                held += batch
                for worker in batch:
                    collect(worker, job)
                workers = sum(pss_mib(w.pid) for w in held)
                daemon = pss_mib(spec["daemons"][dtype]) if source == "cache" else 0.0
                parent = pss_mib(os.getpid())
                progress(f"memory {source} {dtype} N={n}: {workers + daemon + parent:.0f} MiB")
                rows.append(
                    {
                        "source": source,
                        "dtype": dtype,
                        "workers": n,
                        "workers_mib": workers,
                        "daemon_mib": daemon,
                        "parent_mib": parent,
                        "total_mib": workers + daemon + parent,
                    }
                )
        finally:
            for worker in held:
                release(worker)
    return rows


def main() -> int:
    """Read SPEC, run both phases, write OUT; 0 on success, 1 with the error on stderr."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    warm_imports()
    try:
        timings, equal = run_timings(spec)
        memory = run_memory(spec)
    except FleetError as err:
        print(f"fleet: {err}", file=sys.stderr)
        return 1
    Path(sys.argv[2]).write_text(
        json.dumps({"timings": timings, "memory": memory, "equal": equal}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
