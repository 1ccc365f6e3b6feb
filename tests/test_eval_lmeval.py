"""Tier 2: lm-eval on local task YAMLs (multiple choice + rolling perplexity), in-memory model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quark_ptq_eval.checkpoints import FlagApprover
from quark_ptq_eval.errors import UsageError
from quark_ptq_eval.evaluate import EvalOptions, estimate_runtime, evaluate

pytestmark = pytest.mark.slow
TASKS_DIR = Path(__file__).parent / "data" / "eval_tasks"
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
