"""Time to weights-ready: zero-copy attach vs copy vs disk, on a generated checkpoint.

Run with ``make bench`` or ``.venv/bin/python bench/attach_vs_disk.py [options]``.

1. generate a sharded safetensors checkpoint (``--size-gib``, ``--tensors``, ``--shards``)
   of BF16/F16/F32 tensors of varied shapes in a temporary folder under /tmp;
2. start ``weightcache preload`` on it (``weightcache.testing.run_daemon``) and wait
   until it is ready;
3. run ``attach_worker.py`` ``--repeat`` times per mode, modes interleaved, each run a fresh
   process, timing (``--modes``): ``load()`` zero-copy, ``load(mode="copy")``,
   ``load_from_disk()``, ``safetensors.torch.load_file`` of every shard, and the
   fingerprint alone;
4. print median and min per mode and the ratio to the ``--baseline`` mode (default
   ``disk``) of the same run: with the first byte of every tensor read, then the load
   call alone (the same runs, timed to its return);
5. stop the daemon, check /dev/shm and the socket are clean, remove the folder.

``--tensors`` takes a comma-separated list (``100,1000,10000``): steps 1-5 then run once per
count, each with its own checkpoint of ``--size-gib`` and its own daemon.

The machine is shared and noisy: the ratios, measured side by side, are the figures that
matter. See bench/README.md for recorded results.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors.torch import save_file

from weightcache.testing import Daemon, HarnessError, run_daemon

WORKER = Path(__file__).with_name("attach_worker.py")
MODES = ("attach", "copy", "disk", "safetensors", "fingerprint", "rpc")
DEFAULT_MODES = "attach,copy,disk,fingerprint"
TIMED = {
    "attach": "weightcache.load(dir, socket=S) [zero_copy] + first byte of every tensor",
    "copy": 'weightcache.load(dir, socket=S, mode="copy") + first byte of every tensor',
    "disk": "weightcache.load_from_disk(dir) + first byte of every tensor",
    "safetensors": "safetensors.torch.load_file(shard) per shard + first byte of every tensor",
    "fingerprint": 'open_checkpoint(dir) + compute_fingerprint(.., "sampled") (part of each)',
    "rpc": "a new gRPC channel to the daemon + one ListModels call (the floor under attach)",
}
#: safetensors dtype name -> (torch dtype, share of the tensors).
DTYPES = {"BF16": (torch.bfloat16, 0.5), "F16": (torch.float16, 0.25), "F32": (torch.float32, 0.25)}
COLUMNS = (256, 512, 1024, 2048, 4096)
PARTS = ("attn.qkv.weight", "mlp.up.weight", "mlp.down.weight", "norm.weight")
#: Seconds one worker run may take.
WORKER_TIMEOUT = 600.0
DROP_CACHES = "/proc/sys/vm/drop_caches"


class BenchError(RuntimeError):
    """A step of the benchmark failed; the message says which and why."""


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name."""
    return DTYPES[dtype][0].itemsize


@dataclass(frozen=True)
class Spec:
    """One tensor to generate: name, safetensors dtype, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size of its data in bytes."""
        return itemsize(self.dtype) * int(torch.Size(self.shape).numel())


@dataclass(frozen=True)
class _Draft:
    """A tensor before its row count is known; ``weight`` is None for a vector."""

    name: str
    dtype: str
    cols: int
    weight: float | None


def plan_tensors(count: int, total_bytes: int, seed: int) -> list[Spec]:
    """``count`` tensors of about ``total_bytes`` bytes together.

    Every fourth is a vector (a norm); the others are matrices of 256 to 4096 columns whose
    row counts share out the remaining bytes at random (a weight in [0.25, 1.75] each).
    """
    rng = random.Random(seed)
    drafts = [_draft(i, rng) for i in range(count)]
    vector_bytes = sum(d.cols * itemsize(d.dtype) for d in drafts if d.weight is None)
    weight_sum = sum(d.weight for d in drafts if d.weight is not None) or 1.0
    bytes_per_weight = max(0, total_bytes - vector_bytes) / weight_sum
    return [_spec(d, bytes_per_weight) for d in drafts]


def _draft(index: int, rng: random.Random) -> _Draft:
    part = PARTS[index % len(PARTS)]
    dtype = rng.choices(list(DTYPES), [share for _, share in DTYPES.values()])[0]
    weight = None if part == "norm.weight" else rng.uniform(0.25, 1.75)
    return _Draft(f"layers.{index // len(PARTS)}.{part}", dtype, rng.choice(COLUMNS), weight)


def _spec(draft: _Draft, bytes_per_weight: float) -> Spec:
    if draft.weight is None:
        return Spec(draft.name, draft.dtype, (draft.cols,))
    rows = round(bytes_per_weight * draft.weight / (draft.cols * itemsize(draft.dtype)))
    return Spec(draft.name, draft.dtype, (max(1, rows), draft.cols))


def write_checkpoint(folder: Path, specs: list[Spec], shards: int, seed: int) -> None:
    """Write ``specs`` as ``shards`` safetensors files of similar size plus the HF index.

    Tensors hold ``torch.randn`` values; one shard is in memory at a time.
    """
    total = sum(s.nbytes for s in specs)
    groups: list[list[Spec]] = [[] for _ in range(shards)]
    done = 0
    for spec in specs:
        groups[min(shards - 1, done * shards // max(total, 1))].append(spec)
        done += spec.nbytes
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for number, group in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{shards:05d}.safetensors"
        tensors = {
            s.name: torch.randn(s.shape, dtype=DTYPES[s.dtype][0], generator=generator)
            for s in group
        }
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def new_checkpoint(tmp: Path, tensors: int, total_bytes: int, seed: int) -> tuple[Path, list[Spec]]:
    """Make the empty folder ``tmp/checkpoint`` and plan its tensors (nothing written yet)."""
    folder = tmp / "checkpoint"
    folder.mkdir()
    return folder, plan_tensors(tensors, total_bytes, seed)


def generate(folder: Path, specs: list[Spec], args: argparse.Namespace) -> None:
    """Write the checkpoint; print how long it took."""
    begin = time.monotonic()
    write_checkpoint(folder, specs, args.shards, args.seed)
    print(f"  generated in {time.monotonic() - begin:.1f} s", end="; ", flush=True)


@contextlib.contextmanager
def preloaded(
    folder: Path, tmp: Path, *, args: Sequence[str] = (), timeout: float
) -> Iterator[Daemon]:
    """A daemon preloading ``folder`` (``args``: further ``preload`` flags), logging to
    ``tmp/daemon.log``; stopped with SIGTERM and checked for leftovers on exit.

    Raises:
        HarnessError: it did not become ready in ``timeout`` seconds with the model READY,
            or did not stop cleanly (its log is in the message).
    """
    # Its own session: a Ctrl-C in the terminal reaches only this process, which then
    # stops the daemon with SIGTERM on the way out.
    with run_daemon([folder], args=args, log_dir=tmp, timeout=timeout, new_session=True) as d:
        print(f"daemon preloaded it and was ready after {d.ready_seconds:.1f} s (pid {d.pid})")
        yield d
    print(f"  daemon stopped on SIGTERM, exit status 0; no socket, no weightcache-{d.tag}-* left")


def _exit_on_sigterm(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)  # so that the daemon is stopped on the way out


def run_script(
    prefix: str, body: Callable[[Path], bool], errors: tuple[type[Exception], ...]
) -> bool:
    """Run ``body(tmp)`` with a fresh folder under /tmp, removed afterwards.

    SIGTERM becomes ``SystemExit``; a ``HarnessError`` or one of ``errors`` is printed as
    ``FAILED: ...`` and a Ctrl-C as ``interrupted`` (to stderr).

    Returns:
        What ``body`` returned; False when it raised one of those.
    """
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    reported: tuple[type[Exception], ...] = (HarnessError, *errors)
    try:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            return body(Path(tmp))
    except reported as err:
        print(f"FAILED: {err}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    return False


def run_child(command: list[str], what: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a worker to completion, its stdout and stderr captured as text.

    Raises:
        BenchError: it ran over ``timeout`` seconds.
    """
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what} worker ran over {timeout:.0f} s") from None


def machine_line(with_torch: bool = True) -> str:
    """``  machine: N CPUs, Linux R, python V[, torch T]``, for the headers."""
    line = (
        f"  machine: {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"python {platform.python_version()}"
    )
    return f"{line}, torch {torch.__version__}" if with_torch else line


def print_header(title: str, specs: list[Spec], shards: int, folder: Path, unit: str) -> None:
    """The title, the machine and the checkpoint, its size in ``unit`` (GiB or MiB)."""
    total = sum(s.nbytes for s in specs)
    size = f"{total / 2**30:.2f} GiB" if unit == "GiB" else f"{total / 2**20:.1f} MiB"
    dtypes = ", ".join(f"{d} {n}" for d, n in sorted(Counter(s.dtype for s in specs).items()))
    print(title)
    print(machine_line())
    print(f"  checkpoint: {size}, {len(specs)} tensors ({dtypes}),")
    print(f"              {shards} shards + model.safetensors.index.json, in {folder}")


def drop_caches() -> None:
    """Write back dirty pages and drop the page cache (needs root and a writable /proc/sys).

    Raises:
        BenchError: not permitted here.
    """
    os.sync()
    try:
        with open(DROP_CACHES, "w") as proc:
            proc.write("3\n")
    except OSError as exc:
        raise BenchError(f"--drop-caches: cannot write {DROP_CACHES}: {exc.strerror}") from None


def run_worker(
    mode: str, model: Path, socket: str, out: Path, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """One timed load in a fresh process (``extra``: further worker arguments); returns its
    JSON result (``seconds`` etc.).

    Raises:
        BenchError: the worker failed or ran over :data:`WORKER_TIMEOUT` seconds.
    """
    command = [sys.executable, str(WORKER), mode, str(model), "--socket", socket]
    command += ["--out", str(out), *extra]
    done = run_child(command, mode, WORKER_TIMEOUT)
    if done.returncode != 0:
        raise BenchError(f"{mode} worker exited {done.returncode}:\n{done.stdout}{done.stderr}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def measure(
    model: Path,
    socket: str,
    tmp: Path,
    *,
    modes: Sequence[str],
    repeat: int,
    cold: bool,
    expected: int,
    extra: Sequence[str] = (),
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]]]:
    """Run every mode of ``modes`` ``repeat`` times, interleaved (``extra``: further worker
    arguments); returns seconds per mode with the touch, to the load call's return, and
    with every byte read (``read_seconds``; the touch's for a mode that reads nothing).

    Raises:
        BenchError: a worker failed, loaded from the wrong source or saw the wrong number
            of tensors.
    """
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    loads: dict[str, list[float]] = {mode: [] for mode in modes}
    reads: dict[str, list[float]] = {mode: [] for mode in modes}
    sources = dict.fromkeys(("attach", "copy"), "cache")
    disk = ["disk", "fallback", "disk_first", "fallback_first"]
    disk += ["safetensors", "safe_open", "torch_load", "mmap"]
    sources |= dict.fromkeys(disk, "disk")
    for _ in range(repeat):
        for mode in modes:
            if cold:
                drop_caches()
            result = run_worker(mode, model, socket, tmp / "result.json", extra)
            want_source = sources.get(mode, "-")
            if result["source"] != want_source or result["tensors"] != expected:
                raise BenchError(
                    f"{mode}: expected {expected} tensors from {want_source}: {result}"
                )
            seconds[mode].append(result["seconds"])
            loads[mode].append(result["load_seconds"])
            reads[mode].append(result.get("read_seconds", result["seconds"]))
    return seconds, loads, reads


def fmt_seconds(value: float) -> str:
    """``value`` seconds as milliseconds below 1 s, else seconds."""
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def print_table(
    seconds: dict[str, list[float]],
    timed: dict[str, str],
    width: int,
    note: tuple[str, ...],
    baseline: str = "disk",
    *,
    legend: bool = True,
) -> None:
    """Median, min and max per mode (the keys of ``timed`` that ``seconds`` has, in order),
    the ``baseline`` mode's median over each median, then (with ``legend``) the lines of
    ``note`` and what each mode timed; modes ``width`` wide."""
    base = statistics.median(seconds[baseline])
    ratio = f"{baseline} / this (medians)"
    print(f"  {'mode':<{width}}{'median':>10}{'min':>10}{'max':>10}{ratio:>32}")
    measured = [mode for mode in timed if mode in seconds]
    for mode in measured:
        median = statistics.median(seconds[mode])
        print(
            f"  {mode:<{width}}{fmt_seconds(median):>10}{fmt_seconds(min(seconds[mode])):>10}"
            f"{fmt_seconds(max(seconds[mode])):>10}{base / median:>31.2f}x"
        )
    if not legend:
        return
    print()
    for line in note:
        print(line)
    for mode in measured:
        print(f"    {mode:<{width}}{timed[mode]}")


def print_results(
    seconds: dict[str, list[float]], loads: dict[str, list[float]], baseline: str
) -> None:
    """Median, min and max per mode, and the ``baseline`` median over each median: with
    the touch, then the load call alone (the same runs)."""
    note = (
        "  timed, in each worker after its imports (interpreter start, imports and",
        "  close() of the lease are not):",
    )
    print_table(seconds, TIMED, 12, note, baseline)
    print()
    print("  the same runs, the load call alone (to its return: the touch not timed):")
    print_table(loads, TIMED, 12, note, baseline, legend=False)


def print_setup(specs: list[Spec], shards: int, folder: Path, args: argparse.Namespace) -> None:
    """Machine, checkpoint and method, before the measurements."""
    title = "weightcache benchmark: time to weights-ready, attach vs copy vs disk"
    print_header(title, specs, shards, folder, "GiB")
    if args.drop_caches:
        print("  page cache: COLD, dropped (echo 3 > /proc/sys/vm/drop_caches) before every run")
    else:
        print("  page cache: WARM, the files were just written and the daemon read them")
        print("              (--drop-caches, as root, drops it before every run for cold disk)")
    print(f"  runs: {args.repeat} per mode, modes interleaved, each in a fresh process")
    print(f"  modes: {', '.join(args.modes)}; ratios against {args.baseline}")


def int_list(text: str) -> list[int]:
    """A comma-separated list of integers (an argparse ``type``)."""
    return [int(part) for part in text.split(",")]


def mode_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse ``type`` reading a comma-separated list of modes out of ``choices``."""

    def parse(text: str) -> list[str]:
        modes = text.split(",")
        unknown = sorted(set(modes) - set(choices))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; choose from {choices}")
        return modes

    return parse


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size, GiB")
    parser.add_argument(
        "--tensors", type=int_list, default=[300], help="number of tensors; a list sweeps"
    )
    parser.add_argument("--shards", type=int, default=4, help="number of shard files")
    parser.add_argument("--repeat", type=int, default=5, help="runs per mode")
    parser.add_argument("--seed", type=int, default=0, help="seed of shapes and values")
    parser.add_argument("--drop-caches", action="store_true", help="cold disk (root only)")
    parser.add_argument(
        "--modes",
        type=mode_list(MODES),
        default=mode_list(MODES)(DEFAULT_MODES),
        help="modes to time",
    )
    parser.add_argument("--baseline", default="disk", help="mode the ratios are against")
    args = parser.parse_args()
    if min(*args.tensors, args.shards, args.repeat) < 1 or args.size_gib <= 0:
        parser.error("--size-gib, --tensors, --shards and --repeat must be positive")
    if args.shards > min(args.tensors):
        parser.error("--shards must not exceed --tensors")
    if args.baseline not in args.modes:
        parser.error("--baseline must be one of --modes")
    return args


def run_bench(args: argparse.Namespace, tmp: Path) -> bool:
    """Steps 1-5 of the module docstring for each count of ``--tensors``; True once done
    (a failure raises)."""
    if args.drop_caches:
        drop_caches()  # fail before spending minutes generating
    for number, count in enumerate(args.tensors):
        if number:
            print("\n")
        here = tmp / f"n{count}"
        here.mkdir()
        run_count(args, count, here)
    return True


def run_count(args: argparse.Namespace, count: int, tmp: Path) -> None:
    """Steps 1-5 for one checkpoint of ``count`` tensors, in ``tmp``."""
    folder, specs = new_checkpoint(tmp, count, int(args.size_gib * 2**30), args.seed)
    print_setup(specs, args.shards, folder, args)
    generate(folder, specs, args)
    with preloaded(folder, tmp, timeout=900) as daemon:
        print()
        seconds, loads, _ = measure(
            folder,
            daemon.socket,
            tmp,
            modes=args.modes,
            repeat=args.repeat,
            cold=args.drop_caches,
            expected=len(specs),
        )
    print()
    print_results(seconds, loads, args.baseline)


def main() -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args()
    ok = run_script("wcbench-", functools.partial(run_bench, args), (BenchError,))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
