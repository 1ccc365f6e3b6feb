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
    _front_scatter(ax, points, sizes, [r.get(metric) for r in points], front, stepped=True)
    base = next((r.get("baseline_perplexity") for r in points if r.get("baseline_perplexity")), None)
    if metric == "perplexity" and base:
        ax.axhline(base, color="#1f77b4", ls="--", lw=1, label=f"baseline {base:.4g}")
        ax.legend(fontsize=8)
    ax.set_xlabel("size on disk (MiB)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)


# compare --speed: accuracy against the throughput vLLM's serving benchmark measured (higher is faster)
SPEED_PANELS = (("kl_mean", "mean KL(baseline ‖ scheme)"), ("ppl_increase_pct", "perplexity increase %"),
                ("task_drop_pct", "largest task-score drop %"))


def write_speed_chart(rows: list[dict[str, Any]], speed: dict[str, Any], path: Path) -> Path | None:
    """One panel per accuracy measure a scheme has, against measured output tokens/s: lower right is
    better (fast and accurate), the frontier in red, the baseline (no accuracy lost) in blue."""
    points = [r for r in rows if usable(r) and r.get("output_tokens_per_s")]
    panels = [(m, label) for m, label in SPEED_PANELS if any(r.get(m) is not None for r in points)]
    if not points or not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    base = (speed.get("baseline") or {}).get("output_tokens_per_s")
    for ax, (metric, label) in zip(axes[0], panels, strict=True):
        _speed_panel(ax, points, (speed.get("pareto_front") or {}).get(metric, []), metric, label, base)
    fig.suptitle("Accuracy against measured serving throughput (lower right is better; frontier in red)", fontsize=10)
    fig.tight_layout()
    write_png(fig, path)
    return path


def _front_scatter(ax, points: list[dict], xs: list, ys: list, front: list[str], stepped: bool) -> None:
    """Each scheme a labelled point, the Pareto front's red and joined (a step where size is the axis)."""
    on_front = [r["scheme"] in front for r in points]
    ax.scatter(xs, ys, c=["#d62728" if f else "#7f7f7f" for f in on_front], zorder=3)
    for r, x, y in zip(points, xs, ys, strict=True):
        ax.annotate(r["scheme"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    frontier = sorted((x, y) for x, y, f in zip(xs, ys, on_front, strict=True) if f)
    if len(frontier) > 1:
        line = ([p[0] for p in frontier], [p[1] for p in frontier])
        if stepped:
            ax.step(*line, where="post", color="#d62728", lw=1)
        else:
            ax.plot(*line, color="#d62728", lw=1)


def _speed_panel(ax, points: list[dict], front: list[str], metric: str, label: str, base: float | None) -> None:
    drawn = [r for r in points if r.get(metric) is not None]
    _front_scatter(ax, drawn, [r["output_tokens_per_s"] for r in drawn], [r[metric] for r in drawn], front,
                   stepped=False)
    if base:  # the unquantized model: no accuracy lost, its own throughput
        ax.scatter([base], [0.0], marker="s", color="#1f77b4", zorder=3, label=f"baseline {base:.4g} tok/s")
        ax.legend(fontsize=8)
    ax.set_xlabel("output tokens/s (median of the repeats)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
