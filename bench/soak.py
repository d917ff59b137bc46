"""Soak: one daemon, N workers cycling attach / compute / release; does anything grow?

Run with ``.venv/bin/python bench/soak.py [--workers 16] [--seconds 600]``.

1. generate a checkpoint in a temporary folder under /tmp (``--size-mib`` MiB of
   ``--tensors`` BF16/F16/F32 tensors in ``--shards`` safetensors files plus the index),
   and compute, from the files on disk with ``safetensors``, one checksum per tensor;
2. start ``weightcache preload <folder>`` on a socket in a temporary folder
   (``weightcache.testing.run_daemon``) and wait until it is ready;
   take the ``baseline`` sample;
3. start ``--workers`` worker processes (this file with ``--worker``); each loops over
   cycles of ``weightcache.load(dir, socket=S, fallback=False)`` (zero-copy, one lease) ->
   checksum of ``CHECKED_PER_CYCLE`` tensors (a different few each cycle) compared with the
   disk's -> ``close()`` (release), counting cycles, mismatches and errors by exception
   type (a lost lease counts as ``LeaseLostError``);
4. warm-up: every worker cycles for ``--warmup`` seconds (at least one cycle each), then
   idles; the ``start`` sample is taken with every worker idle but alive (its KeepAlive
   stream open, no lease);
5. the measured run: all cycle for ``--seconds`` seconds, sampled every ``--sample-every``
   seconds; then they stop, and the ``end`` sample is taken in the same idle state as
   ``start``; then the workers exit and, after ``SETTLE_SECONDS``, the ``exited`` sample;
6. print the samples, the ``start -> end`` deltas, the VmRSS and RssAnon change over each
   half of the run (still growing, or settled?), the ``baseline -> exited`` deltas,
   cycles, cycles/s, errors and mismatches;
7. stop the daemon with SIGTERM, check it left no segment and no socket, remove the folder
   (also on failure and on Ctrl-C).

A sample reads, of the daemon process: VmRSS, RssAnon, RssShmem (``/proc/PID/status``),
open fds (``/proc/PID/fd``), threads, live leases (``ListModels``, sum of
``lease_count``), and the ``/dev/shm`` bytes allocated to this daemon's segments; and
``acquired``, the number of ``acquired`` lines in the daemon's log so far (= leases
granted). Of the workers, summed: RssAnon, open fds, and mappings of ``/dev/shm`` files
(``/proc/PID/maps``; when idle, each is an arena a worker still maps after ``close()``).

Exit status 0 only if there were no mismatches and no errors, every Acquire came from the
daemon, leases were 0 at ``end`` and at ``exited``, and the daemon stopped cleanly. Growth
is not judged here; read the deltas (bench/README.md has recorded runs).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
import torch

import weightcache
from weightcache.testing import Daemon
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc

#: Tensors whose checksum a worker checks per cycle (rotating through all of them).
CHECKED_PER_CYCLE = 4
#: Seconds to wait after the workers exited before the ``exited`` sample.
SETTLE_SECONDS = 3.0
#: Seconds a worker may take to start (imports) and answer ``ready``.
START_TIMEOUT = 300.0
#: Seconds a worker may take to finish its current cycle and report after ``stop``.
STOP_TIMEOUT = 120.0
#: Seconds a worker may take to exit after its stdin closed, before SIGTERM / SIGKILL.
EXIT_TIMEOUT = 30.0
#: Seconds one ListModels call may take.
RPC_TIMEOUT = 10.0
#: Error messages kept per worker and phase, for the report.
KEPT_MESSAGES = 3
#: Prefix of the worker's protocol lines on stdout (anything else there is ignored).
MARK = "SOAK "
#: Integer dtype of each element size, to checksum a tensor's bits exactly.
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SoakError(RuntimeError):
    """A step of the soak failed; the message says which and why."""


def checksum(tensor: torch.Tensor) -> int:
    """Sum of a tensor's elements read as signed integers of their width, in int64.

    Exact and order-independent, so any bit that differs from the disk shows (but for
    changes that cancel out, which random corruption does not do).
    """
    bits = tensor.view(INT_OF_SIZE[tensor.element_size()])
    return int(bits.to(torch.int64).sum())


# --------------------------------------------------------------------------- worker --


@dataclass
class Counts:
    """Cycles, mismatches, errors by kind (and a few of their messages), slowest cycle."""

    cycles: int = 0
    mismatches: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    messages: list[str] = field(default_factory=list)
    max_cycle: float = 0.0


@dataclass
class Phase(Counts):
    """What one worker counted during one phase (warm-up or the measured run)."""

    seconds: float = 0.0

    def error(self, kind: str, message: str) -> None:
        """Count one error of ``kind``; keep its message if few are kept yet."""
        self.errors[kind] += 1
        if len(self.messages) < KEPT_MESSAGES:
            self.messages.append(f"{kind}: {message}"[:500])


class Worker:
    """The worker process's loop: cycles on ``go``, reports on ``stop``, exits on EOF."""

    def __init__(self, model: str, socket: str, expected: dict[str, int]) -> None:
        self.model = model
        self.socket = socket
        self.expected = expected
        self.names = sorted(expected)
        self.turn = 0
        self.phase = Phase()
        self.commands: queue.Queue[str] = queue.Queue()

    def read_commands(self, stream: IO[str]) -> None:
        """Queue each line of ``stream``; ``quit`` at EOF (the parent went away)."""
        for line in stream:
            self.commands.put(line.strip())
        self.commands.put("quit")

    def on_lease_lost(self, error: Exception) -> None:
        """Count a lost lease (called on the keepalive thread)."""
        self.phase.error(type(error).__name__, str(error))

    def cycle(self) -> None:
        """One attach -> checksum of a few tensors -> release; counts into ``phase``."""
        begin = time.perf_counter()
        try:
            weights = weightcache.load(
                self.model, socket=self.socket, fallback=False, on_lease_lost=self.on_lease_lost
            )
            try:
                self.check(weights)
            finally:
                weights.close()
        except Exception as exc:
            self.phase.error(type(exc).__name__, str(exc))
        self.phase.cycles += 1
        self.phase.max_cycle = max(self.phase.max_cycle, time.perf_counter() - begin)

    def check(self, weights: weightcache.LoadedWeights) -> None:
        """Compare the source, the tensor names and a few checksums with the disk's."""
        if weights.source != "cache":
            self.phase.error("NotFromCache", f"source {weights.source}")
            return
        tensors = weights.tensors
        if sorted(tensors) != self.names:
            self.phase.mismatches += 1
            return
        for _ in range(CHECKED_PER_CYCLE):
            name = self.names[self.turn % len(self.names)]
            self.turn += 1
            if checksum(tensors[name]) != self.expected[name]:
                self.phase.mismatches += 1

    def run(self) -> None:
        """Answer ``ready``, then serve ``go`` / ``stop`` until ``quit`` or EOF."""
        threading.Thread(target=self.read_commands, args=(sys.stdin,), daemon=True).start()
        emit({"event": "ready", "pid": os.getpid()})
        command = self.commands.get()
        while command != "quit":
            if command == "go":
                command = self.cycle_until_command()
                emit({"event": "phase", **self.report()})
                if command != "quit":
                    command = self.commands.get()
            else:
                command = self.commands.get()

    def cycle_until_command(self) -> str:
        """Cycle (at least once) until a command arrives; returns it."""
        self.phase = Phase()
        begin = time.monotonic()
        while True:
            self.cycle()
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                continue
            self.phase.seconds = time.monotonic() - begin
            return command

    def report(self) -> dict[str, Any]:
        """The current phase's counts as JSON-ready fields."""
        p = self.phase
        return {
            "cycles": p.cycles,
            "mismatches": p.mismatches,
            "errors": dict(p.errors),
            "messages": p.messages,
            "seconds": p.seconds,
            "max_cycle": p.max_cycle,
        }


def emit(message: dict[str, Any]) -> None:
    """Write one protocol line to stdout."""
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def worker_main(model: str, socket: str, expected_path: str) -> int:
    """Entry point of a worker process (``--worker``); returns its exit status."""
    import logging

    # The SDK logs through standard logging: warnings and up to stderr, stdout stays the
    # protocol's.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    expected = {k: int(v) for k, v in json.loads(Path(expected_path).read_text()).items()}
    Worker(model, socket, expected).run()
    return 0


# --------------------------------------------------------------------------- parent --


class WorkerProcess:
    """One worker child: its process, a thread reading its protocol lines, its log file."""

    def __init__(self, index: int, command: list[str], log_path: Path) -> None:
        self.index = index
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,  # a Ctrl-C reaches the parent only
            )
        self.messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.messages.put(json.loads(line[len(MARK) :]))
        self.messages.put(None)

    def send(self, command: str) -> None:
        """Send one command line (``go`` / ``stop``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        """The next protocol message, which must be ``event``.

        Raises:
            SoakError: it exited, said something else, or said nothing for ``timeout`` s.
        """
        try:
            message = self.messages.get(timeout=timeout)
        except queue.Empty:
            raise SoakError(f"worker {self.index}: no {event!r} within {timeout:.0f} s") from None
        if message is None or message.get("event") != event:
            self.proc.poll()
            raise SoakError(
                f"worker {self.index} (exit status {self.proc.returncode}) sent {message} "
                f"instead of {event!r}; its log:\n{self.log_tail()}"
            )
        return message

    def close_stdin(self) -> None:
        """Close the worker's stdin: it finishes its cycle, reports if cycling, and exits."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):  # it is gone already
            self.proc.stdin.close()

    def wait_or_kill(self, deadline: float) -> int:
        """Wait until ``deadline`` (monotonic), then SIGTERM, then SIGKILL; returns the
        exit status (negative: killed by that signal)."""
        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of the worker's stderr."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"


def stop_workers(workers: list[WorkerProcess]) -> list[int]:
    """Close every worker's stdin, wait up to :data:`EXIT_TIMEOUT` seconds for them all,
    then terminate the rest; returns their exit statuses."""
    for w in workers:
        w.close_stdin()
    deadline = time.monotonic() + EXIT_TIMEOUT
    return [w.wait_or_kill(deadline) for w in workers]


def proc_status(pid: int) -> dict[str, int]:
    """Integer fields of ``/proc/PID/status`` (``kB`` values in kB); {} if it is gone."""
    fields: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return fields
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[key] = int(parts[0])
    return fields


def open_fds(pid: int) -> int:
    """Number of open file descriptors of ``pid`` (0 if it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


def shm_mappings(pid: int) -> int:
    """Number of mappings of ``/dev/shm`` files in ``pid`` (0 if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return sum(" /dev/shm/" in line for line in text.splitlines())


def live_leases(socket: str) -> int | None:
    """Sum of ``lease_count`` over the daemon's models (``ListModels``); None on failure."""
    try:
        with grpc.insecure_channel("unix:" + os.path.abspath(socket)) as channel:
            stub = pb_grpc.WeightCacheServiceStub(channel)
            reply = stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT)
    except grpc.RpcError:
        return None
    return int(sum(m.lease_count for m in reply.models))


@dataclass(frozen=True)
class Sample:
    """One reading. Memory in bytes; ``t`` in seconds since the measured run began (None
    before it)."""

    label: str
    t: float | None
    rss: int
    anon: int
    shmem: int
    fds: int
    threads: int
    leases: int | None
    shm_bytes: int
    shm_files: int
    acquired: int
    w_anon: int
    w_fds: int
    w_maps: int


class Sampler:
    """Takes :class:`Sample` readings of the daemon (and of the workers, when given)."""

    def __init__(self, daemon: Any, log_path: Path) -> None:
        self.daemon = daemon
        self.log_path = log_path
        self.samples: list[Sample] = []
        self.t0: float | None = None
        self._log_offset = 0
        self._acquired = 0

    def acquired(self) -> int:
        """``acquired`` lines in the daemon log so far (read incrementally)."""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_offset)
            chunk = log.read()
        complete = chunk.rfind(b"\n") + 1
        self._log_offset += complete
        self._acquired += len(re.findall(rb"\] acquired ", chunk[:complete]))
        return self._acquired

    def take(self, label: str, workers: list[WorkerProcess]) -> Sample:
        """Read everything now; append and return the sample."""
        pid = self.daemon.pid
        status = proc_status(pid)
        fds = open_fds(pid)  # before our own ListModels connection
        leases = live_leases(self.daemon.socket)
        shm_bytes = shm_files = 0
        for path in self.daemon.segments():
            try:
                shm_bytes += os.stat(path).st_blocks * 512
                shm_files += 1
            except FileNotFoundError:
                pass
        w_pids = [w.proc.pid for w in workers if w.proc.poll() is None]
        sample = Sample(
            label=label,
            t=None if self.t0 is None else time.monotonic() - self.t0,
            rss=status.get("VmRSS", 0) * 1024,
            anon=status.get("RssAnon", 0) * 1024,
            shmem=status.get("RssShmem", 0) * 1024,
            fds=fds,
            threads=status.get("Threads", 0),
            leases=leases,
            shm_bytes=shm_bytes,
            shm_files=shm_files,
            acquired=self.acquired(),
            w_anon=sum(proc_status(p).get("RssAnon", 0) * 1024 for p in w_pids),
            w_fds=sum(open_fds(p) for p in w_pids),
            w_maps=sum(shm_mappings(p) for p in w_pids),
        )
        self.samples.append(sample)
        print_row(sample, flush=True)
        return sample


def mib(value: int, decimals: int = 1) -> str:
    """Bytes as MiB with ``decimals`` decimals."""
    return f"{value / 2**20:.{decimals}f}"


HEADER = (
    f"  {'sample':<9}{'t s':>6}{'rss':>9}{'anon':>9}{'shmem':>7}{'fds':>5}{'thr':>5}"
    f"{'leases':>7}{'shm':>7}{'segs':>5}{'acquired':>10}   {'w.anon':>8}{'w.fds':>6}{'w.maps':>7}"
)


def print_row(s: Sample, flush: bool = False) -> None:
    """One sample as a table row (memory in MiB)."""
    leases = "?" if s.leases is None else str(s.leases)
    t = "-" if s.t is None else f"{s.t:.0f}"
    print(
        f"  {s.label:<9}{t:>6}{mib(s.rss, 2):>9}{mib(s.anon, 2):>9}{mib(s.shmem):>7}"
        f"{s.fds:>5}{s.threads:>5}{leases:>7}{mib(s.shm_bytes):>7}{s.shm_files:>5}"
        f"{s.acquired:>10}   {mib(s.w_anon):>8}{s.w_fds:>6}{s.w_maps:>7}",
        flush=flush,
    )


def print_halves(samples: list[Sample], start: Sample, end: Sample) -> None:
    """The daemon's VmRSS and RssAnon change over each half of the measured run (split at
    the ``run`` sample nearest its middle): growth that goes on, versus a settling."""
    runs = [s for s in samples if s.label == "run" and s.t is not None]
    if not runs or end.t is None:
        return
    half = end.t / 2
    middle = min(runs, key=lambda s: abs((s.t or 0.0) - half))

    def change(field: str) -> str:
        first = getattr(middle, field) - getattr(start, field)
        second = getattr(end, field) - getattr(middle, field)
        return f"{first / 1024:+.0f} KiB, then {second / 1024:+.0f} KiB"

    print(f"  halves of the run (start -> t={middle.t:.0f} s -> end, daemon):")
    print(f"    VmRSS    {change('rss')}")
    print(f"    RssAnon  {change('anon')}")


def print_delta(a: Sample, b: Sample) -> None:
    """The daemon's changes from sample ``a`` to sample ``b`` (memory in MiB and KiB)."""

    def mem(x: int, y: int) -> str:
        return f"{mib(x)} -> {mib(y)} MiB ({(y - x) / 1024:+.0f} KiB)"

    leases = f"{a.leases} -> {b.leases}"
    print(f"  {a.label} -> {b.label} (daemon):")
    print(f"    VmRSS    {mem(a.rss, b.rss)}")
    print(f"    RssAnon  {mem(a.anon, b.anon)}")
    print(f"    RssShmem {mem(a.shmem, b.shmem)}")
    print(f"    fds      {a.fds} -> {b.fds} ({b.fds - a.fds:+d})")
    print(f"    threads  {a.threads} -> {b.threads} ({b.threads - a.threads:+d})")
    print(f"    leases   {leases}")
    print(
        f"    /dev/shm {mem(a.shm_bytes, b.shm_bytes)}, {a.shm_files} -> {b.shm_files} segment(s)"
    )


@dataclass
class Totals(Counts):
    """Sums over the workers of one phase's reports."""

    per_worker: list[int] = field(default_factory=list)

    def add(self, report: dict[str, Any]) -> None:
        """Add one worker's phase report."""
        self.cycles += report["cycles"]
        self.mismatches += report["mismatches"]
        self.errors.update(report["errors"])
        self.messages.extend(report["messages"][: KEPT_MESSAGES - len(self.messages)])
        self.max_cycle = max(self.max_cycle, report["max_cycle"])
        self.per_worker.append(report["cycles"])


def run_phase(workers: list[WorkerProcess], seconds: float, tick: Any) -> Totals:
    """``go`` to every worker, wait ``seconds`` (calling ``tick(now)`` every second),
    ``stop``, and collect the reports.

    Raises:
        SoakError: a worker died or did not report within :data:`STOP_TIMEOUT` seconds.
    """
    for w in workers:
        w.send("go")
    deadline = time.monotonic() + seconds
    while (now := time.monotonic()) < deadline:
        dead = [w.index for w in workers if w.proc.poll() is not None]
        if dead:
            raise SoakError(
                f"worker(s) {dead} exited during the run; log of the first:\n"
                f"{workers[dead[0]].log_tail()}"
            )
        tick(now)
        time.sleep(min(1.0, max(0.0, deadline - now)))
    for w in workers:
        w.send("stop")
    totals = Totals()
    for w in workers:
        totals.add(w.expect("phase", STOP_TIMEOUT))
    return totals


def expected_checksums(folder: Path) -> dict[str, int]:
    """Checksum of every tensor, read from the safetensors files with ``safetensors``."""
    from safetensors import safe_open

    sums: dict[str, int] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sums[name] = checksum(shard.get_tensor(name))
    return sums


def print_setup(args: argparse.Namespace, specs: list[Any], folder: Path) -> None:
    """Machine, checkpoint and method, before the measurements."""
    from attach_vs_disk import print_header

    title = "weightcache soak: one daemon, workers cycling attach -> checksum -> release"
    print_header(title, specs, args.shards, folder, "MiB")
    print(
        f"  workers: {args.workers}, each cycling load(zero_copy) -> checksum of "
        f"{CHECKED_PER_CYCLE} tensors -> close()"
    )
    print(
        f"  warm-up {args.warmup:.0f} s, then {args.seconds:.0f} s measured, "
        f"sampled every {args.sample_every:.0f} s"
    )


def print_legend() -> None:
    """What the columns mean."""
    print("  columns: daemon VmRSS, RssAnon, RssShmem (MiB), open fds, threads, live leases,")
    print("  /dev/shm MiB allocated to its segments and their number, leases granted so far")
    print("  (acquired lines in its log); w.*: all workers summed, RssAnon MiB, open fds,")
    print("  mappings of /dev/shm files. baseline: daemon alone; start/end: workers alive")
    print("  and idle; run: workers cycling; exited: workers gone.")


def run_soak(args: argparse.Namespace, tmp: Path) -> bool:
    """Steps 1-7 of the module docstring; returns whether every check passed."""
    import attach_vs_disk as avd

    folder, specs = avd.new_checkpoint(tmp, args.tensors, int(args.size_mib * 2**20), args.seed)
    print_setup(args, specs, folder)
    avd.write_checkpoint(folder, specs, args.shards, args.seed)
    expected = expected_checksums(folder)
    (tmp / "expected.json").write_text(json.dumps(expected))
    print("  ", end="")
    with avd.preloaded(folder, tmp, timeout=300) as daemon:
        passed = soak(args, tmp, folder, daemon)
    return passed


def soak(args: argparse.Namespace, tmp: Path, folder: Path, daemon: Daemon) -> bool:
    """Steps 3-6 of the module docstring, with ``daemon`` ready; whether every check passed."""
    sampler = Sampler(daemon, daemon.log_path)
    print()
    print_legend()
    print(HEADER)
    baseline = sampler.take("baseline", [])

    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(folder)]
    command += ["--socket", daemon.socket, "--expected", str(tmp / "expected.json")]
    workers: list[WorkerProcess] = []
    try:
        for i in range(args.workers):
            workers.append(WorkerProcess(i, command, tmp / f"worker-{i}.log"))
        for w in workers:
            w.expect("ready", START_TIMEOUT)
        warm = run_phase(workers, args.warmup, lambda now: None)
        sampler.t0 = time.monotonic()
        start = sampler.take("start", workers)
        next_sample = sampler.t0 + args.sample_every

        def tick(now: float) -> None:
            nonlocal next_sample
            if now >= next_sample:
                sampler.take("run", workers)
                next_sample += args.sample_every

        began = time.monotonic()
        run = run_phase(workers, args.seconds, tick)
        elapsed = time.monotonic() - began
        end = sampler.take("end", workers)
    finally:
        statuses = stop_workers(workers)
    time.sleep(SETTLE_SECONDS)
    exited = sampler.take("exited", [])
    print()
    print_delta(start, end)
    print_halves(sampler.samples, start, end)
    print_delta(baseline, exited)
    return print_verdict(warm, run, elapsed, statuses, (end, exited))


def print_verdict(
    warm: Totals,
    run: Totals,
    elapsed: float,
    statuses: list[int],
    after: tuple[Sample, Sample],
) -> bool:
    """Cycles, errors and mismatches; returns whether every check passed."""
    print()
    print(
        f"  warm-up: {warm.cycles} cycles, errors {dict(warm.errors) or 0}, "
        f"mismatches {warm.mismatches}"
    )
    rate = run.cycles / elapsed if elapsed else 0.0
    per = run.per_worker
    print(
        f"  measured: {run.cycles} cycles in {elapsed:.1f} s = {rate:.1f} cycles/s "
        f"(per worker min {min(per, default=0)}, max {max(per, default=0)}; "
        f"slowest cycle {run.max_cycle * 1e3:.0f} ms)"
    )
    print(f"  errors: {sum(run.errors.values())} {dict(run.errors) or ''}".rstrip())
    for message in [*warm.messages, *run.messages][:KEPT_MESSAGES]:
        print(f"    e.g. {message}")
    print(
        f"  mismatches: {run.mismatches} (checksums of {run.cycles * CHECKED_PER_CYCLE} "
        f"tensor reads compared with the disk's)"
    )
    bad_exit = [i for i, status in enumerate(statuses) if status != 0]
    problems = []
    if warm.mismatches or run.mismatches:
        problems.append("mismatches")
    if warm.errors or run.errors:
        problems.append("errors")
    if bad_exit:
        problems.append(f"worker(s) {bad_exit} exited non-zero")
    for sample in after:
        if sample.leases != 0:
            problems.append(f"{sample.leases} lease(s) at {sample.label}")
    print(f"  checks: {'FAILED: ' + ', '.join(problems) if problems else 'passed'}")
    return not problems


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=16, help="worker processes")
    parser.add_argument("--seconds", type=float, default=600.0, help="measured run, seconds")
    parser.add_argument("--size-mib", type=float, default=64.0, help="checkpoint size, MiB")
    parser.add_argument("--tensors", type=int, default=36, help="number of tensors")
    parser.add_argument("--shards", type=int, default=2, help="number of shard files")
    parser.add_argument("--sample-every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=30.0, help="warm-up, seconds")
    parser.add_argument("--seed", type=int, default=0, help="seed of shapes and values")
    # Internal: run as one worker.
    parser.add_argument("--worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--expected", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.workers, args.tensors, args.shards) < 1:
        parser.error("--workers, --tensors and --shards must be positive")
    if min(args.seconds, args.size_mib, args.sample_every) <= 0 or args.warmup < 0:
        parser.error("--seconds, --size-mib and --sample-every must be positive")
    if args.shards > args.tensors:
        parser.error("--shards must not exceed --tensors")
    return args


def main() -> int:
    """Run the soak (or, with ``--worker``, one worker); returns the exit status."""
    args = parse_args()
    if args.worker:
        return worker_main(args.worker, args.socket, args.expected)
    from attach_vs_disk import run_script  # bench/ is sys.path[0] when this runs as a script

    ok = run_script("wcsoak-", functools.partial(run_soak, args), (SoakError,))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
