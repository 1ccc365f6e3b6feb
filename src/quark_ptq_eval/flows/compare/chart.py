"""The comparison's Pareto chart: size on disk against mean KL and against perplexity, frontier marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quark_ptq_eval.base.fsio import write_png
from quark_ptq_eval.flows.compare.recommend import usable

PANELS = (("kl_mean", "mean KL(baseline ‖ scheme)"), ("perplexity", "perplexity"))


def write_pareto_chart(rows: list[dict[str, Any]], fronts: dict[str, list[str]], path: Path) -> Path | None:
    points = [r for r in rows if usable(r) and r.get("size_bytes")]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.2 * len(PANELS), 4.0), squeeze=False)
    for ax, (metric, label) in zip(axes[0], PANELS, strict=True):
        _panel(ax, points, fronts.get(metric, []), metric, label)
    fig.suptitle("Size against accuracy (lower left is better; frontier in red)", fontsize=10)
    fig.tight_layout()
    write_png(fig, path)
    return path


def _panel(ax, points: list[dict], front: list[str], metric: str, label: str) -> None:
    sizes = [r["size_bytes"] / 2**20 for r in points]
    values = [r.get(metric) for r in points]
    on_front = [r["scheme"] in front for r in points]
    ax.scatter(sizes, values, c=["#d62728" if f else "#7f7f7f" for f in on_front], zorder=3)
    for r, x, y in zip(points, sizes, values, strict=True):
        ax.annotate(r["scheme"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    frontier = sorted((x, y) for x, y, f in zip(sizes, values, on_front, strict=True) if f)
    if len(frontier) > 1:
        ax.step([p[0] for p in frontier], [p[1] for p in frontier], where="post", color="#d62728", lw=1)
    base = next((r.get("baseline_perplexity") for r in points if r.get("baseline_perplexity")), None)
    if metric == "perplexity" and base:
        ax.axhline(base, color="#1f77b4", ls="--", lw=1, label=f"baseline {base:.4g}")
        ax.legend(fontsize=8)
    ax.set_xlabel("size on disk (MiB)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
