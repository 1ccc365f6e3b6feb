"""Which scheme to ship: the smallest one within the accuracy budget, and the Pareto frontier."""

from __future__ import annotations

import math
from typing import Any

# budget name -> (row field it limits, how the report names it)
BUDGET_FIELDS = {"max_kl": ("kl_mean", "mean KL"), "max_ppl_increase_pct": ("ppl_increase_pct", "perplexity increase %"),
                 "max_task_drop_pct": ("task_drop_pct", "largest task-score drop %")}


def usable(row: dict[str, Any]) -> bool:
    """Evaluated, and its validation did not fail (a failed export is never recommended)."""
    return row.get("status") == "evaluated" and row.get("validation") not in (None, "failed")


def excess(row: dict[str, Any], budget: dict[str, float]) -> float:
    """The worst ratio value / limit over the budget (<= 1: it fits); inf for a missing number."""
    worst = 0.0
    for name, limit in budget.items():
        value = row.get(BUDGET_FIELDS[name][0])
        if value is None or not math.isfinite(value):
            return math.inf
        ratio = value / limit if limit > 0 else (0.0 if value <= 0 else math.inf)
        worst = max(worst, ratio)
    return worst


def _describe(row: dict[str, Any], budget: dict[str, float]) -> str:
    parts = []
    for name, limit in budget.items():
        field, label = BUDGET_FIELDS[name]
        value = row.get(field)
        shown = "n/a" if value is None else f"{value:.4g}"
        parts.append(f"{label} {shown} {'≤' if value is not None and value <= limit else '>'} {limit:g}")
    return ", ".join(parts)


def recommend(rows: list[dict[str, Any]], budget: dict[str, float]) -> dict[str, Any]:
    """``{"scheme", "fits", "reason", "closest"}``: the smallest usable scheme within ``budget``,
    or none, with the usable scheme closest to fitting."""
    candidates = [r for r in rows if usable(r)]
    if not candidates:
        return {"scheme": None, "fits": False, "closest": None,
                "reason": "No scheme was evaluated with a passing validation: nothing to recommend."}
    fitting = sorted((r for r in candidates if excess(r, budget) <= 1.0), key=lambda r: r["size_bytes"])
    if fitting:
        best = fitting[0]
        smaller = [r["scheme"] for r in candidates if r["size_bytes"] < best["size_bytes"]]
        why = f"; smaller but over budget: {', '.join(smaller)}" if smaller else ""
        return {"scheme": best["scheme"], "fits": True, "closest": None,
                "reason": f"{best['scheme']} is the smallest scheme within the budget "
                          f"({best['size_bytes'] / 2**20:.3g} MiB; {_describe(best, budget)}){why}."}
    closest = min(candidates, key=lambda r: (excess(r, budget), r["size_bytes"]))
    return {"scheme": None, "fits": False, "closest": closest["scheme"],
            "reason": f"None fits the budget; the closest is {closest['scheme']} ({_describe(closest, budget)})."}


def pareto_front(rows: list[dict[str, Any]], metric: str = "kl_mean") -> list[str]:
    """Schemes no other scheme beats on both size and ``metric`` (smaller is better for both)."""
    points = [r for r in rows if usable(r) and r.get(metric) is not None]
    front = []
    for r in points:
        dominated = any(o["size_bytes"] <= r["size_bytes"] and o[metric] <= r[metric]
                        and (o["size_bytes"] < r["size_bytes"] or o[metric] < r[metric]) for o in points)
        if not dominated:
            front.append(r["scheme"])
    return sorted(front, key=lambda s: next(r["size_bytes"] for r in points if r["scheme"] == s))
