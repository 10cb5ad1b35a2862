"""``speedup.png``: grouped bars of speedup vs decodekit greedy, one group per category."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..arguments import save_figure
from .results import OVERALL

TITLES = {"speedup": "Decode-only speedup vs decodekit greedy", "e2e_speedup": "End-to-end speedup vs decodekit greedy"}


def plot_speedup(summary: dict[str, Any], path: Path, *, key: str = "speedup", subtitle: str = "") -> Path:
    """Write the chart; every method but the reference gets one bar per category (missing = no bar)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    cats = summary["categories"]
    methods = [(n, i) for n, i in summary["methods"].items() if n != summary["reference"]]
    width = 0.8 / max(len(methods), 1)
    bars_total = len(cats) * max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(min(14.0, max(7.0, 2 + 0.3 * bars_total)), 5.0), dpi=130)
    colors = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    for j, (name, info) in enumerate(methods):
        xs, ys = [], []
        for c, cat in enumerate(cats):
            value = info["categories"].get(cat, {}).get(key)
            if value is not None:
                xs.append(c - 0.4 + width * (j + 0.5))
                ys.append(value)
        label = name if info["kind"] == "decodekit" else f"{name} (baseline)"
        bars = ax.bar(xs, ys, width * 0.92, label=label, color=colors(j % colors.N),
                      hatch="//" if info["kind"] != "decodekit" else None, edgecolor="white", linewidth=0.5)
        if len(methods) * len(cats) <= 40:  # value labels only while they stay legible
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1.5, rotation=90 if len(methods) > 4 else 0)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="decodekit greedy = 1.0")
    if OVERALL in cats and len(cats) > 1:  # set the aggregate apart from the categories
        ax.axvline(cats.index(OVERALL) - 0.5, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xticks(range(len(cats)), [c.replace("_", " ") for c in cats])
    for tick, cat in zip(ax.get_xticklabels(), cats):
        tick.set_fontweight("bold" if cat == OVERALL else "normal")
    ax.set_ylabel("speedup (x)")
    ax.set_ylim(0, max([1.2, *(b.get_height() for b in ax.patches)]) * 1.18)
    ax.set_title(TITLES.get(key, key) + (f"\n{subtitle}" if subtitle else ""), fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(fontsize=8, ncol=min(len(methods) + 1, 6), loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    fig.tight_layout()
    return save_figure(fig, path)
