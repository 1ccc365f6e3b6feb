"""Which scheme to ship, by the goal's priority, and the Pareto frontier.

The goal's priority (plan/targets.py ``priority``) picks the rule: accuracy first, the most accurate
scheme within the budget; smallest (and a goal with no priority, or one compare cannot measure:
speed), the smallest within it. Ties on the rule's axis go to the other axis. "Within the budget":
inside the accuracy budget, and inside the goal's serving budget when it states one ("fit one MI300X
with 32k context": ``fits_serving_budget`` of a row, from the measured size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# budget name -> (row field it limits, how the report names it)
BUDGET_FIELDS = {"max_kl": ("kl_mean", "mean KL"), "max_ppl_increase_pct": ("ppl_increase_pct", "perplexity increase %"),
                 "max_task_drop_pct": ("task_drop_pct", "largest task-score drop %")}
SIZE, ACCURACY = "size", "accuracy"  # the two axes a rule ranks by


@dataclass(frozen=True)
class Rule:
    """How one priority ranks the schemes within the budget."""

    axis: str  # SIZE or ACCURACY: ranked by it first, ties by the other
    words: str  # the rule as the reason states it


RULES = {
    "accuracy": Rule(ACCURACY, "accuracy first (the goal's priority): the most accurate scheme within the budget"),
    "size": Rule(SIZE, "smallest model (the goal's priority): the smallest scheme within the budget"),
    "balanced": Rule(SIZE, "no priority in the goal: the smallest scheme within the budget"),
    "speed": Rule(SIZE, "speed first is not measured by compare: the smallest scheme within the budget"),
}
AXIS_WORDS = {SIZE: ("smaller", "as small", "smaller size"), ACCURACY: ("more accurate", "as accurate", "higher accuracy")}


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


def accuracy_key(row: dict[str, Any], budget: dict[str, float]) -> tuple[float, ...]:
    """Lower is more accurate: the budget's own measures, in BUDGET_FIELDS order (inf when missing)."""
    values = (row.get(BUDGET_FIELDS[name][0]) for name in BUDGET_FIELDS if name in budget)
    return tuple(v if v is not None and math.isfinite(v) else math.inf for v in values)


def _key(row: dict[str, Any], budget: dict[str, float], axis: str) -> tuple[Any, ...]:
    size, accuracy = (row["size_bytes"],), accuracy_key(row, budget)
    return (*size, *accuracy) if axis == SIZE else (*accuracy, *size)


def fits(row: dict[str, Any], budget: dict[str, float]) -> bool:
    return excess(row, budget) <= 1.0 and row.get("fits_serving_budget") is not False


def _describe(row: dict[str, Any], budget: dict[str, float]) -> str:
    parts = []
    for name, limit in budget.items():
        field, label = BUDGET_FIELDS[name]
        value = row.get(field)
        shown = "n/a" if value is None else f"{value:.4g}"
        parts.append(f"{label} {shown} {'≤' if value is not None and value <= limit else '>'} {limit:g}")
    if row.get("serving_fit_text"):
        parts.append(f"serving: {row['serving_fit_text']}")
    return ", ".join(parts)


def recommend(rows: list[dict[str, Any]], budget: dict[str, float], priority: str = "balanced") -> dict[str, Any]:
    """``{"scheme", "fits", "reason", "closest", "priority", "rule"}``: the scheme ``priority``'s rule picks
    among the usable schemes within the budget, or none, with the usable scheme closest to fitting."""
    rule = RULES.get(priority, RULES["balanced"])
    said = {"priority": priority if priority in RULES else "balanced", "rule": rule.words}
    candidates = [r for r in rows if usable(r)]
    if not candidates:
        return {**said, "scheme": None, "fits": False, "closest": None,
                "reason": "No scheme was evaluated with a passing validation: nothing to recommend."}
    fitting = sorted((r for r in candidates if fits(r, budget)), key=lambda r: _key(r, budget, rule.axis))
    if fitting:
        best = fitting[0]
        return {**said, "scheme": best["scheme"], "fits": True, "closest": None,
                "reason": f"{rule.words[0].upper()}{rule.words[1:]}: {best['scheme']} "
                          f"({best['size_bytes'] / 2**20:.3g} MiB; {_describe(best, budget)})"
                          f"{_ties_and_misses(best, fitting, candidates, budget, rule.axis)}."}
    closest = min(candidates, key=lambda r: (excess(r, budget), r["size_bytes"]))
    return {**said, "scheme": None, "fits": False, "closest": closest["scheme"],
            "reason": f"None fits the budget; the closest is {closest['scheme']} ({_describe(closest, budget)})."}


def _ties_and_misses(best: dict[str, Any], fitting: list[dict[str, Any]], candidates: list[dict[str, Any]],
                     budget: dict[str, float], axis: str) -> str:
    """The schemes tied with ``best`` on the rule's axis (the other axis decided), and those better on it
    but over budget."""
    def primary(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["size_bytes"],) if axis == SIZE else accuracy_key(r, budget)

    better, same, other = AXIS_WORDS[axis][0], AXIS_WORDS[axis][1], AXIS_WORDS[SIZE if axis == ACCURACY else ACCURACY]
    tied = [r["scheme"] for r in fitting[1:] if primary(r) == primary(best)]
    over = [r["scheme"] for r in candidates if primary(r) < primary(best) and not fits(r, budget)]
    text = f"; {', '.join(tied)} {'is' if len(tied) == 1 else 'are'} {same}: the tie goes to the {other[2]}" if tied else ""
    return text + (f"; {better} but over budget: {', '.join(over)}" if over else "")


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
