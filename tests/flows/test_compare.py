"""`compare`: one intake, one plan checkpoint, one execution gate, per-scheme state with resume,
a baseline evaluated once and cached, the report and the recommendation, on the tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quark_ptq_eval.base.gates import FlagApprover
from quark_ptq_eval.base.state import RunState
from quark_ptq_eval.flows.compare.recommend import pareto_front, recommend
from tests.fixtures.compare_setup import (
    BASE_MODEL,
    MAX_TASK_DROP_PCT,
    PPL_TASK,
    SCHEMES,
    SEQ_LEN,
    TASK,
    TASK_DOCS,
    WINDOWS,
    compare_kwargs,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def eval_text(compare_eval_text) -> Path:
    return compare_eval_text


def rows(doc: dict) -> dict[str, dict]:
    return {r["scheme"]: r for r in doc["schemes"]}


def test_plans_and_commands_are_approved_once_for_every_scheme(compared):
    (intake_wait, intake_hint, _), (plan_wait, plan_hint, models_after_plan) = compared["stops"]
    assert intake_wait == "plan" and "compare -o" in intake_hint and "--approve plan" in intake_hint
    assert plan_wait == "execute" and "--approve execute" in plan_hint
    assert not models_after_plan  # nothing ran before the execution gate
    for scheme in ("int8", "int4_wo_32"):  # each scheme's own state holds the approvals given once
        approvals = RunState.load(compared["root"] / "work" / scheme).approvals
        assert {"intake", "plan", "execute", "result"} <= set(approvals)


def test_resume_runs_only_the_schemes_left_and_a_failed_scheme_is_reported(compared):
    assert ("done", "int8") in compared["first"] and ("done", "int4_wo_32") not in compared["first"]
    assert ("skipped", "int8") in compared["second"] and ("done", "int4_wo_32") in compared["second"]
    assert RunState.load(compared["root"] / "work" / "int8").steps["execute"]["status"] == "succeeded"
    manifest = (compared["root"] / "work" / "int8" / "run_manifest.yaml").read_text()
    assert manifest.count("status: succeeded") == 1  # int8 was quantized once, not again on resume
    bad = rows(compared["doc"])["no_such_scheme"]
    assert bad["status"] == "failed" and bad["failed_step"] == "plan" and bad["error"]
    assert ("failed", "no_such_scheme") in compared["second"]


def test_baseline_is_evaluated_once_and_read_by_every_scheme(compared):
    assert len(compared["cache_files"]) == 1
    assert [p.stat().st_mtime_ns for p in compared["cache_files"]] == compared["cache_mtime"]
    cache = compared["doc"]["baseline_cache"]
    assert cache["writes_this_run"] == 0 and cache["hits_this_run"] == 1  # the resumed run: one scheme left
    assert cache["bytes"] < cache["full_logits_bytes"]
    for scheme in ("int8", "int4_wo_32"):
        results = json.loads((compared["root"] / "work" / scheme / "eval_results.json").read_text())
        assert results["details"]["baseline_cache"]["key"] == cache["key"]


def test_report_has_every_column_and_matches_a_separate_evaluation(compared, tiny_llama, eval_text, tmp_path):
    from quark_ptq_eval.evaluate import EvalOptions, evaluate

    root, doc = compared["root"], compared["doc"]
    for scheme in ("int8", "int4_wo_32"):
        r = rows(doc)[scheme]
        assert r["status"] == "evaluated" and r["validation"] in ("success", "partial")
        assert r["compression_ratio"] > 1 and 0 < r["bits_per_weight"] < 32 and r["quantize_s"] > 0
        low, high = r["perplexity_ci95"]
        assert low < r["perplexity"] < high and r["delta_nll_stderr"] > 0 and isinstance(r["significant"], bool)
        assert 0 <= r["kl_p50"] <= r["kl_p99"] <= r["kl_max"] and 0 < r["top1_agreement"] <= 1
    assert rows(doc)["int4_wo_32"]["size_bytes"] < rows(doc)["int8"]["size_bytes"]
    report = (root / "comparison_report.md").read_text()
    assert "Recommendation" in report and all(s in report for s in SCHEMES)
    assert "## llama.cpp-style statistics" in report and "same top p" in report
    assert (root / "comparison_pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((root / "comparison.json").read_text())["recommendation"] == doc["recommendation"]

    # Each scheme evaluated on its own by Tier 1, with the full baseline, on the same export and text:
    # the same perplexities to 1e-4, and full KL >= cached KL within the stated bound.
    for scheme in ("int8", "int4_wo_32"):
        alone = evaluate(root / "models" / scheme, EvalOptions(tier="ppl", eval_data=eval_text, seq_len=SEQ_LEN,
                                                               max_windows=WINDOWS, device="cpu", baseline=tiny_llama),
                         tmp_path / scheme, FlagApprover(all_gates=True))
        ours = rows(doc)[scheme]
        assert math.isclose(alone.details["quantized"]["perplexity"], ours["perplexity"], rel_tol=1e-4)
        assert math.isclose(alone.details["baseline"]["perplexity"], ours["baseline_perplexity"], rel_tol=1e-4)
        full_kl = alone.details["kl"]["kl_divergence"]
        # llama.cpp's figures that the cache keeps exactly (NLLs, argmax) agree with the full-baseline run
        exact, cached = alone.details["kld_report"], ours["kld_report"]
        assert cached["ppl_ratio"] == pytest.approx(exact["ppl_ratio"], rel=1e-4)
        assert cached["same_top_p"] == pytest.approx(exact["same_top_p"], abs=1e-3)
        assert cached["kld_mean"] <= exact["kld_mean"] * (1 + 1e-6)  # the cached KL is a lower bound
        assert ours["kl_mean"] - 1e-6 <= full_kl <= ours["kl_mean"] + ours["kl_cache_gap_bound_mean"] + 1e-6


def test_task_scores_carry_a_paired_test_against_the_baseline_evaluated_once(compared):
    from quark_ptq_eval.evaluate.lmeval.tier import mcnemar

    root, doc = compared["root"], compared["doc"]
    base_dirs = sorted((root / "baseline_cache").glob("lm_eval-*"))
    assert len(base_dirs) == 1  # the baseline's tasks ran once for both schemes, across the resume
    base = json.loads((base_dirs[0] / "lm_eval_results" / "baseline.samples.json").read_text())[TASK]
    for scheme in ("int8", "int4_wo_32"):
        ours = json.loads((root / "work" / scheme / "lm_eval_results" / "quantized.samples.json").read_text())[TASK]
        by_metric = {t["metric"]: t for t in rows(doc)[scheme]["tasks"]}
        for metric in ("acc", "acc_norm"):
            t, b, q = by_metric[metric], base[metric], ours[metric]
            assert len(q) == TASK_DOCS and set(q) == set(b)
            lost, gained = sum(b[d] > q[d] for d in b), sum(b[d] < q[d] for d in b)
            assert (t["baseline_only"], t["scheme_only"]) == (lost, gained)
            assert t["p_value"] == mcnemar(lost, gained)["mid_p_value"] and t["significant"] == (t["p_value"] < 0.05)
            assert t["score"] == pytest.approx(sum(q.values()) / TASK_DOCS)
            assert t["baseline"] == pytest.approx(sum(b.values()) / TASK_DOCS)
        assert rows(doc)[scheme]["task_drop_pct"] == max(t["drop_pct"] for t in by_metric.values() if t["drop_pct"] is not None)
    report = (root / "comparison_report.md").read_text()
    assert "## Task scores (Tier 2, lm-eval)" in report and "significant at 5 %" in report and "McNemar" in report


def test_plan_time_estimate_comes_from_measurements_on_this_host(compared, monkeypatch):
    from quark_ptq_eval.base.artifacts import ModelAnalysis, QuantPlan
    from quark_ptq_eval.flows.compare import plans as compare_plans
    from quark_ptq_eval.flows.compare.options import CompareOptions
    from quark_ptq_eval.plan import resources

    root = compared["root"]
    analysis = ModelAnalysis.load(root)
    # One reading of the host's shared history for both sides: the other worker's runs append to it meanwhile.
    history = compare_plans.engine_history()
    monkeypatch.setattr(compare_plans, "engine_history", lambda: history)
    recorded = [r for r in history if r["scheme"] in ("int8", "int4_wo_32") and r["calib_tokens"] == 8 * 64
                and r["params"] == resources.param_count(analysis)]
    assert {"int8", "int4_wo_32"} <= {r["scheme"] for r in recorded}  # this comparison's engine runs
    plans = {s: QuantPlan.load(root / "work" / s) for s in ("int8", "int4_wo_32")}
    opts = CompareOptions(**{k: v for k, v in RunState.load(root).options.items()})
    totals = compare_plans.estimate_totals(analysis, plans, opts)
    assert all(e["basis"] == "measured" for e in totals["schemes"].values())
    assert "GFLOP/s (a matmul timed here now)" in totals["text"] and totals["rate_flops"] > 0
    assert [e["quantize_s"] for e in totals["schemes"].values()] == [
        next(r["seconds"] for r in reversed(recorded) if r["scheme"] == s) for s in plans]
    assert "as their last run of this model" in totals["text"] and "assumed" not in totals["text"]


def test_recommendation_on_the_measured_numbers(compared):
    measured = compared["doc"]["schemes"]
    by = rows(compared["doc"])
    small, large = by["int4_wo_32"], by["int8"]
    assert large["kl_mean"] < small["kl_mean"]  # 8-bit weights disturb the tiny model less than 4-bit
    loose = recommend(measured, {"max_kl": small["kl_mean"] * 1.01})
    assert loose["scheme"] == "int4_wo_32" and loose["fits"]
    middle = recommend(measured, {"max_kl": (small["kl_mean"] + large["kl_mean"]) / 2})
    assert middle["scheme"] == "int8" and "int4_wo_32" in middle["reason"]  # named as smaller but over budget
    tight = recommend(measured, {"max_kl": large["kl_mean"] / 2})
    assert tight["scheme"] is None and tight["closest"] == "int8" and "None fits" in tight["reason"]
    drops = sorted(r["task_drop_pct"] for r in (small, large))
    by_task = recommend(measured, {"max_task_drop_pct": max(drops[1], 0.0) + 1.0})
    assert by_task["scheme"] == "int4_wo_32" and "task-score drop" in by_task["reason"]
    assert pareto_front(measured, "kl_mean") == ["int4_wo_32", "int8"]
    rec = compared["doc"]["recommendation"]  # the goal's priority, read as the plan reads it
    assert rec["priority"] == "size" and rec["reason"].startswith("Smallest model (the goal's priority)")
    assert rec == recommend(measured, compared["doc"]["budget"], "size")


def test_cli_compare_stops_at_the_shared_intake_checkpoint(cli, tiny_llama, corpus, tmp_path):
    res = cli("compare", tiny_llama, "--schemes", "int8,fp8", "-o", tmp_path / "out", "--calib-data", corpus,
              "--offline")
    assert res.rc == 3, res.err
    assert "checkpoint 1 (intake)" in res.err and "quark-ptq-eval compare -o" in res.err
    assert "Traceback" not in res.err and not (tmp_path / "out" / "work").exists()
    assert json.loads((tmp_path / "out" / "run_state.json").read_text())["options"]["schemes"] == ["int8", "fp8"]


def test_the_chosen_scheme_alone_gets_a_card_that_says_why(compared):
    from tests.publish.test_model_card import assert_card_matches

    root, doc = compared["root"], compared["doc"]
    chosen = doc["recommendation"]["scheme"]
    assert chosen is not None, doc["recommendation"]
    card = assert_card_matches(root / "models" / chosen, root / "work" / chosen)
    assert "## Chosen by a comparison" in card.text and doc["recommendation"]["reason"] in card.text
    assert doc["model_card"] == str(root / "models" / chosen / "README.md") and chosen in doc["upload"]
    others = [s for s in ("int8", "int4_wo_32") if s != chosen]
    assert not any((root / "models" / s / "README.md").exists() for s in others)  # their recipes ran --card none


def test_compare_with_tasks_from_the_command_line_recommends_within_the_task_drop_budget(compared, corpus, eval_text):
    """`compare --schemes int8,int4_wo_32 --tasks T --max-task-drop-pct X --base-model ORG/NAME` (the shared
    comparison's first call; test_task_scores_... checks its paired tests): the options the command line
    stored are the Python API's, each scheme has its task scores, the report its task columns, and the
    recommendation is the smallest scheme whose worst task drop is within X; its card names the base."""
    from huggingface_hub import ModelCard

    from quark_ptq_eval.flows.compare.options import options_from

    root, doc = compared["root"], compared["doc"]
    api = options_from(None, SCHEMES, root, compare_kwargs(corpus, eval_text)).to_state()
    stored = RunState.load(root).options
    assert {k: v for k, v in stored.items() if k != "model"} == {k: v for k, v in api.items() if k != "model"}
    assert stored["eval"]["tasks"] == [TASK, PPL_TASK] and stored["max_task_drop_pct"] == MAX_TASK_DROP_PCT
    by = rows(doc)
    for scheme in ("int8", "int4_wo_32"):  # every task metric scored; the 0/1 ones paired against the one baseline
        tasks = {(t["task"], t["metric"]): t for t in by[scheme]["tasks"]}
        assert {(TASK, "acc"), (TASK, "acc_norm"), (PPL_TASK, "word_perplexity")} <= set(tasks)
        paired = [tasks[(TASK, m)] for m in ("acc", "acc_norm")]
        assert all(t["test"] and t["documents"] == TASK_DOCS and 0 <= t["p_value"] <= 1 for t in paired)
        assert isinstance(tasks[(PPL_TASK, "word_perplexity")]["drop_pct"], float)  # a continuous drop
        assert by[scheme]["task_drop_pct"] == max(t["drop_pct"] for t in tasks.values() if t["drop_pct"] is not None)
    report = (root / "comparison_report.md").read_text()
    assert ("| scheme | task | metric | baseline | scheme | drop % | test | only base / only scheme | p | "
            "significant at 5 % |") in report
    for scheme in ("int8", "int4_wo_32"):
        for t in by[scheme]["tasks"]:
            assert f"| {scheme} | {t['task']} | {t['metric']} | " in report
    assert doc["budget"] == {"max_task_drop_pct": MAX_TASK_DROP_PCT}
    assert f"Budget: max_task_drop_pct = {MAX_TASK_DROP_PCT:g}." in report
    rec = doc["recommendation"]
    evaluated = [r for r in doc["schemes"] if r["status"] == "evaluated"]
    within = [r for r in evaluated if r["task_drop_pct"] <= MAX_TASK_DROP_PCT]
    assert within, f"no scheme within a {MAX_TASK_DROP_PCT} % task drop: {[r['task_drop_pct'] for r in evaluated]}"
    assert rec["scheme"] == min(within, key=lambda r: r["size_bytes"])["scheme"] and rec["fits"]
    # a budget between the measured drops decides: the scheme over it is left out for its task drop alone
    low, high = sorted(r["task_drop_pct"] for r in evaluated)
    if high > low:
        budget = (low + high) / 2
        mid = recommend(doc["schemes"], {"max_task_drop_pct": budget}, "size")
        kept = [r for r in evaluated if r["task_drop_pct"] <= budget]
        assert mid["scheme"] == min(kept, key=lambda r: r["size_bytes"])["scheme"] and mid["fits"]
        over = [r for r in evaluated if r["task_drop_pct"] > budget and r["size_bytes"] < by[mid["scheme"]]["size_bytes"]]
        assert all(r["scheme"] in mid["reason"] for r in over)
        assert not over or "task-score drop" in mid["reason"]
    assert f"**Recommendation:** {rec['reason']}" in report
    card = ModelCard.load(root / "models" / rec["scheme"] / "README.md").data
    assert (card.base_model, card.base_model_relation) == (BASE_MODEL, "quantized")
