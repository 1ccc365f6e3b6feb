"""Which scheme to ship, by the goal's priority, and the Pareto frontier.

The goal's priority (plan/targets.py ``priority``) picks the rule: accuracy first, the most accurate
scheme within the budget; speed first, the fastest within it by the throughput compare --speed
measured (without --speed: the smallest); smallest (and a goal with no priority), the smallest within
it. Ties on the rule's axis go to the other axis. "Within the budget":
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
SIZE, ACCURACY, THROUGHPUT = "size", "accuracy", "throughput"  # the axes a rule ranks by
TPUT = "output_tokens_per_s"  # the row field compare --speed measures (median over the repeats)


@dataclass(frozen=True)
class Rule:
    """How one priority ranks the schemes within the budget."""

    axis: str  # SIZE or ACCURACY: ranked by it first, ties by the other
    words: str  # the rule as the reason states it


RULES = {
    "accuracy": Rule(ACCURACY, "accuracy first (the goal's priority): the most accurate scheme within the budget"),
    "size": Rule(SIZE, "smallest model (the goal's priority): the smallest scheme within the budget"),
    "balanced": Rule(SIZE, "no priority in the goal: the smallest scheme within the budget"),
    "speed": Rule(THROUGHPUT, "speed first (the goal's priority): the fastest scheme within the budget, by the "
                              "output tokens/s vLLM's serving benchmark measured"),
}
UNMEASURED_SPEED = Rule(SIZE, "speed first, but no serving speed was measured (compare --speed measures it): the "
                              "smallest scheme within the budget")
AXIS_WORDS = {SIZE: ("smaller", "as small", "smaller size"), ACCURACY: ("more accurate", "as accurate", "higher accuracy"),
              THROUGHPUT: ("faster", "as fast", "higher throughput")}


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


def _primary(row: dict[str, Any], budget: dict[str, float], axis: str) -> tuple[float, ...]:
    """The rule's own axis, lower first: size, the accuracy measures, or minus the measured throughput (a
    scheme vLLM did not serve ranks after every measured one)."""
    if axis == SIZE:
        return (row["size_bytes"],)
    if axis == THROUGHPUT:
        return (-row[TPUT] if row.get(TPUT) else math.inf,)
    return accuracy_key(row, budget)


def _key(row: dict[str, Any], budget: dict[str, float], axis: str) -> tuple[Any, ...]:
    size, accuracy = (row["size_bytes"],), accuracy_key(row, budget)
    if axis == THROUGHPUT:
        return (*_primary(row, budget, axis), *accuracy, *size)
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
    if row.get(TPUT):
        parts.append(f"{row[TPUT]:.4g} output tokens/s" + (f" ({row['throughput_gain']:.2f}x the baseline)"
                                                            if row.get("throughput_gain") else ""))
    if row.get("serving_fit_text"):
        parts.append(f"serving: {row['serving_fit_text']}")
    return ", ".join(parts)


def recommend(rows: list[dict[str, Any]], budget: dict[str, float], priority: str = "balanced") -> dict[str, Any]:
    """``{"scheme", "fits", "reason", "closest", "priority", "rule"}``: the scheme ``priority``'s rule picks
    among the usable schemes within the budget, or none, with the usable scheme closest to fitting."""
    rule = RULES.get(priority, RULES["balanced"])
    if rule.axis == THROUGHPUT and not any(r.get(TPUT) for r in rows):
        rule = UNMEASURED_SPEED
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
        return _primary(r, budget, axis)

    better, same, other = AXIS_WORDS[axis][0], AXIS_WORDS[axis][1], AXIS_WORDS[SIZE if axis == ACCURACY else ACCURACY]
    tied = [r["scheme"] for r in fitting[1:] if primary(r) == primary(best)]
    over = [r["scheme"] for r in candidates if primary(r) < primary(best) and not fits(r, budget)]
    text = f"; {', '.join(tied)} {'is' if len(tied) == 1 else 'are'} {same}: the tie goes to the {other[2]}" if tied else ""
    return text + (f"; {better} but over budget: {', '.join(over)}" if over else "")


def speed_front(rows: list[dict[str, Any]], metric: str) -> list[str]:
    """Schemes no other scheme beats on both measured throughput (higher is better) and ``metric``
    (lower is better), fastest first."""
    points = [r for r in rows if usable(r) and r.get(metric) is not None and r.get(TPUT)]
    front = [r for r in points if not any(o[TPUT] >= r[TPUT] and o[metric] <= r[metric]
                                          and (o[TPUT] > r[TPUT] or o[metric] < r[metric]) for o in points)]
    return [r["scheme"] for r in sorted(front, key=lambda r: -r[TPUT])]


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
