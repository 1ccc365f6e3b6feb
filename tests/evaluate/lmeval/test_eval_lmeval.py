"""Tier 2: lm-eval on local task YAMLs (multiple choice + rolling perplexity), in-memory model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.gates import FlagApprover
from quark_ptq_eval.evaluate import EvalOptions, estimate_runtime, evaluate
from quark_ptq_eval.evaluate.lmeval.tier import mcnemar, paired_bootstrap, paired_tests, per_sample_scores

pytestmark = pytest.mark.slow
TASKS_DIR = Path(__file__).parents[2] / "data" / "eval_tasks"
TASKS = ["qpe_docstring_mc", "qpe_docstring_ppl"]


def lm_eval_options(**overrides) -> EvalOptions:
    return EvalOptions(
        **{"tier": "lm_eval", "tasks": TASKS, "include_path": TASKS_DIR, "limit": 6, "device": "cpu"}
        | overrides
    )


def test_tier2_end_to_end_without_baseline(quantized, tmp_path):
    report = evaluate(quantized("int8"), lm_eval_options(), tmp_path, FlagApprover())
    mc, ppl = report.quantized["qpe_docstring_mc"], report.quantized["qpe_docstring_ppl"]
    assert 0 <= mc["acc"] <= 1 and 0 <= mc["acc_norm"] <= 1
    assert math.isfinite(ppl["word_perplexity"]) and ppl["bits_per_byte"] > 0
    assert report.baseline is None and report.verdict == "unknown"
    own = json.loads((tmp_path / "lm_eval_results" / "quantized.json").read_text())
    assert own["results"]["qpe_docstring_mc"]["acc,none"] == mc["acc"]  # lm-eval's own JSON kept whole
    assert "requests" in report.estimate.data and "tokens/s" in report.estimate.basis
    # --limit given: a smoke run, no "hours" warning, but too few documents to resolve 2 %
    assert report.estimate.warning.startswith("--limit 6 is too small to resolve the healthy threshold")


def test_full_benchmark_estimate_warns_of_hours(tiny_llama):
    estimate = estimate_runtime(tiny_llama, lm_eval_options(limit=None))
    assert "hours" in estimate.warning and estimate.seconds > 0
    assert "qpe_docstring_mc: 24" in estimate.data  # every document counted without --limit


def test_tier2_with_baseline_compares_per_metric(quantized, tiny_llama, tmp_path):
    report = evaluate(
        quantized("nvfp4"),
        lm_eval_options(baseline=tiny_llama),
        tmp_path,
        FlagApprover(),
        source_model=tiny_llama,
    )
    assert report.details["loader"].startswith("quark")  # two-level scales: Quark's importer
    assert set(report.baseline) == set(TASKS)
    rows = {(c.task, c.metric): c for c in report.comparisons}
    assert rows[("qpe_docstring_ppl", "bits_per_byte")].higher_is_better is False
    assert rows[("qpe_docstring_mc", "acc")].higher_is_better is True
    assert all(c.compared_to == "baseline" for c in rows.values())
    # lm-eval's standard errors enter the verdict: 6 documents cannot resolve the 2 % threshold
    for metric in ("acc", "acc_norm"):
        row = rows[("qpe_docstring_mc", metric)]
        stderr = report.details["stderr"]
        half = 100 * 1.959963984540054 * math.hypot(
            stderr["quantized"]["qpe_docstring_mc"][metric], stderr["baseline"]["qpe_docstring_mc"][metric]
        ) / row.other
        assert row.ci95_pct == pytest.approx((row.degradation_pct - half, row.degradation_pct + half))
        assert row.verdict == "watch" and "too little data" in row.note
    assert rows[("qpe_docstring_ppl", "bits_per_byte")].ci95_pct is None  # lm-eval gives no stderr for it
    # Paired tests from lm-eval's logged samples: the discordant documents recounted from the files.
    per_doc = {label: json.loads((tmp_path / "lm_eval_results" / f"{label}.samples.json").read_text())
               for label in ("baseline", "quantized")}
    for metric in ("acc", "acc_norm"):
        base, ours = (per_doc[k]["qpe_docstring_mc"][metric] for k in ("baseline", "quantized"))
        assert len(base) == len(ours) == 6
        lost = sum(base[d] == 1 and ours[d] == 0 for d in base)
        gained = sum(base[d] == 0 and ours[d] == 1 for d in base)
        test = report.details["paired_tests"]["qpe_docstring_mc"][metric]
        assert (test["baseline_only"], test["scheme_only"], test["documents"]) == (lost, gained, 6)
        assert test["p_value"] == mcnemar(lost, gained)["mid_p_value"]
        assert test["mean"] == pytest.approx(report.quantized["qpe_docstring_mc"][metric])
    assert "qpe_docstring_ppl" not in report.details["paired_tests"]  # aggregate-only metrics: no paired test
    assert report.verdict == "watch"
    assert report.estimate.warning.startswith("--limit 6 is too small to resolve the healthy threshold")
    results = json.loads((tmp_path / "eval_results.json").read_text())
    assert set(results["baseline"]) == set(TASKS) and results["deltas"]
    assert (tmp_path / "lm_eval_results" / "baseline.json").is_file()
    assert (tmp_path / "eval_chart.png").is_file()


def test_unknown_task_is_refused_before_any_model_loads(tmp_path):
    unloadable = tmp_path / "model"  # a config but no weights: loading it would fail
    unloadable.mkdir()
    (unloadable / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="does not know the task"):
        evaluate(unloadable, lm_eval_options(tasks=["no_such_task_xyz"]), tmp_path, FlagApprover())
    with pytest.raises(UsageError, match="needs --tasks"):
        evaluate(unloadable, lm_eval_options(tasks=[]), tmp_path, FlagApprover())


def test_the_task_index_is_built_once_per_process_and_again_when_a_yaml_changes(tmp_path, monkeypatch):
    """lm-eval's TaskManager indexes ~15,000 YAMLs (8 s): a Tier 2 run asks for it once per model it scores.
    Here a TaskManager that counts its builds stands in for lm-eval's (the real one runs in every test above)."""
    from quark_ptq_eval.evaluate.lmeval import tasks

    built = []

    class Counting:
        def __init__(self, include_path):
            built.append(include_path)

    monkeypatch.setattr(tasks, "_import_lm_eval", lambda: (None, Counting))
    tasks._indexed.cache_clear()
    ours = tmp_path / "tasks"
    ours.mkdir()
    (ours / "a.yaml").write_text("task: a\n")
    try:
        first = tasks.task_manager(ours)
        assert tasks.task_manager(ours) is first and tasks.task_manager(None) is tasks.task_manager(None)
        assert built == [str(ours), None]
        (ours / "a.yaml").write_text("task: a2\n")  # an edited task: a new index
        assert tasks.task_manager(ours) is not first and built[-1] == str(ours)
        (ours / "sub").mkdir()
        (ours / "sub" / "b.yml").write_text("task: b\n")  # an added one, at any depth
        tasks.task_manager(ours)
        assert len(built) == 4
        with pytest.raises(UsageError, match="is not a directory"):
            tasks.task_manager(tmp_path / "missing")
    finally:
        tasks._indexed.cache_clear()  # the other tests' real index is built afresh


@pytest.mark.parametrize(("b", "c"), [(0, 0), (5, 0), (0, 5), (3, 1), (7, 7), (2, 11), (40, 25), (130, 100)])
def test_mcnemar_is_the_exact_binomial_test_on_discordant_pairs(b, c):
    ours = mcnemar(b, c)
    n, k = b + c, min(b, c)
    stats = pytest.importorskip("scipy.stats")
    exact = stats.binomtest(k, n, 0.5).pvalue if n else 1.0
    mid = min(1.0, 2 * stats.binom.cdf(k, n, 0.5) - stats.binom.pmf(k, n, 0.5)) if n else 1.0
    assert ours["p_value"] == pytest.approx(exact, rel=1e-9, abs=1e-300)
    assert ours["mid_p_value"] == pytest.approx(mid, rel=1e-9, abs=1e-300)


def test_mcnemar_by_hand():
    # 5 discordant pairs all one way: exact two-sided p = 2 / 2^5, mid-p half of that.
    assert mcnemar(5, 0) == {"p_value": 2 / 32, "mid_p_value": 1 / 32}
    # 3 vs 1: P(X <= 1) = (1 + 4) / 16; exact 10/16, mid-p 10/16 - 4/16.
    assert mcnemar(3, 1) == {"p_value": 10 / 16, "mid_p_value": 6 / 16}
    assert mcnemar(4, 4)["mid_p_value"] == 1.0 and mcnemar(0, 0)["p_value"] == 1.0


def test_paired_bootstrap_against_the_paired_t_test():
    import random

    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(1)
    base = [rng.gauss(0, 1) for _ in range(400)]
    for shift, noise in ((0.0, 1.0), (0.12, 1.0), (0.5, 1.0)):
        ours = [x + shift + rng.gauss(0, noise) for x in base]
        p_t = stats.ttest_rel(ours, base).pvalue
        p_boot = paired_bootstrap(base, ours)
        assert abs(p_boot - p_t) < 0.02 + 0.15 * p_t, (shift, p_boot, p_t)  # same answer at large n
    assert paired_bootstrap([1.0, 2.0], [1.0, 2.0]) == 1.0  # no difference at all
    assert paired_bootstrap([1.0, 2.0], [2.0, 3.0]) == 1 / 10_001  # the same difference on every document


def test_paired_tests_pick_the_test_by_the_scores():
    logged = {"t": [{"doc_id": i, "filter": "none", "metrics": ["acc", "f1", "ppl"], "acc": float(a),
                     "f1": f, "ppl": (1.0, 2)} for i, (a, f) in enumerate([(1, 0.5), (0, 0.25), (1, 0.75)])]}
    base = per_sample_scores(logged)
    assert set(base["t"]) == {"acc", "f1"}  # a (loglikelihood, length) pair has no per-document score
    ours = {"t": {"acc": {"0": 0.0, "1": 0.0, "2": 1.0}, "f1": {"0": 0.5, "1": 0.5, "2": 0.75}}}
    tests = paired_tests(base, ours, {"t": {"acc": True}})
    acc, f1 = tests["t"]["acc"], tests["t"]["f1"]
    assert acc["test"].startswith("McNemar") and (acc["baseline_only"], acc["scheme_only"]) == (1, 0)
    assert acc["p_value"] == mcnemar(1, 0)["mid_p_value"] and acc["significant"] is False
    assert f1["test"].startswith("paired bootstrap") and 0 < f1["p_value"] <= 1 and acc["higher_is_better"] is True
