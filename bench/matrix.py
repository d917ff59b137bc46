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
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields
from pathlib import Path

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


COLUMNS = tuple(f.name for f in fields(Row))


def write_pt(folder: Path, path: Path) -> None:
    """``torch.save`` every tensor of the checkpoint in ``folder``, as one dict, to ``path``."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards(str(folder)):
        tensors.update(load_file(shard))
    torch.save(tensors, path)


def run_cell(args: argparse.Namespace, count: int, size_mib: int, tmp: Path) -> list[Row]:
    """Steps 1-5 of the module docstring for one cell, in ``tmp``; its rows."""
    folder, specs = new_checkpoint(tmp, count, size_mib * 2**20, args.seed)
    title = f"weightcache benchmark matrix: {count} tensors, {size_mib} MiB"
    print_header(title, specs, args.shards, folder, "MiB")
    generate(folder, specs, args)
    begin = time.monotonic()
    pt_file = tmp / "model.pt"
    write_pt(folder, pt_file)
    print(f"model.pt written in {time.monotonic() - begin:.1f} s", end="; ", flush=True)
    workers = [WORKER_MODE.get(mode, mode) for mode in args.modes]
    with preloaded(folder, tmp, timeout=900) as daemon:
        by_worker, _ = measure(
            folder,
            daemon.socket,
            tmp,
            modes=workers,
            repeat=args.repeat,
            cold=False,
            expected=len(specs),
            extra=["--pt", str(pt_file)],
        )
    seconds = {mode: by_worker[WORKER_MODE.get(mode, mode)] for mode in args.modes}
    print()
    print_table(seconds, TIMED, 12, (), BASELINE, legend=False)  # the legend came first
    base = statistics.median(seconds[BASELINE])
    total = sum(s.nbytes for s in specs)
    rows = []
    for mode in args.modes:
        runs = seconds[mode]
        median = statistics.median(runs)
        ratio = base / median
        rows.append(
            Row(count, size_mib, total, mode, median, min(runs), max(runs), len(runs), ratio)
        )
    return rows


def write_csv(rows: Sequence[Row], path: Path) -> None:
    """``rows`` as CSV with a header line (:data:`COLUMNS`)."""
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(COLUMNS)
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
            )
            for r in csv.DictReader(file)
        ]


def plot(rows: Sequence[Row], path: Path, subtitle: str) -> bool:
    """Draw the medians, log-log, one panel per size and one line per mode (the min-max
    range shaded), to the PNG ``path``; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = sorted({row.size_mib for row in rows})
    modes = [mode for mode in MODES if any(row.mode == mode for row in rows)]
    fig, axes = plt.subplots(
        1, len(sizes), figsize=(4.6 * len(sizes) + 1.8, 4.8), sharey=True, squeeze=False
    )
    for ax, size in zip(axes[0], sizes, strict=True):
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
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", title="mode")
    fig.suptitle(f"weightcache benchmark matrix\n{subtitle}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 1.6 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def print_summary(rows: Sequence[Row], modes: Sequence[str]) -> None:
    """Every cell's medians, then ``load_file``'s median over each, one line per cell."""
    cells = sorted({(row.size_mib, row.tensors) for row in rows})
    found = {(row.size_mib, row.tensors, row.mode): row for row in rows}
    head = f"  {'tensors':>8}{'MiB':>7}" + "".join(f"{mode:>12}" for mode in modes)
    print("summary, medians:")
    print(head)
    for size, count in cells:
        medians = "".join(f"{fmt_seconds(found[size, count, m].median_s):>12}" for m in modes)
        print(f"  {count:>8}{size:>7}{medians}")
    print()
    print(f"summary, {BASELINE} median / this median (above 1: faster than {BASELINE}):")
    print(head)
    for size, count in cells:
        ratios = "".join(f"{found[size, count, m].ratio_vs_load_file:>11.2f}x" for m in modes)
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
    rows: list[Row] = []
    for size_mib in args.sizes_mib:
        for count in args.tensors:
            print("\n")
            here = tmp / f"n{count}-{size_mib}mib"
            here.mkdir()
            rows += run_cell(args, count, size_mib, here)
            shutil.rmtree(here)
            write_csv(rows, csv_path)  # after every cell: a failure keeps what was measured
    print("\n")
    print_summary(rows, args.modes)
    print()
    print(f"wrote {csv_path}")
    png_path = csv_path.with_suffix(".png")
    if plot(rows, png_path, machine_line().strip()):
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
        if not plot(read_csv(args.plot_from), png_path, f"from {args.plot_from.name}"):
            print(HOW_TO_PLOT.format(csv=args.plot_from), file=sys.stderr)
            return 1
        print(f"wrote {png_path}")
        return 0
    ok = run_script("wcmatrix-", functools.partial(run_matrix, args), (BenchError,))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
