"""Benchmark matrix: time to weights-ready of seven loaders, over tensor count x bytes.

Run with ``make bench`` (the quick grid) or ``.venv/bin/python bench/matrix.py [options]``;
``--full`` sweeps 100, 1k, 10k and 100k tensors at 64 MiB, 256 MiB and 1 GiB.

For each cell (a tensor count and a total size) of the grid:

1. generate a sharded safetensors checkpoint in a temporary folder under /tmp (the
   generator of ``attach_vs_disk.py``) and ``torch.save`` the same tensors, as one dict, to
   a ``.pt`` file next to it (neither is timed);
2. start ``weightcache preload`` on the checkpoint and wait until it is ready;
3. run ``attach_worker.py`` ``--repeat`` times per mode, modes interleaved, each run a fresh
   process, timing the load and then reading the first byte of every tensor, for the
   modes of :data:`TIMED`;
4. print median, min and max per mode and ``load_file``'s median over each median;
5. stop the daemon, check /dev/shm and the socket are clean, remove the cell's files.

Then it writes one CSV row per cell and mode to ``--out`` (default ``bench/results/``) and,
when matplotlib is installed (``make bench`` installs it), a log-log plot of the medians
next to it; ``--plot-from CSV`` redraws the plot of a written CSV.

The machine is shared and noisy: the ratios, measured side by side within a cell, are the
figures that matter. See bench/README.md for recorded results.
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

import torch

# bench/ is sys.path[0] when this file runs as a script.
from attach_vs_disk import (
    BenchError,
    fmt_seconds,
    generate,
    int_list,
    machine_line,
    measure,
    mode_list,
    new_checkpoint,
    preloaded,
    print_header,
    print_table,
    run_script,
)
from attach_worker import shards
from safetensors.torch import load_file

from weightcache.testing import Daemon

QUICK_TENSORS = (100, 1000)
QUICK_SIZES_MIB = (64,)
FULL_TENSORS = (100, 1000, 10_000, 100_000)
FULL_SIZES_MIB = (64, 256, 1024)
BASELINE = "load_file"
#: mode -> what its worker times (each followed by reading the first byte of every tensor).
TIMED = {
    "load_file": "safetensors.torch.load_file(shard) per shard",
    "safe_open": 'safetensors.safe_open(shard, "pt") + get_tensor(name) of every tensor',
    "torch_load": "torch.load(model.pt, mmap=True, weights_only=True), the same tensors",
    "mmap": "mmap(shard) + header parse + torch.frombuffer view per tensor (the floor)",
    "attach": "weightcache.load(dir, socket=S, fallback=False) [zero_copy]",
    "copy": 'weightcache.load(dir, socket=S, mode="copy", fallback=False)',
    "disk": "weightcache.load_from_disk(dir)",
    "fallback": "weightcache.load(dir, socket=<none there>): its DAEMON_UNAVAILABLE fallback",
    "disk_first": "disk with an empty hash cache (no daemon ever ran on this host)",
    "fallback_first": "fallback with an empty hash cache",
}
MODES = tuple(TIMED)
#: mode -> the worker's name for it, where they differ.
WORKER_MODE = {"load_file": "safetensors"}
#: Plot styles: weightcache's own modes solid, the other loaders dashed.
STYLE = {
    "load_file": ("--", "o"),
    "safe_open": ("--", "v"),
    "torch_load": ("--", "s"),
    "mmap": (":", "x"),
    "attach": ("-", "D"),
    "copy": ("-", "^"),
    "disk": ("-", "P"),
    "fallback": ("-", "*"),
    "disk_first": ("-", "p"),
    "fallback_first": ("-", "h"),
}
HOW_TO_PLOT = (
    "matplotlib is not installed, so no plot: `make bench` installs it (the `bench` extra,\n"
    "  .venv/bin/pip install -e '.[bench]'); then draw this CSV with\n"
    "  .venv/bin/python bench/matrix.py --plot-from {csv}"
)


@dataclass(frozen=True)
class Row:
    """One cell and mode of the matrix, as written to the CSV."""

    tensors: int
    size_mib: int  # the grid's size; ``bytes`` is what the generated tensors hold
    bytes: int
    mode: str
    median_s: float
    min_s: float
    max_s: float
    runs: int
    ratio_vs_load_file: float  # load_file's median / this median; above 1 = faster
    # The same runs: to the load call's return, and with every byte read.
    load_median_s: float = math.nan
    load_ratio_vs_load_file: float = math.nan
    read_median_s: float = math.nan
    read_ratio_vs_load_file: float = math.nan


COLUMNS = tuple(f.name for f in fields(Row))


def write_pt(folder: Path, path: Path) -> None:
    """``torch.save`` every tensor of the checkpoint in ``folder``, as one dict, to ``path``."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards(str(folder)):
        tensors.update(load_file(shard))
    torch.save(tensors, path)


def run_cell(
    args: argparse.Namespace, count: int, size_mib: int, tmp: Path
) -> tuple[list[Row], list[MemoryRow]]:
    """Steps 1-5 of the module docstring for one cell, in ``tmp``; its rows, and its
    memory rows (at the first tensor count of each size)."""
    folder, specs = new_checkpoint(tmp, count, size_mib * 2**20, args.seed)
    args.cell = (count, size_mib, sum(s.nbytes for s in specs))
    title = f"weightcache benchmark matrix: {count} tensors, {size_mib} MiB"
    print_header(title, specs, args.shards, folder, "MiB")
    generate(folder, specs, args)
    begin = time.monotonic()
    pt_file = tmp / "model.pt"
    write_pt(folder, pt_file)
    print(f"model.pt written in {time.monotonic() - begin:.1f} s", end="; ", flush=True)
    workers = [WORKER_MODE.get(mode, mode) for mode in args.modes]
    with preloaded(folder, tmp, timeout=900) as daemon:
        by_worker, load_by_worker, read_by_worker = measure(
            folder,
            daemon.socket,
            tmp,
            modes=workers,
            repeat=args.repeat,
            cold=False,
            expected=len(specs),
            extra=["--pt", str(pt_file)],
        )
        if args.memory_workers and count == args.tensors[0]:
            memory = measure_memory(folder, daemon, tmp, args, pt_file)
        else:
            memory = []
    seconds, loads, reads = (
        {mode: found[WORKER_MODE.get(mode, mode)] for mode in args.modes}
        for found in (by_worker, load_by_worker, read_by_worker)
    )
    print()
    for title, table in (
        ("the load call alone (to its return)", loads),
        ("load + the first byte of every tensor", seconds),
        ("load + every byte of every tensor", reads),
    ):
        print(f"  {title}:")
        print_table(table, TIMED, 12, (), BASELINE, legend=False)  # the legend came first
    total = sum(s.nbytes for s in specs)
    rows = []
    base, load_base, read_base = (statistics.median(t[BASELINE]) for t in (seconds, loads, reads))
    for mode in args.modes:
        runs = seconds[mode]
        median = statistics.median(runs)
        load, read = statistics.median(loads[mode]), statistics.median(reads[mode])
        rows.append(
            Row(
                count,
                size_mib,
                total,
                mode,
                median,
                min(runs),
                max(runs),
                len(runs),
                base / median,
                load,
                load_base / load,
                read,
                read_base / read,
            )
        )
    return rows, memory


@dataclass(frozen=True)
class MemoryRow:
    """The memory of ``workers`` processes holding one checkpoint's weights at once."""

    tensors: int
    size_mib: int
    bytes: int
    workers: int
    mode: str
    pss_mib: float  # the workers' Pss summed (/proc/PID/smaps_rollup), MiB
    weights_mib: float  # pss_mib less that of as many idle workers (the imports alone)


MEMORY_COLUMNS = tuple(f.name for f in fields(MemoryRow))
#: The modes whose memory is measured, and the idle baseline (imports only).
MEMORY_MODES = ("load_file", "disk", "attach", "copy")


def pss_mib(pid: int) -> float:
    """A process's proportional set size (``Pss`` of /proc/PID/smaps_rollup), in MiB: its
    private pages plus its share of every page it maps with others."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise BenchError(f"/proc/{pid}/smaps_rollup has no Pss line")


def held_pss(mode: str, folder: Path, socket: str, tmp: Path, *, workers: int, pt: Path) -> float:
    """Start ``workers`` workers of ``mode`` at once with ``--hold``; once all have loaded
    and read every byte, sum their Pss (MiB); then let them go.

    Raises:
        BenchError: a worker failed before it was ready.
    """
    worker = WORKER_MODE.get(mode, mode)
    procs = []
    try:
        for i in range(workers):
            command = [sys.executable, str(Path(__file__).with_name("attach_worker.py")), worker]
            command += [str(folder), "--socket", socket, "--out", str(tmp / f"mem{i}.json")]
            command += ["--pt", str(pt), "--hold"]
            procs.append(
                subprocess.Popen(
                    command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
                )
            )
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != b"ready":
                proc.wait()
                assert proc.stderr is not None
                raise BenchError(f"{mode} memory worker failed: {proc.stderr.read().decode()}")
        return sum(pss_mib(proc.pid) for proc in procs)
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in procs:
            proc.wait(timeout=60)
            if proc.stdout is not None:
                proc.stdout.close()
            if proc.stderr is not None:
                proc.stderr.close()


def measure_memory(
    folder: Path, daemon: Daemon, tmp: Path, args: argparse.Namespace, pt: Path
) -> list[MemoryRow]:
    """The memory rows of one cell: ``--memory-workers`` workers per mode of
    :data:`MEMORY_MODES`, and as many idle ones; printed as a table."""
    count, size_mib, total = args.cell
    workers = args.memory_workers
    idle = held_pss("idle", folder, daemon.socket, tmp, workers=workers, pt=pt)
    rows = []
    print(f"\n  memory: {workers} workers at once, each holding the weights after reading")
    print("  every byte; Pss summed over the workers (/proc/PID/smaps_rollup), MiB:")
    print(f"    {'idle':<12}{idle:>10.1f}   (the imports alone)")
    for mode in MEMORY_MODES:
        pss = held_pss(mode, folder, daemon.socket, tmp, workers=workers, pt=pt)
        rows.append(MemoryRow(count, size_mib, total, workers, mode, pss, pss - idle))
        print(f"    {mode:<12}{pss:>10.1f}   weights: {pss - idle:>8.1f}")
    print(f"  (the checkpoint: {total / 2**20:.1f} MiB; the daemon's own memory is not counted)")
    return rows


def write_csv(
    rows: Sequence[Row] | Sequence[MemoryRow], path: Path, columns: Sequence[str] = COLUMNS
) -> None:
    """``rows`` as CSV with a header line (``columns``: :data:`COLUMNS`, or
    :data:`MEMORY_COLUMNS` for memory rows)."""
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(columns)
        for row in rows:
            values = astuple(row)
            writer.writerow(f"{v:.6g}" if isinstance(v, float) else v for v in values)


def read_csv(path: Path) -> list[Row]:
    """The rows of a CSV :func:`write_csv` wrote."""
    with path.open(newline="") as file:
        return [
            Row(
                int(r["tensors"]),
                int(r["size_mib"]),
                int(r["bytes"]),
                r["mode"],
                float(r["median_s"]),
                float(r["min_s"]),
                float(r["max_s"]),
                int(r["runs"]),
                float(r["ratio_vs_load_file"]),
                # Absent from the CSVs written before issue 29.
                *(float(r.get(column) or "nan") for column in COLUMNS[9:]),
            )
            for r in csv.DictReader(file)
        ]


def read_memory_csv(path: Path) -> list[MemoryRow]:
    """The memory rows of a CSV :func:`write_csv` wrote with :data:`MEMORY_COLUMNS`."""
    with path.open(newline="") as file:
        return [
            MemoryRow(
                int(r["tensors"]),
                int(r["size_mib"]),
                int(r["bytes"]),
                int(r["workers"]),
                r["mode"],
                float(r["pss_mib"]),
                float(r["weights_mib"]),
            )
            for r in csv.DictReader(file)
        ]


def plot(rows: Sequence[Row], path: Path, subtitle: str, memory: Sequence[MemoryRow] = ()) -> bool:
    """Draw the medians, log-log, one panel per size and one line per mode (the min-max
    range shaded), and with ``memory`` a last panel of bars (the weights' memory of N
    workers per mode and size), to the PNG ``path``; False when matplotlib is not
    installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = sorted({row.size_mib for row in rows})
    modes = [mode for mode in MODES if any(row.mode == mode for row in rows)]
    panels = len(sizes) + bool(memory)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels + 1.8, 4.8), squeeze=False)
    for ax, size in zip(axes[0][: len(sizes)], sizes, strict=True):
        for mode in modes:
            points = [r for r in rows if r.size_mib == size and r.mode == mode]
            line = sorted((r.tensors, r.median_s, r.min_s, r.max_s) for r in points)
            if not line:
                continue
            xs, medians, mins, maxs = (list(column) for column in zip(*line, strict=True))
            style, marker = STYLE.get(mode, ("-", "."))
            drawn = ax.plot(xs, medians, linestyle=style, marker=marker, label=mode)
            ax.fill_between(xs, mins, maxs, color=drawn[0].get_color(), alpha=0.12)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{size} MiB")
        ax.set_xlabel("tensors")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("median seconds: load + first byte of every tensor")
    if memory:
        _memory_panel(axes[0][-1], memory)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", title="mode")
    fig.suptitle(f"weightcache benchmark matrix\n{subtitle}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 1.6 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _memory_panel(ax: Any, memory: Sequence[MemoryRow]) -> None:
    """Bars: the weights' memory (Pss less idle workers') of N workers, per mode and
    size."""
    sizes = sorted({row.size_mib for row in memory})
    modes = [mode for mode in MEMORY_MODES if any(row.mode == mode for row in memory)]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        found = {row.size_mib: row.weights_mib for row in memory if row.mode == mode}
        xs = [j + i * width for j in range(len(sizes))]
        ax.bar(xs, [found.get(size, 0.0) for size in sizes], width, label=f"{mode} (memory)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))])
    ax.set_xticklabels([f"{size} MiB" for size in sizes])
    ax.set_ylabel(f"MiB: Pss of {memory[0].workers} workers less idle ones")
    ax.set_title("memory of N workers holding the weights")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)


def print_summary(rows: Sequence[Row], modes: Sequence[str]) -> None:
    """Every cell's medians, then ``load_file``'s median over each, one line per cell:
    with the first byte read, to the call's return, and with every byte read."""
    cells = sorted({(row.size_mib, row.tensors) for row in rows})
    found = {(row.size_mib, row.tensors, row.mode): row for row in rows}
    head = f"  {'tensors':>8}{'MiB':>7}" + "".join(f"{mode:>12}" for mode in modes)
    print("summary, medians (load + first byte of every tensor):")
    print(head)
    for size, count in cells:
        medians = "".join(f"{fmt_seconds(found[size, count, m].median_s):>12}" for m in modes)
        print(f"  {count:>8}{size:>7}{medians}")
    for title, ratio in (
        ("load + first byte of every tensor", "ratio_vs_load_file"),
        ("the call returns", "load_ratio_vs_load_file"),
        ("every byte read", "read_ratio_vs_load_file"),
    ):
        print()
        print(f"summary, {title}: {BASELINE} median / this median (above 1: faster):")
        print(head)
        for size, count in cells:
            ratios = "".join(f"{getattr(found[size, count, m], ratio):>11.2f}x" for m in modes)
            print(f"  {count:>8}{size:>7}{ratios}")


def print_setup(args: argparse.Namespace) -> None:
    """Grid, method and what each mode times, before the first cell."""
    cells = len(args.tensors) * len(args.sizes_mib)
    print("weightcache benchmark matrix: time to weights-ready, seven loaders")
    print(machine_line())
    print(
        f"  grid ({args.grid}): tensors {', '.join(map(str, args.tensors))} x "
        f"{', '.join(map(str, args.sizes_mib))} MiB = {cells} cell(s), {args.shards} shards each"
    )
    runs = cells * len(args.modes) * args.repeat
    print(f"  runs: {args.repeat} per mode and cell, modes interleaved, each in a fresh process")
    print(f"        ({runs} in all; starting each and its imports, not timed, take seconds)")
    print("  page cache: WARM, the files were just written and the daemon read them")
    print("  timed, in each worker after its imports (interpreter start, imports and close()")
    print("  of a lease are not), each followed by reading the first byte of every tensor:")
    for mode in args.modes:
        print(f"    {mode:<12}{TIMED[mode]}")


def run_matrix(args: argparse.Namespace, tmp: Path) -> bool:
    """Every cell, then the CSV, the summary and the plot; True once done (a failure
    raises)."""
    print_setup(args)
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / f"{args.name}.csv"
    memory_path = args.out / f"{args.name}-memory.csv"
    rows: list[Row] = []
    memory: list[MemoryRow] = []
    for size_mib in args.sizes_mib:
        for count in args.tensors:
            print("\n")
            here = tmp / f"n{count}-{size_mib}mib"
            here.mkdir()
            cell, cell_memory = run_cell(args, count, size_mib, here)
            rows += cell
            memory += cell_memory
            shutil.rmtree(here)
            write_csv(rows, csv_path)  # after every cell: a failure keeps what was measured
            if memory:
                write_csv(memory, memory_path, MEMORY_COLUMNS)
    print("\n")
    print_summary(rows, args.modes)
    print()
    print(f"wrote {csv_path}" + (f" and {memory_path}" if memory else ""))
    png_path = csv_path.with_suffix(".png")
    if plot(rows, png_path, machine_line().strip(), memory):
        print(f"wrote {png_path}")
    else:
        print(HOW_TO_PLOT.format(csv=csv_path))
    return True


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--full", action="store_true", help="sweep 100..100k tensors x 64 MiB..1 GiB"
    )
    parser.add_argument("--tensors", type=int_list, help="tensor counts (overrides the grid's)")
    parser.add_argument("--sizes-mib", type=int_list, help="total sizes, MiB (overrides)")
    parser.add_argument("--repeat", type=int, help="runs per mode and cell (quick 2, full 5)")
    parser.add_argument("--shards", type=int, default=4, help="number of shard files")
    parser.add_argument("--seed", type=int, default=0, help="seed of shapes and values")
    parser.add_argument(
        "--modes",
        type=mode_list(MODES),
        default=list(MODES),
        help="modes to time (load_file always)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("results"), help="output folder"
    )
    parser.add_argument("--name", help="file name stem (default matrix-quick/-full/-custom)")
    parser.add_argument("--plot-from", type=Path, metavar="CSV", help="only plot this CSV")
    parser.add_argument(
        "--memory-workers",
        type=int,
        default=4,
        help="workers holding the weights at once, per memory mode (0: no memory rows)",
    )
    args = parser.parse_args()
    args.grid = "custom" if args.tensors or args.sizes_mib else "full" if args.full else "quick"
    args.tensors = args.tensors or list(FULL_TENSORS if args.full else QUICK_TENSORS)
    args.sizes_mib = args.sizes_mib or list(FULL_SIZES_MIB if args.full else QUICK_SIZES_MIB)
    args.repeat = args.repeat or (5 if args.full else 2)
    args.name = args.name or f"matrix-{args.grid}"
    if BASELINE not in args.modes:
        args.modes.insert(0, BASELINE)
    if min(*args.tensors, *args.sizes_mib, args.shards, args.repeat) < 1:
        parser.error("--tensors, --sizes-mib, --shards and --repeat must be positive")
    if args.shards > min(args.tensors):
        parser.error("--shards must not exceed --tensors")
    return args


def main() -> int:
    """Run the matrix (or only plot a CSV); returns the exit status."""
    args = parse_args()
    if args.plot_from:
        png_path = args.plot_from.with_suffix(".png")
        memory_csv = args.plot_from.with_name(f"{args.plot_from.stem}-memory.csv")
        memory = read_memory_csv(memory_csv) if memory_csv.exists() else []
        if not plot(read_csv(args.plot_from), png_path, f"from {args.plot_from.name}", memory):
            print(HOW_TO_PLOT.format(csv=args.plot_from), file=sys.stderr)
            return 1
        print(f"wrote {png_path}")
        return 0
    ok = run_script("wcmatrix-", functools.partial(run_matrix, args), (BenchError,))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
