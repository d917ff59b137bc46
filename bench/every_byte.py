"""Issue 39, item 3: reading every byte of a checkpoint after an attach, against after
``safetensors.torch.load_file``, with the page faults each read takes.

Usage::

    python bench/every_byte.py [--size-gib 1] [--tensors 100] [--repeat 3] [--daemons 2]

One checkpoint (``attach_vs_disk.py``'s generator) under /tmp; ``--daemons`` fresh daemons
in turn, each preloading it; against each, ``--repeat`` rounds of the modes, interleaved,
each in a fresh process (``--worker``):

- ``attach``: ``weightcache.load`` (the shared-memory arena mapped private), then every
  byte of every tensor read (``attach_worker.read_all``);
- ``populate``: the same, but ``madvise(2)`` ``MADV_POPULATE_READ`` over the whole
  mapping before the read (timed apart: ``populate_ms``): what a worker that means to
  read everything could do (not in the SDK: it costs the same CPU as the faults, below);
- ``load_file``: ``safetensors.torch.load_file`` of every shard, then the same read.

Each worker reports the load, the read (``read_ms``), the same read again (``reread_ms``:
no fault is left, so the difference is the faults' cost), the CPU time of each
(``*_cpu_ms``, ``time.thread_time``: what a busy machine's waits leave out), the minor
and major faults of each (``getrusage``), and what its own mappings of the weights hold
(``/proc/self/smaps``: ``Rss``, ``ShmemPmdMapped``, ``FilePmdMapped``: bytes mapped by
2 MiB entries). The daemon's mapping of its arena is read from ``/proc/<daemon>/smaps``
the same way, and ``/proc/meminfo``'s ``ShmemHugePages`` says whether shared memory holds
huge pages at all.

Huge pages for ``/dev/shm`` are the host's choice (its mount's ``huge=`` option, or
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` for the kernel's own mount). To see
what they change without touching the host, run it in a mount namespace of its own whose
``/dev/shm`` allows them (as root)::

    unshare --mount --propagation private sh -c 'mount -t tmpfs \
        -o mode=1777,size=8g,huge=within_size tmpfs /dev/shm && \
        .venv/bin/python bench/every_byte.py'
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("attach", "populate", "load_file")
#: smaps fields summed over the mappings of the weights (kB).
FIELDS = ("Rss", "ShmemPmdMapped", "FilePmdMapped", "AnonHugePages")
WORKER_TIMEOUT = 300.0
#: madvise(2) advice, Linux 5.14+ (Python's mmap module names it only from 3.13).
MADV_POPULATE_READ = 22
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def smaps(pid: str, marks: tuple[str, ...]) -> dict[str, int]:
    """``FIELDS`` (kB) summed over the mappings of ``/proc/PID/smaps`` whose path holds
    one of ``marks``."""
    totals = dict.fromkeys(FIELDS, 0)
    counting = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            counting = any(mark in line for mark in marks)  # a mapping's first line
        elif counting and head and head[0].rstrip(":") in totals:
            totals[head[0].rstrip(":")] += int(head[1])
    return totals


def segment_range(marks: tuple[str, ...]) -> tuple[int, int]:
    """Start address and length of this process's mapping whose path holds a mark."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        if any(mark in line for mark in marks):
            start, end = (int(part, 16) for part in line.split()[0].split("-"))
            return start, end - start
    raise SystemExit(f"no mapping of {marks} in /proc/self/maps")


def faults() -> tuple[int, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_majflt


def worker(mode: str, model_dir: str, socket: str) -> None:
    """One load in this fresh process, then two reads of every byte; prints JSON."""
    import safetensors.torch
    from attach_worker import read_all, shards

    import weightcache

    load, files, load_file = weightcache.load, shards(model_dir), safetensors.torch.load_file
    marks = ("/dev/shm/weightcache-",) if mode != "load_file" else (".safetensors",)
    read_all({})  # its scratch buffer touched before the clock
    out: dict[str, object] = {"mode": mode}
    before, start = faults(), time.perf_counter()
    if mode == "load_file":
        tensors = {}
        for path in files:
            tensors.update(load_file(path))
        held = None
    else:
        held = load(model_dir, socket=socket, fallback=False)
        tensors = held.tensors
    loaded, after_load = time.perf_counter(), faults()
    out["load_ms"] = (loaded - start) * 1e3
    out["load_minflt"] = after_load[0] - before[0]
    if mode == "populate":
        address, length = segment_range(marks)
        begin, cpu = time.perf_counter(), time.thread_time()
        if LIBC.madvise(address, length, MADV_POPULATE_READ) != 0:
            raise SystemExit(f"madvise: errno {ctypes.get_errno()} (Linux older than 5.14?)")
        out["populate_ms"] = (time.perf_counter() - begin) * 1e3
        out["populate_cpu_ms"] = (time.thread_time() - cpu) * 1e3
        out["populate_minflt"] = faults()[0] - after_load[0]
    for key in ("read", "reread"):
        before, begin, cpu = faults(), time.perf_counter(), time.thread_time()
        total = read_all(tensors)
        out[f"{key}_ms"] = (time.perf_counter() - begin) * 1e3
        out[f"{key}_cpu_ms"] = (time.thread_time() - cpu) * 1e3
        now = faults()
        out[f"{key}_minflt"], out[f"{key}_majflt"] = now[0] - before[0], now[1] - before[1]
    out["bytes"] = total
    out["smaps_kb"] = smaps("self", marks)
    if held is not None:
        held.close()
    print(json.dumps(out))


def run_worker(mode: str, model: Path, socket: str) -> dict[str, object]:
    command = [sys.executable, __file__, "--worker", mode, str(model), socket]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=WORKER_TIMEOUT, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{mode} worker exited {done.returncode}:\n{done.stderr}")
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return -1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="rounds per daemon")
    parser.add_argument("--daemons", type=int, default=2, help="fresh daemons, in turn")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    modes = args.modes.split(",")
    from attach_vs_disk import machine_line, new_checkpoint, write_checkpoint

    from weightcache.testing import run_daemon

    shmem = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    mount = [line for line in mounts if " /dev/shm " in line][-1:] or ["?"]  # the top one
    print(machine_line())
    print(f"  shmem_enabled: {shmem}\n  /dev/shm: {mount[0]}")
    rows: dict[str, list[dict[str, object]]] = {mode: [] for mode in modes}
    gib = args.size_gib
    with tempfile.TemporaryDirectory(prefix="wc-every-byte-") as tmp:
        folder, specs = new_checkpoint(Path(tmp), args.tensors, int(gib * (1 << 30)), 0)
        write_checkpoint(folder, specs, args.shards, 0)
        print(f"  checkpoint: {gib} GiB, {args.tensors} tensors, {args.shards} shards")
        for number in range(args.daemons):
            huge_before = meminfo("ShmemHugePages")
            with run_daemon([folder], log_dir=Path(tmp), timeout=300) as daemon:
                arena = smaps(str(daemon.pid), ("/dev/shm/weightcache-",))
                huge = meminfo("ShmemHugePages") - huge_before
                print(f"daemon {number + 1} (pid {daemon.pid}): its arena mapping {arena} kB;")
                print(f"  ShmemHugePages grew by {huge} kB")
                for _ in range(args.repeat):
                    for mode in modes:
                        result = run_worker(mode, folder, daemon.socket)
                        result["daemon"] = number + 1
                        rows[mode].append(result)
                        print("  " + json.dumps(result))
    print("\nmedians, ms (CPU ms of the reading thread in brackets); minor faults per GiB:")
    print(f"  {'mode':10} {'load':>7} {'populate':>15} {'read':>15} {'reread':>15} {'flt/GiB':>8}")
    for mode, results in rows.items():

        def med(key: str, results: list[dict[str, object]] = results) -> float:
            values = [float(r[key]) for r in results if key in r]  # type: ignore[arg-type]
            return statistics.median(values) if values else float("nan")

        def both(key: str) -> str:
            return f"{med(f'{key}_ms'):6.1f} ({med(f'{key}_cpu_ms'):6.1f})"

        flt = (med("read_minflt") + (med("populate_minflt") if mode == "populate" else 0)) / gib
        print(
            f"  {mode:10} {med('load_ms'):7.1f} {both('populate'):>15} {both('read'):>15}"
            f" {both('reread'):>15} {flt:8.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
