"""The demo's figure: ``demo.py``'s results drawn into one PNG (matplotlib, Agg).

Three panels: time to weights-ready and to first embedding per loader and dtype
(milliseconds, medians); host memory (sum of PSS, MiB) against the number of workers,
cache and ``from_pretrained`` in float32 and bfloat16; the many-tensor checkpoint's load
per loader (milliseconds).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SHORT = {
    "cache": "weightcache\n(cache)",
    "load_file": "load_file +\nload_state_dict",
    "from_pretrained": "from_pretrained",
    "disk": "load_from_disk\n(fallback)",
}
MANY_SHORT = {"cache": "weightcache\n(cache)", "load_file": "load_file", "disk": "load_from_disk"}
COLOURS = {"cache": "tab:green", "from_pretrained": "tab:blue", "load_file": "tab:orange"}


def _median_ms(
    timings: list[dict[str, Any]], kind: str, field: str
) -> dict[tuple[str, str], float]:
    groups: dict[tuple[str, str], list[float]] = {}
    for row in timings:
        if row["kind"] == kind:
            groups.setdefault((row["source"], row["dtype"]), []).append(row[field] * 1e3)
    return {key: statistics.median(values) for key, values in groups.items()}


def draw(result: dict[str, Any], path: Path, *, many_tensors: int, workers: Sequence[int]) -> None:
    """Write the figure of ``result`` (``fleet.py``'s output) to ``path`` (PNG)."""
    fig, (times, memory, many) = plt.subplots(
        1, 3, figsize=(15, 4.8), gridspec_kw={"width_ratios": [2.2, 1.4, 1.1]}
    )
    ready = _median_ms(result["timings"], "model", "ready_s")
    embed = _median_ms(result["timings"], "model", "embed_s")
    keys = [k for k in ready if k[1] == "F32"] + [k for k in ready if k[1] == "BF16"]
    labels = [f"{SHORT[s]}\n{d}" for s, d in keys]
    xs = range(len(keys))
    times.bar([x - 0.2 for x in xs], [ready[k] for k in keys], 0.4, label="weights ready")
    times.bar([x + 0.2 for x in xs], [embed[k] for k in keys], 0.4, label="first embedding")
    for x, key in zip(xs, keys, strict=True):
        times.annotate(
            f"{ready[key]:.0f}", (x - 0.2, ready[key]), ha="center", va="bottom", fontsize=8
        )
    times.set_xticks(list(xs), labels, fontsize=7)
    times.set_ylabel("ms after imports (median)")
    times.set_title("all-MiniLM-L6-v2: time to weights-ready")
    times.legend(fontsize=8)

    rows: dict[tuple[str, str], dict[int, float]] = {}
    for row in result["memory"]:
        rows.setdefault((row["source"], row["dtype"]), {})[row["workers"]] = row["total_mib"]
    for (source, dtype), by_n in rows.items():
        style = "-" if dtype == "F32" else "--"
        colour = COLOURS.get(source, "tab:gray")
        memory.plot(
            list(workers),
            [by_n[n] for n in workers],
            style,
            color=colour,
            marker="o",
            label=f"{source} {dtype}",
        )
    memory.set_xticks(list(workers))
    memory.set_xlabel("workers holding the model")
    memory.set_ylabel("sum of PSS, MiB (cache: daemon included)")
    memory.set_title("host memory")
    memory.legend(fontsize=7)

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

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
