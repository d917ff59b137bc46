"""Preload speed: ``weightcache preload`` of a checkpoint vs ``cp`` of its shards into /dev/shm.

Run with ``.venv/bin/python bench/preload_vs_cp.py [options]``.

1. generate a sharded safetensors checkpoint in a temporary folder under /tmp (the same
   generator as attach_vs_disk.py: ``--size-gib``, ``--tensors``, ``--shards``);
2. ``--repeat`` times, interleaved: ``cp`` the shard files into a fresh folder in /dev/shm
   (timed around the ``cp`` process, then removed), and start a daemon preloading the
   checkpoint (timed by the model's own ``load_duration``: arena allocation, reading every
   tensor into it and the final ``check_unchanged``; interpreter start, imports and the
   fingerprint are not in it), then stop it;
3. print median, min and max of each and ``cp`` median / preload median (>= 1: preload is
   at least as fast as ``cp``), and per preload the daemon's peak RSS (``VmHWM``, which
   counts the arena's pages only where the daemon itself touched them through its
   mapping) next to the arena's size.

``--first-preload`` times instead what a first preload at the default level ``full``
costs, fingerprint included: one daemon (``--allow-remote-preload``, its hash cache in a
folder of its own, emptied before every run) is asked for the checkpoint by a remote
``Preload`` timed from the request to its last message, then the model is evicted. Each
run also times the sha256 of every shard alone (``hash``: the daemon's own hashing,
``weightcache_service.hashing.ShardHashes``, one thread a shard and at most one a core,
into an empty hash cache), and the CPU seconds of ``cp`` and of the hash. A first preload
must hash every byte and copy every byte, so it takes at least the hash alone and at
least the CPU of both spread over the cores: ``cp`` / that floor is printed as the most
that ``cp`` / first preload can reach on the machine.

The page cache is warm by default (the files were just written). ``--drop-caches`` (root
with a writable /proc/sys) drops it before every run; ``--evict`` instead asks the kernel
to drop the shard files' clean pages (``posix_fadvise(POSIX_FADV_DONTNEED)`` after
``fsync``), which needs no privilege but is advisory.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

# bench/ is sys.path[0] when this file runs as a script.
from attach_vs_disk import (
    BenchError,
    drop_caches,
    fmt_seconds,
    machine_line,
    plan_tensors,
    run_script,
    write_checkpoint,
)

from weightcache.core.checkpoint import open_checkpoint
from weightcache.core.rpc import target
from weightcache.testing import run_daemon
from weightcache.testing.daemon import list_models
from weightcache.v1 import weight_cache_service_pb2 as pb
from weightcache.v1 import weight_cache_service_pb2_grpc as pb_grpc
from weightcache_service.hashing import ShardHashes

#: Where fd_sha256 keeps digests (weightcache.core.hashcache.cache_dir).
HASH_CACHE_ENV = "WEIGHTCACHE_HASH_CACHE"


def shard_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files, sorted."""
    return sorted(folder.glob("*.safetensors"))


def evict(files: list[Path]) -> None:
    """Ask the kernel to drop the clean cached pages of ``files`` (advisory)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_cp(files: list[Path]) -> tuple[float, float]:
    """Seconds of one ``cp`` of ``files`` into a fresh folder under /dev/shm (removed
    after), and the CPU seconds it took (user + system, from ``RUSAGE_CHILDREN``).

    Raises:
        BenchError: cp failed.
    """
    target = Path(tempfile.mkdtemp(prefix="wcbench-cp-", dir="/dev/shm"))
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        begin = time.monotonic()
        command = ["cp", *map(str, files), str(target)]
        done = subprocess.run(command, capture_output=True, check=False)
        seconds = time.monotonic() - begin
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise BenchError(f"cp exited {done.returncode}: {done.stderr.decode()}")
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        return seconds, cpu
    finally:
        shutil.rmtree(target, ignore_errors=True)


def time_hash(folder: Path, tmp: Path) -> tuple[float, float]:
    """Seconds the daemon's own hashing of a first preload takes over the checkpoint in
    ``folder`` alone (``ShardHashes``: one thread a shard, at most one a core), into an
    empty hash cache under ``tmp``, and the CPU seconds it took (this process's, all
    threads). Opening the checkpoint is not timed."""
    cache = Path(tempfile.mkdtemp(prefix="hashes-", dir=tmp))
    before = os.environ.get(HASH_CACHE_ENV)
    os.environ[HASH_CACHE_ENV] = str(cache)  # where fd_sha256 looks and stores
    try:
        with open_checkpoint(folder) as checkpoint:
            cpu = time.process_time()
            begin = time.monotonic()
            hashes = ShardHashes(checkpoint)
            try:
                hashes.result()
            finally:
                hashes.stop()
            return time.monotonic() - begin, time.process_time() - cpu
    finally:
        if before is None:
            del os.environ[HASH_CACHE_ENV]
        else:
            os.environ[HASH_CACHE_ENV] = before
        shutil.rmtree(cache, ignore_errors=True)


def peak_rss(pid: int) -> int:
    """``VmHWM`` of process ``pid``, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise BenchError(f"no VmHWM in /proc/{pid}/status")


def time_preload(folder: Path, tmp: Path) -> tuple[float, int, int]:
    """One daemon preloading ``folder``: the model's load seconds, the daemon's peak RSS
    in bytes and the arena's size in bytes.

    Raises:
        HarnessError: the daemon failed to start, load or stop cleanly.
        BenchError: it reported no load duration.
    """
    with run_daemon([folder], log_dir=tmp, timeout=900, new_session=True) as daemon:
        (model,) = list_models(daemon.socket)
        if not model.HasField("load_duration"):
            raise BenchError(f"model {model.name} has no load_duration")
        seconds = model.load_duration.ToTimedelta().total_seconds()
        peak = peak_rss(daemon.pid)
    return seconds, peak, model.size_bytes


class FirstPreload:
    """One daemon that preloads ``folder`` remotely at level ``full`` with an empty hash
    cache each time (:meth:`time`): a first preload, fingerprint included."""

    def __init__(self, folder: Path, tmp: Path, stack: contextlib.ExitStack) -> None:
        self.folder = folder
        self.hashes = tmp / "hash-cache"
        args = ["--allow-remote-preload", "--model-root", str(folder.parent)]
        env = {HASH_CACHE_ENV: str(self.hashes)}
        self.daemon = stack.enter_context(
            run_daemon(args=args, log_dir=tmp, env=env, timeout=900, new_session=True)
        )
        self.channel = stack.enter_context(grpc.insecure_channel(target(self.daemon.socket)))
        self.stub = pb_grpc.WeightCacheServiceStub(self.channel)

    def time(self) -> tuple[float, int, int]:
        """Seconds from the Preload request to its last message, the daemon's peak RSS in
        bytes so far and the arena's size in bytes; the model is evicted after.

        Raises:
            BenchError: the model did not end READY.
        """
        shutil.rmtree(self.hashes, ignore_errors=True)
        request = pb.PreloadRequest(
            path=str(self.folder), fingerprint_level=pb.FINGERPRINT_LEVEL_FULL
        )
        begin = time.monotonic()
        *_, last = self.stub.Preload(request, timeout=900)
        seconds = time.monotonic() - begin
        if last.state != pb.MODEL_STATE_READY:
            raise BenchError(f"model {last.model} ended {pb.ModelState.Name(last.state)}")
        (model,) = list_models(self.daemon.socket)
        self.stub.Evict(pb.EvictRequest(name=last.model), timeout=60)
        return seconds, peak_rss(self.daemon.pid), model.size_bytes


def run(args: argparse.Namespace, tmp: Path) -> bool:
    """Steps 1-3 of the module docstring; True once done (a failure raises)."""
    with contextlib.ExitStack() as stack:
        return _run(args, tmp, stack)


def _run(args: argparse.Namespace, tmp: Path, stack: contextlib.ExitStack) -> bool:
    if args.drop_caches:
        drop_caches()  # fail before spending a minute generating
    folder = tmp / "checkpoint"
    folder.mkdir()
    specs = plan_tensors(args.tensors, int(args.size_gib * 2**30), args.seed)
    total = sum(s.nbytes for s in specs)
    print("weightcache benchmark: preload vs cp into /dev/shm")
    print(machine_line())
    print(f"  checkpoint: {total / 2**30:.2f} GiB, {len(specs)} tensors, {args.shards} shards")
    cache = "COLD (drop_caches)" if args.drop_caches else "WARM"
    cache = "COLD-ish (fadvise DONTNEED of the shards)" if args.evict else cache
    print(f"  page cache: {cache} before every run")
    order = "cp, hash, preload" if args.first_preload else "cp, preload"
    print(f"  runs: {args.repeat} of each, interleaved ({order}, {order}, ...)")
    if args.first_preload:
        print("  preload: a first one at level full (empty hash cache), fingerprint included")
    begin = time.monotonic()
    write_checkpoint(folder, specs, args.shards, args.seed)
    print(f"  generated in {time.monotonic() - begin:.1f} s")
    first = FirstPreload(folder, tmp, stack) if args.first_preload else None
    files = shard_files(folder)
    size = sum(f.stat().st_size for f in files)
    cp_s: list[float] = []
    hash_s: list[float] = []
    preload_s: list[float] = []
    cpu_s: dict[str, list[float]] = {"cp": [], "hash": []}
    for number in range(args.repeat):
        for what in ("cp", "hash", "preload") if first else ("cp", "preload"):
            if args.drop_caches:
                drop_caches()
            elif args.evict:
                evict(files)
            if what == "cp":
                seconds, cpu = time_cp(files)
                cp_s.append(seconds)
                cpu_s["cp"].append(cpu)
                continue
            if what == "hash":
                seconds, cpu = time_hash(folder, tmp)
                hash_s.append(seconds)
                cpu_s["hash"].append(cpu)
                continue
            seconds, peak, arena = first.time() if first else time_preload(folder, tmp)
            preload_s.append(seconds)
            hashed = f", hash {fmt_seconds(hash_s[-1])}" if hash_s else ""
            print(
                f"  run {number + 1}: cp {fmt_seconds(cp_s[-1])}{hashed}, "
                f"preload {fmt_seconds(seconds)}; daemon peak RSS {peak / 2**20:.0f} MiB "
                f"(arena {arena / 2**20:.0f} MiB)",
                flush=True,
            )
    print()
    print(f"  {'':<8}{'median':>10}{'min':>10}{'max':>10}{'GiB/s (median)':>18}")
    rows = (("cp", cp_s), ("hash", hash_s), ("preload", preload_s))
    for name, values in ((name, values) for name, values in rows if values):
        median = statistics.median(values)
        print(
            f"  {name:<8}{fmt_seconds(median):>10}{fmt_seconds(min(values)):>10}"
            f"{fmt_seconds(max(values)):>10}{size / 2**30 / median:>18.2f}"
        )
    ratio = statistics.median(cp_s) / statistics.median(preload_s)
    print(f"\n  cp / preload (medians): {ratio:.2f}x")
    if hash_s:
        print_floor(cp_s, hash_s, cpu_s)
    return True


def print_floor(cp_s: list[float], hash_s: list[float], cpu_s: dict[str, list[float]]) -> None:
    """How fast a first preload could be on this machine: it must hash every byte and
    copy every byte, so it takes at least the hash alone, and at least the CPU of both
    spread over every core."""
    cores = os.cpu_count() or 1
    cp_cpu, hash_cpu = (statistics.median(cpu_s[k]) for k in ("cp", "hash"))
    floor = max(statistics.median(hash_s), (cp_cpu + hash_cpu) / cores)
    print(
        f"  CPU (medians): cp {fmt_seconds(cp_cpu)}, hash {fmt_seconds(hash_cpu)}; "
        f"floor of a first preload: max(hash, (cp CPU + hash CPU) / {cores} cores) = "
        f"{fmt_seconds(floor)}"
    )
    print(
        f"  cp / floor: {statistics.median(cp_s) / floor:.2f}x, "
        "the most cp / first preload can reach here"
    )


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size, GiB")
    parser.add_argument("--tensors", type=int, default=300, help="number of tensors")
    parser.add_argument("--shards", type=int, default=4, help="number of shard files")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each")
    parser.add_argument("--seed", type=int, default=0, help="seed of shapes and values")
    cold = parser.add_mutually_exclusive_group()
    cold.add_argument("--drop-caches", action="store_true", help="cold disk (root only)")
    cold.add_argument("--evict", action="store_true", help="fadvise DONTNEED the shards")
    parser.add_argument(
        "--first-preload",
        action="store_true",
        help="time a remote Preload at level full with an empty hash cache, fingerprint included",
    )
    args = parser.parse_args()
    if min(args.tensors, args.shards, args.repeat) < 1 or args.size_gib <= 0:
        parser.error("--size-gib, --tensors, --shards and --repeat must be positive")
    if args.shards > args.tensors:
        parser.error("--shards must not exceed --tensors")
    return args


def main() -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args()
    ok = run_script("wcbench-", functools.partial(run, args), (BenchError,))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
