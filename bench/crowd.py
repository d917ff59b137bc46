"""Many workers attaching at once: load latency percentiles of a crowd, attach vs load_file.

Run with ``.venv/bin/python bench/crowd.py [--workers 64] [--rounds 3] [options]``.

1. generate a sharded safetensors checkpoint (``--size-mib``, default 256, of ``--tensors``,
   default 300, in ``--shards``, default 4; the generator of ``attach_vs_disk.py``) in a
   temporary folder under /tmp;
2. start ``weightcache preload`` on it, on its own socket, and wait until it is ready
   (``attach_vs_disk.preloaded``);
3. ``--rounds`` times, alternately, a crowd of ``--workers`` fresh processes per mode of
   ``--modes`` (default ``attach,load_file``, in that order, so that drift hits both):

   - each worker (this script with ``--worker``) imports torch, safetensors and
     ``weightcache``, resolves ``weightcache.load`` (a lazy attribute), reports ``ready``
     with its VmRSS/RssAnon on stdout, and blocks in ``read()`` on the read end of one pipe
     that all the crowd's workers inherited;
   - once all are ready, the parent closes the pipe's only write end: the start signal.
     Every blocked ``read()`` returns end-of-file at once (the kernel wakes all readers of
     the pipe together), so no worker is told before another; what skew is left is the
     scheduler's, measured as each worker's wake time (CLOCK_MONOTONIC, common to all
     processes) minus the parent's, the ``wake`` columns;
   - each worker times (``perf_counter``, and its CPU time with ``process_time``, all its
     threads) ``weightcache.load(dir, socket=S, fallback=False)`` (``attach``) or
     ``safetensors.torch.load_file`` of every shard (``load_file``), then the first byte of
     every tensor (``attach_worker.touch``), or, in mode ``rpc``, opens a gRPC channel to the
     daemon and makes one ``ListModels`` call (``attach_worker.ask_daemon``: the floor under
     attach's Acquire); reports seconds, CPU seconds, source and tensor
     count; then holds its weights until every worker of the crowd has reported (stdin
     closed), and only then releases them (``close()``, not timed) and exits;
4. print, per mode, p50/p90/p99/max of the load times over all workers of all rounds, the
   baseline's p99 over attach's, the time from the start signal to the last worker done,
   the CPU milliseconds per load (the worker's own and the daemon's share, from
   ``/proc/PID/task/*/schedstat``), and per round p50/p99/max;
5. stop the daemon (SIGTERM), check that it left no socket and no segment, remove the
   folder; on failure, SIGTERM and Ctrl-C the workers are killed and the same happens.

Exit status 1 when a load did not come from the cache (``attach``) or disk (``load_file``),
saw the wrong number of tensors, or a worker failed. On a machine with fewer cores than
workers the percentiles are dominated by CPU queueing: read them with the CPU-ms line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import selectors
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# bench/ is sys.path[0] when this file runs as a script.
from attach_vs_disk import (
    BenchError,
    generate,
    new_checkpoint,
    preloaded,
    print_header,
    run_script,
)
from attach_worker import ask_daemon, shards, touch

MODES = ("attach", "load_file", "rpc")
#: What ``--modes`` runs unless told otherwise.
DEFAULT_MODES = ("attach", "load_file")
TIMED = {
    "attach": "weightcache.load(dir, socket=S, fallback=False) [zero_copy]"
    " + first byte of every tensor",
    "load_file": "safetensors.torch.load_file(shard) of every shard + first byte of every tensor",
    "rpc": "a new gRPC channel to the daemon and one ListModels call: what any first load"
    " that asks the daemon pays in a fresh process, the floor under attach",
}
SOURCES = {"attach": "cache", "load_file": "disk", "rpc": "none"}
#: Seconds a crowd may take to start (64 processes importing torch on 2 CPUs: about a minute).
READY_TIMEOUT = 900.0
#: Seconds a crowd may take from the start signal to the last report.
RUN_TIMEOUT = 600.0
#: Memory a worker needs, for the check before the run: RssAnon after its imports was about
#: 155 MiB on the machine of bench/README.md, plus what a load adds; rounded up.
WORKER_MIB = 250


# ---------------------------------------------------------------------------- worker side


def status_kib(*keys: str) -> dict[str, int]:
    """The named ``kB`` lines of ``/proc/self/status``, in KiB."""
    text = Path("/proc/self/status").read_text()
    found = dict(re.findall(r"^(\w+):\s+(\d+) kB$", text, re.MULTILINE))
    return {key: int(found[key]) for key in keys}


def emit(message: dict[str, Any]) -> None:
    """One JSON line to stdout, flushed."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def worker_main(mode: str, model_dir: str, socket: str, start_fd: int) -> int:
    """One worker of a crowd (step 3 of the module docstring); returns its exit status."""
    import grpc
    import safetensors.torch
    import torch

    import weightcache

    load = weightcache.load  # a lazy attribute: resolved before the start signal
    load_file = safetensors.torch.load_file
    files = shards(model_dir)
    emit({"event": "ready", **status_kib("VmRSS", "RssAnon")})
    os.read(start_fd, 1)  # blocks until the parent closes the write end: end-of-file
    woke = time.monotonic()
    cpu = time.process_time()
    start = time.perf_counter()
    weights: weightcache.LoadedWeights | None = None
    channel: grpc.Channel | None = None
    tensors: dict[str, torch.Tensor] = {}
    listed = 0  # rpc: the tensors the daemon lists
    source: str
    if mode == "attach":
        weights = load(model_dir, socket=socket, fallback=False)
        tensors = weights.tensors
        source = weights.source
    elif mode == "rpc":
        # Kept open, as attach keeps its channel: closed with the weights, not timed.
        channel, listed = ask_daemon(socket)
        source = "none"
    else:
        for path in files:
            tensors.update(load_file(path))
        source = "disk"
    touched = touch(tensors)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu
    done = time.monotonic()
    emit(
        {
            "event": "done",
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "woke": woke,
            "done": done,
            "source": source,
            "tensors": listed if mode == "rpc" else len(tensors),
            "touched": touched,
            **status_kib("VmRSS", "RssAnon"),
        }
    )
    sys.stdin.read()  # hold the weights until the whole crowd has reported
    if weights is not None:
        weights.close()
    if channel is not None:
        channel.close()
    del tensors
    assert torch is not None  # imported for its import cost and RSS, as a real worker
    return 0


# ---------------------------------------------------------------------------- parent side


@dataclass
class Worker:
    """One worker process: its stdout read line by line into JSON messages."""

    index: int
    proc: subprocess.Popen[bytes]
    log: Path
    buffer: bytes = b""
    messages: list[dict[str, Any]] = field(default_factory=list)
    eof: bool = False

    def log_tail(self, chars: int = 3000) -> str:
        """The end of its stderr log."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


class Crowd:
    """``count`` workers of one mode, started together by closing one pipe.

    Use as a context manager: on exit, every worker still running is killed.
    """

    def __init__(self, mode: str, count: int, model: Path, socket: str, tmp: Path) -> None:
        self.mode = mode
        self.workers: list[Worker] = []
        self.selector = selectors.DefaultSelector()
        read_end, self.write_end = os.pipe()  # both not inheritable; pass_fds passes one
        try:
            for index in range(count):
                log = tmp / f"{mode}-{index}.log"
                command = [sys.executable, __file__, "--worker", mode, str(model), socket]
                command.append(str(read_end))
                with open(log, "wb") as stderr:
                    proc = subprocess.Popen(
                        command,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=stderr,
                        pass_fds=(read_end,),
                        start_new_session=True,  # Ctrl-C reaches the parent, which kills them
                    )
                worker = Worker(index, proc, log)
                self.workers.append(worker)
                assert proc.stdout is not None
                os.set_blocking(proc.stdout.fileno(), False)
                self.selector.register(proc.stdout.fileno(), selectors.EVENT_READ, worker)
        except BaseException:
            self.__exit__()
            raise
        finally:
            os.close(read_end)  # the workers hold it now; the parent keeps only the write end

    def __enter__(self) -> Crowd:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.write_end >= 0:
            os.close(self.write_end)
            self.write_end = -1
        for worker in self.workers:
            if worker.proc.poll() is None:
                worker.proc.kill()
        for worker in self.workers:
            worker.proc.wait()
            for stream in (worker.proc.stdin, worker.proc.stdout):
                if stream is not None:
                    stream.close()
        self.selector.close()

    def collect(self, event: str, timeout: float) -> list[dict[str, Any]]:
        """Wait until every worker has sent its ``event`` message; returns them in worker
        order.

        Raises:
            BenchError: a worker exited or sent something else first, or ``timeout``
                seconds passed.
        """
        deadline = time.monotonic() + timeout
        got: dict[int, dict[str, Any]] = {}

        def take(worker: Worker) -> None:
            while worker.messages and worker.index not in got:
                message = worker.messages.pop(0)
                if message.get("event") != event:
                    raise BenchError(f"{self.mode} worker {worker.index}: {message}")
                got[worker.index] = message

        for each in self.workers:
            take(each)
        while len(got) < len(self.workers):
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(
                    f"{self.mode}: {len(self.workers) - len(got)} worker(s) sent no "
                    f"{event!r} within {timeout:.0f} s"
                )
            for key, _ in self.selector.select(left):
                worker: Worker = key.data
                self._read(worker)
                take(worker)
                if worker.eof and worker.index not in got:
                    code = worker.proc.wait()
                    raise BenchError(
                        f"{self.mode} worker {worker.index} exited {code} before {event!r}:\n"
                        f"{worker.log_tail()}"
                    )
        return [got[index] for index in range(len(self.workers))]

    def _read(self, worker: Worker) -> None:
        assert worker.proc.stdout is not None
        fd = worker.proc.stdout.fileno()
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            worker.eof = True
            self.selector.unregister(fd)
            return
        worker.buffer += chunk
        *lines, worker.buffer = worker.buffer.split(b"\n")
        worker.messages += [json.loads(line) for line in lines if line.strip()]

    def fire(self) -> float:
        """The start signal: close the pipe's write end; returns the time (monotonic)."""
        now = time.monotonic()
        os.close(self.write_end)
        self.write_end = -1
        return now

    def release(self, timeout: float) -> None:
        """Close every worker's stdin (they release their weights and exit) and wait.

        Raises:
            BenchError: a worker exited non-zero or ran over ``timeout`` seconds.
        """
        for worker in self.workers:
            assert worker.proc.stdin is not None
            worker.proc.stdin.close()
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            try:
                code = worker.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise BenchError(f"{self.mode} worker {worker.index} did not exit") from None
            if code != 0:
                raise BenchError(
                    f"{self.mode} worker {worker.index} exited {code}:\n{worker.log_tail()}"
                )


def cpu_seconds_of(pid: int) -> float:
    """CPU seconds of process ``pid`` so far: the sum over its live threads of the time on
    a CPU in ``/proc/PID/task/TID/schedstat`` (nanoseconds; ``/proc/PID/stat`` counts in
    clock ticks, 10 ms here, too coarse for one load). A thread that exited in between
    is not counted: the daemon's are a fixed pool."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # the thread exited while we looked
    return total / 1e9


def mem_available_mib() -> float:
    """``MemAvailable`` of ``/proc/meminfo``, MiB."""
    match = re.search(r"^MemAvailable:\s+(\d+) kB$", Path("/proc/meminfo").read_text(), re.M)
    return int(match.group(1)) / 1024 if match else 0.0


@dataclass
class CrowdResult:
    """What one crowd measured."""

    mode: str
    round: int
    seconds: list[float]
    cpu_seconds: list[float]
    wake: list[float]  # each worker's wake minus the start signal, seconds
    last_done: float  # the last worker's done minus the start signal, seconds
    daemon_cpu: float  # daemon CPU seconds from just before the signal to the last report
    ready_rss_kib: list[int]
    ready_anon_kib: list[int]
    done_anon_kib: list[int]
    load_avg: str


def run_crowd(
    mode: str, round_: int, *, args: argparse.Namespace, model: Path, daemon_pid: int,
    socket: str, tmp: Path, expected: int,
) -> CrowdResult:  # fmt: skip
    """Start a crowd of ``mode``, wait until ready, fire, collect, release.

    Raises:
        BenchError: a worker failed, loaded from the wrong source or saw the wrong count.
    """
    load_avg = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    begin = time.monotonic()
    with Crowd(mode, args.workers, model, socket, tmp) as crowd:
        ready = crowd.collect("ready", READY_TIMEOUT)
        started = time.monotonic() - begin
        time.sleep(args.settle)  # let the import stragglers' exit from read() settle
        loadavg = Path("/proc/loadavg").read_text().split()
        daemon_before = cpu_seconds_of(daemon_pid)
        fired = crowd.fire()
        done = crowd.collect("done", RUN_TIMEOUT)
        daemon_cpu = cpu_seconds_of(daemon_pid) - daemon_before
        crowd.release(RUN_TIMEOUT)
    want = SOURCES[mode]
    for index, result in enumerate(done):
        if result["source"] != want or result["tensors"] != expected:
            raise BenchError(
                f"{mode} worker {index}: expected {expected} tensors from {want}: {result}"
            )
    print(
        f"  round {round_} {mode:<9} {args.workers} workers ready after {started:.1f} s "
        f"(load average before: {load_avg}); at the signal: {loadavg[3].split('/')[0]} "
        f"runnable, load average {loadavg[0]}; "
        f"last done {max(r['done'] for r in done) - fired:.3f} s after it",
        flush=True,
    )
    return CrowdResult(
        mode=mode,
        round=round_,
        seconds=[r["seconds"] for r in done],
        cpu_seconds=[r["cpu_seconds"] for r in done],
        wake=[r["woke"] - fired for r in done],
        last_done=max(r["done"] for r in done) - fired,
        daemon_cpu=daemon_cpu,
        ready_rss_kib=[r["VmRSS"] for r in ready],
        ready_anon_kib=[r["RssAnon"] for r in ready],
        done_anon_kib=[r["RssAnon"] for r in done],
        load_avg=load_avg,
    )


def percentiles(values: list[float]) -> tuple[float, float, float, float]:
    """p50, p90, p99 and max (linear interpolation between order statistics)."""
    if len(values) == 1:
        return values[0], values[0], values[0], values[0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[49], cuts[89], cuts[98], max(values)


def ms(value: float) -> str:
    """Seconds as milliseconds, one decimal."""
    return f"{value * 1e3:.1f}"


def print_results(results: list[CrowdResult], args: argparse.Namespace) -> None:
    """The tables of step 4."""
    by_mode = {mode: [r for r in results if r.mode == mode] for mode in args.modes}
    samples = {mode: [s for r in rs for s in r.seconds] for mode, rs in by_mode.items()}
    print()
    print(
        f"  load time, ms, over all workers of all rounds "
        f"({args.workers} workers x {args.rounds} rounds = {args.workers * args.rounds} "
        "per mode):"
    )
    print(f"  {'mode':<11}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}{'min':>9}")
    p99 = {}
    for mode in args.modes:
        p50, p90, p99[mode], top = percentiles(samples[mode])
        print(
            f"  {mode:<11}{ms(p50):>9}{ms(p90):>9}{ms(p99[mode]):>9}{ms(top):>9}"
            f"{ms(min(samples[mode])):>9}"
        )
    if "attach" in p99:
        for mode in (m for m in args.modes if m != "attach"):
            print(f"  {mode} p99 / attach p99: {p99[mode] / p99['attach']:.2f}x")
        print("  (above 1: attach faster)")
    print()
    print("  per round, ms: p50 / p99 / max of the crowd; last done after the signal;")
    print("  wake: when the workers returned from read() after the signal, p50 / max")
    for result in results:
        p50, _, p99r, top = percentiles(result.seconds)
        wake50, _, _, wake_max = percentiles(result.wake)
        print(
            f"    round {result.round} {result.mode:<10} {ms(p50):>7} / {ms(p99r):>7} / "
            f"{ms(top):>7}   last done {ms(result.last_done):>7}   "
            f"wake {ms(wake50):>6} / {ms(wake_max):>6}"
        )
    print()
    print("  CPU per load, ms (worker: process_time around the timed part, all its threads;")
    print("  daemon: its CPU from the signal to the last report, over the crowd's loads):")
    for mode in args.modes:
        cpu = [c for r in by_mode[mode] for c in r.cpu_seconds]
        daemon = sum(r.daemon_cpu for r in by_mode[mode]) / len(samples[mode])
        print(
            f"    {mode:<10} worker median {ms(statistics.median(cpu))}, min {ms(min(cpu))}, "
            f"max {ms(max(cpu))}; daemon {ms(daemon)} per load"
        )
    ready_rss = [k for r in results for k in r.ready_rss_kib]
    ready_anon = [k for r in results for k in r.ready_anon_kib]
    print()
    print(
        "  worker memory after its imports: "
        f"VmRSS median {statistics.median(ready_rss) / 1024:.0f} MiB, "
        f"RssAnon median {statistics.median(ready_anon) / 1024:.0f} MiB "
        f"(max {max(ready_anon) / 1024:.0f})"
    )
    for mode in args.modes:
        anon = [k for r in by_mode[mode] for k in r.done_anon_kib]
        print(
            f"    after the load, {mode:<10} "
            f"RssAnon median {statistics.median(anon) / 1024:.0f} MiB "
            f"(max {max(anon) / 1024:.0f})"
        )
    print()
    for mode in args.modes:
        print(f"  {mode:<10} {TIMED[mode]}")


def run_bench(args: argparse.Namespace, tmp: Path) -> bool:
    """Steps 1-5 of the module docstring; True when every load was right (a failure
    raises)."""
    folder, specs = new_checkpoint(tmp, args.tensors, args.size_mib * 2**20, args.seed)
    modes = " vs ".join(args.modes)
    title = f"weightcache benchmark: a crowd of workers loading at once, {modes}"
    print_header(title, specs, args.shards, folder, "MiB")
    need = args.workers * WORKER_MIB + 2 * args.size_mib + 1024
    have = mem_available_mib()
    print(
        f"  crowd: {args.workers} fresh processes per mode and round, {args.rounds} rounds, "
        f"modes alternating ({', '.join(args.modes)})"
    )
    print("  start signal: all block in read() on one pipe; the parent closes its write end")
    print(f"  memory: {have / 1024:.1f} GiB available, {need / 1024:.1f} GiB asked for")
    if have < need and not args.no_memory_check:
        raise BenchError(
            f"{args.workers} workers need about {need / 1024:.1f} GiB, "
            f"{have / 1024:.1f} GiB available (--no-memory-check to try anyway)"
        )
    generate(folder, specs, argparse.Namespace(shards=args.shards, seed=args.seed))
    results: list[CrowdResult] = []
    with preloaded(folder, tmp, timeout=900) as daemon:
        for round_ in range(1, args.rounds + 1):
            for mode in args.modes:
                results.append(
                    run_crowd(
                        mode,
                        round_,
                        args=args,
                        model=folder,
                        daemon_pid=daemon.pid,
                        socket=daemon.socket,
                        tmp=tmp,
                        expected=len(specs),
                    )
                )
    print_results(results, args)
    return True


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=64, help="processes per crowd")
    parser.add_argument("--rounds", type=int, default=3, help="crowds per mode, alternating")
    parser.add_argument("--size-mib", type=int, default=256, help="checkpoint size, MiB")
    parser.add_argument("--tensors", type=int, default=300, help="number of tensors")
    parser.add_argument("--shards", type=int, default=4, help="number of shard files")
    parser.add_argument("--seed", type=int, default=0, help="seed of shapes and values")
    parser.add_argument(
        "--settle", type=float, default=1.0, help="seconds between all ready and the signal"
    )
    parser.add_argument(
        "--no-memory-check", action="store_true", help="start even if memory looks short"
    )
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated, run in this order each round, of: {', '.join(MODES)}",
    )
    args = parser.parse_args()
    args.modes = tuple(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
    if not args.modes or not set(args.modes) <= set(MODES):
        parser.error(f"--modes takes a comma-separated list of {', '.join(MODES)}")
    if min(args.workers, args.rounds, args.size_mib, args.tensors, args.shards) < 1:
        parser.error("--workers, --rounds, --size-mib, --tensors and --shards must be positive")
    if args.shards > args.tensors:
        parser.error("--shards must not exceed --tensors")
    return args


def main() -> int:
    """Run the benchmark (or, with ``--worker``, one worker); returns the exit status."""
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        mode, model, socket, fd = sys.argv[2:]
        return worker_main(mode, model, socket, int(fd))
    args = parse_args()
    ok = run_script("wccrowd-", functools.partial(run_bench, args), (BenchError,))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
