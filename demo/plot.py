"""The demo's figure: ``demo.py``'s results drawn into one PNG (matplotlib, Agg).

Three panels, one colour per loader in each: time to weights-ready and to first embedding
per loader and dtype (milliseconds, medians; horizontal bars, so no label overlaps); host
memory (sum of PSS, MiB, from 0) against the number of workers, float32 solid and
bfloat16 dashed; the many-tensor checkpoint's load per loader (milliseconds).

``python demo/plot.py`` draws the last run's saved results (``demo/demo.json``) again.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

#: Row labels, one line each (the time panel's bars are horizontal: no label overlaps).
SHORT = {
    "cache": "weightcache (cache)",
    "load_file": "load_file + load_state_dict",
    "from_pretrained": "from_pretrained",
    "disk": "load_from_disk (fallback)",
}
MANY_SHORT = {"cache": "weightcache\n(cache)", "load_file": "load_file", "disk": "load_from_disk"}
#: One colour per loader in every panel.
COLOURS = {
    "cache": "tab:green",
    "from_pretrained": "tab:blue",
    "load_file": "tab:orange",
    "disk": "tab:purple",
}
DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16"}


def _median_ms(
    timings: list[dict[str, Any]], kind: str, field: str
) -> dict[tuple[str, str], float]:
    groups: dict[tuple[str, str], list[float]] = {}
    for row in timings:
        if row["kind"] == kind:
            groups.setdefault((row["source"], row["dtype"]), []).append(row[field] * 1e3)
    return {key: statistics.median(values) for key, values in groups.items()}


def _times(times: Axes, result: dict[str, Any]) -> None:
    """Weights-ready (solid) and first embedding (pale) per loader and dtype, one row
    each, float32 above bfloat16."""
    ready = _median_ms(result["timings"], "model", "ready_s")
    embed = _median_ms(result["timings"], "model", "embed_s")
    keys = [k for k in ready if k[1] == "F32"] + [k for k in ready if k[1] == "BF16"]
    ys = range(len(keys))
    colours = [COLOURS.get(source, "tab:gray") for source, _ in keys]
    times.barh([y - 0.2 for y in ys], [ready[k] for k in keys], 0.4, color=colours)
    times.barh([y + 0.2 for y in ys], [embed[k] for k in keys], 0.4, color=colours, alpha=0.4)
    for y, key in zip(ys, keys, strict=True):
        times.annotate(f" {ready[key]:.0f}", (ready[key], y - 0.2), va="center", fontsize=7)
        times.annotate(f" {embed[key]:.0f}", (embed[key], y + 0.2), va="center", fontsize=7)
    times.set_yticks(list(ys), [f"{SHORT[s]}, {DTYPE_NAMES.get(d, d)}" for s, d in keys])
    times.tick_params(axis="y", labelsize=8)
    times.invert_yaxis()
    times.set_xlim(0, max(embed.values()) * 1.15)
    times.set_xlabel("ms after imports (median): solid weights ready, pale first embedding")
    times.set_title("all-MiniLM-L6-v2: time to weights-ready")


def _memory(memory: Axes, result: dict[str, Any], workers: Sequence[int]) -> None:
    """Sum of PSS against workers, a colour per loader, solid float32, dashed bfloat16,
    from 0 MiB."""
    rows: dict[tuple[str, str], dict[int, float]] = {}
    for row in result["memory"]:
        rows.setdefault((row["source"], row["dtype"]), {})[row["workers"]] = row["total_mib"]
    for (source, dtype), by_n in rows.items():
        memory.plot(
            list(workers),
            [by_n[n] for n in workers],
            "-" if dtype == "F32" else "--",
            color=COLOURS.get(source, "tab:gray"),
            marker="o",
            label=_memory_label(source, dtype),
        )
    memory.set_xticks(list(workers))
    memory.set_ylim(bottom=0)
    memory.set_xlabel("workers holding the model")
    memory.set_ylabel("sum of PSS, MiB (cache: daemon included)")
    memory.set_title("host memory")
    memory.legend(fontsize=7, loc="lower right")


def _memory_label(source: str, dtype: str) -> str:
    if source == "idle":
        return "idle workers (no model)"
    return f"{SHORT.get(source, source)}, {DTYPE_NAMES.get(dtype, dtype)}"


def _many(many: Axes, result: dict[str, Any], many_tensors: int) -> None:
    """The many-tensor checkpoint's load per loader."""
    loads = _median_ms(result["timings"], "many", "ready_s")
    order = [k for k in (("cache", "F32"), ("load_file", "F32"), ("disk", "F32")) if k in loads]
    many.bar(
        range(len(order)),
        [loads[k] for k in order],
        color=[COLOURS.get(k[0], "tab:gray") for k in order],
    )
    for x, key in enumerate(order):
        many.annotate(f"{loads[key]:.0f}", (x, loads[key]), ha="center", va="bottom", fontsize=8)
    many.set_xticks(range(len(order)), [MANY_SHORT[k[0]] for k in order], fontsize=8)
    many.set_ylabel("ms to the call's return (median)")
    many.set_title(f"{many_tensors:,} small tensors")


def draw(result: dict[str, Any], path: Path, *, many_tensors: int, workers: Sequence[int]) -> None:
    """Write the figure of ``result`` (``fleet.py``'s output) to ``path`` (PNG)."""
    fig, (times, memory, many) = plt.subplots(
        1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [2.0, 1.5, 1.1]}
    )
    _times(times, result)
    _memory(memory, result, workers)
    _many(many, result, many_tensors)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    """``python demo/plot.py [RESULT.json [OUT.png]]``: draw saved results again (default
    ``demo/demo.json``, written by ``demo.py``, into ``demo/demo.png``)."""
    here = Path(__file__).parent
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else here / "demo.json"
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else here / "demo.png"
    saved = json.loads(source.read_text())
    draw(saved["result"], target, many_tensors=saved["many_tensors"], workers=saved["workers"])
    print(f"plot: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
