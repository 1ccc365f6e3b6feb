"""`compare`'s recommendation follows the goal's priority: pure functions over comparison rows
(the wiring through a real comparison is in tests/test_compare.py)."""

from __future__ import annotations

import pytest

from quark_ptq_eval.flows.compare.recommend import recommend
from quark_ptq_eval.plan.targets import priority

MIB = 2**20
PPL_BUDGET = {"max_ppl_increase_pct": 2.0}


def row(scheme: str, mib: float, ppl_pct: float, kl: float, **extra) -> dict:
    return {"scheme": scheme, "status": "evaluated", "validation": "success", "size_bytes": int(mib * MIB),
            "ppl_increase_pct": ppl_pct, "kl_mean": kl, **extra}


# Three usable schemes within a 2 % perplexity budget: int8 the most accurate, int4 the smallest.
ROWS = [row("int8", 1.0, 0.2, 0.001), row("fp8", 1.0, 0.5, 0.002), row("int4_wo_128", 0.6, 1.5, 0.006)]


@pytest.mark.parametrize(("goal", "expected", "words"), [
    ("accuracy first for MI300X", "int8", "Accuracy first (the goal's priority): the most accurate"),
    ("the smallest model that still works", "int4_wo_128", "Smallest model (the goal's priority): the smallest"),
    ("int8 for MI300X", "int4_wo_128", "No priority in the goal: the smallest"),
    ("fast, low latency", "int4_wo_128", "Speed first, but no serving speed was measured (compare --speed measures it)"),
])
def test_each_priority_applies_its_rule_and_says_which(goal, expected, words):
    rec = recommend(ROWS, PPL_BUDGET, priority(goal))
    assert rec["scheme"] == expected and rec["fits"]
    assert rec["reason"].startswith(words), rec["reason"]
    assert rec["rule"].lower() in rec["reason"].lower()


def test_the_issues_example_the_more_accurate_of_two_equal_sizes_wins_under_accuracy_first():
    # the demo model: fp8 38.47 / KL 0.00219, ptpc_fp8 38.32 / KL 0.00202, both 0.53 MiB; int4 refused at the plan
    base = 38.0
    rows = [row("fp8", 0.53, 100 * (38.47 / base - 1), 0.00219), row("ptpc_fp8", 0.53, 100 * (38.32 / base - 1), 0.00202),
            {"scheme": "int4_wo_128", "status": "failed", "failed_step": "plan"}]
    accurate = recommend(rows, PPL_BUDGET, priority("accuracy first for MI300X"))
    assert accurate["scheme"] == "ptpc_fp8" and accurate["priority"] == "accuracy"
    smallest = recommend(rows, PPL_BUDGET, "size")  # equal sizes: the tie goes to accuracy
    assert smallest["scheme"] == "ptpc_fp8"
    assert "fp8 is as small: the tie goes to the higher accuracy" in smallest["reason"], smallest["reason"]


def test_a_tie_on_accuracy_goes_to_the_smaller_scheme():
    rows = [row("int8", 1.0, 0.3, 0.002), row("int8_small", 0.8, 0.3, 0.002), row("int4", 0.5, 1.9, 0.01)]
    rec = recommend(rows, {"max_kl": 0.05, "max_ppl_increase_pct": 2.0}, "accuracy")
    assert rec["scheme"] == "int8_small"
    assert "int8 is as accurate: the tie goes to the smaller size" in rec["reason"], rec["reason"]


def test_accuracy_is_ranked_by_the_budgets_own_measures():
    # by KL (budgeted first) int8 is the more accurate; by perplexity alone fp8 is
    rows = [row("int8", 1.0, 0.6, 0.001), row("fp8", 1.0, 0.4, 0.003)]
    assert recommend(rows, {"max_kl": 0.01}, "accuracy")["scheme"] == "int8"
    assert recommend(rows, PPL_BUDGET, "accuracy")["scheme"] == "fp8"
    # the most accurate by KL is over the perplexity limit: named as such, the next one recommended
    over = [row("int8", 1.0, 2.5, 0.001), row("fp8", 1.0, 0.4, 0.003)]
    rec = recommend(over, {"max_kl": 0.01, "max_ppl_increase_pct": 2.0}, "accuracy")
    assert rec["scheme"] == "fp8" and "more accurate but over budget: int8" in rec["reason"], rec["reason"]


def test_the_goals_serving_budget_is_the_size_budget_of_accuracy_first():
    rows = [row("bf16ish", 4.0, 0.0, 0.0, fits_serving_budget=False, serving_fit_text="2 device(s)"),
            row("fp8", 1.0, 0.5, 0.002, fits_serving_budget=True, serving_fit_text="1 device(s)"),
            row("int4", 0.6, 1.5, 0.006, fits_serving_budget=True, serving_fit_text="1 device(s)")]
    rec = recommend(rows, PPL_BUDGET, "accuracy")
    assert rec["scheme"] == "fp8" and "more accurate but over budget: bf16ish" in rec["reason"]
    assert "serving: 1 device(s)" in rec["reason"]
    nothing = recommend([rows[0]], PPL_BUDGET, "accuracy")
    assert nothing["scheme"] is None and nothing["closest"] == "bf16ish" and "None fits" in nothing["reason"]


def test_without_a_usable_scheme_nothing_is_recommended_whatever_the_priority():
    failed = [{**r, "validation": "failed"} for r in ROWS]
    for p in ("accuracy", "size", "balanced", "speed"):
        rec = recommend(failed, PPL_BUDGET, p)
        assert rec["scheme"] is None and rec["closest"] is None and rec["priority"] == p


def test_speed_first_picks_the_fastest_measured_scheme_within_the_budget():
    """compare --speed's rows: the fastest within the budget; a faster one over budget is named; one vLLM did not
    serve ranks after every measured one; a tie on throughput goes to the more accurate."""
    rows = [row("int8", 1.0, 0.2, 0.001, output_tokens_per_s=300.0),
            row("fp8", 1.0, 0.5, 0.002, speed_refused="vLLM does not serve it: no kernel."),
            row("int4_wo_128", 0.6, 1.5, 0.006, output_tokens_per_s=400.0, throughput_gain=1.6),
            row("mxfp4", 0.5, 9.0, 0.05, output_tokens_per_s=500.0)]
    rec = recommend(rows, PPL_BUDGET, priority("fastest serving"))
    assert rec["scheme"] == "int4_wo_128" and rec["priority"] == "speed", rec
    assert rec["reason"].startswith("Speed first (the goal's priority): the fastest scheme within the budget")
    assert "400 output tokens/s (1.60x the baseline)" in rec["reason"] and "faster but over budget: mxfp4" in rec["reason"]
    rows[0]["output_tokens_per_s"] = 400.0  # as fast as int4_wo_128 and more accurate
    rec = recommend(rows, PPL_BUDGET, "speed")
    assert rec["scheme"] == "int8" and "int4_wo_128 is as fast: the tie goes to the higher accuracy" in rec["reason"]
    only_fp8 = recommend([rows[1]], PPL_BUDGET, "speed")  # nothing measured: the size rule, said so
    assert only_fp8["scheme"] == "fp8" and only_fp8["rule"].startswith("speed first, but no serving speed was measured")


def test_the_speed_frontier_is_throughput_against_accuracy():
    from quark_ptq_eval.flows.compare.recommend import speed_front

    rows = [row("a", 1, 0.1, 0.001, output_tokens_per_s=100.0), row("b", 1, 0.5, 0.004, output_tokens_per_s=200.0),
            row("c", 1, 0.6, 0.005, output_tokens_per_s=150.0), row("d", 1, 0.1, 0.001)]
    assert speed_front(rows, "kl_mean") == ["b", "a"]  # c: slower and less accurate than b; d: not measured
