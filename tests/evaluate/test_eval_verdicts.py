"""Verdicts that survive broken numbers: invalid metrics, overflow, sampling noise, device clocks.

The fast tests here need no model; the slow ones plant faults into real Quark exports of the tiny
model and compute KL / top-1 independently with plain torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.gates import FlagApprover
from quark_ptq_eval.evaluate import EvalOptions, Thresholds
from quark_ptq_eval.evaluate.reference import model_card_reference, parse_reference
from quark_ptq_eval.evaluate.verdict import (
    WITHIN_NOISE,
    Z95,
    Observed,
    TierEvidence,
    compare_all,
    invalid_reasons,
    judge_metric,
    overall_verdict,
)

NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------- 8: missing / non-finite


@pytest.mark.parametrize(
    ("quantized", "baseline", "named"),
    [
        ({"t": {"acc": NAN, "acc_norm": 0.6}}, {"t": {"acc": 0.6, "acc_norm": 0.6}}, "t:acc is not a number"),
        ({"t": {"acc": 0.6}}, {"t": {"acc": 0.6, "acc_norm": 0.6}}, "t:acc_norm is missing"),
        ({"t": {"acc": 0.6, "acc_norm": 0.6}}, {"t": {"acc": NAN, "acc_norm": 0.6}}, "baseline value is not"),
        ({"t": {"acc": INF, "acc_norm": 0.6}}, {"t": {"acc": 0.6, "acc_norm": 0.6}}, "t:acc is not finite"),
    ],
)
def test_a_missing_or_non_finite_metric_makes_the_whole_verdict_invalid(quantized, baseline, named):
    rows = compare_all(quantized, baseline, {}, {"t": {"acc": True, "acc_norm": True}}, Thresholds())
    healthy = [r for r in rows if r.verdict == "healthy"]
    assert healthy, "the other metric is healthy: invalid must win over it"
    assert overall_verdict(rows) == "invalid"
    assert any(named in reason for reason in invalid_reasons(rows))


def test_a_required_metric_that_never_came_back_is_invalid():
    rows = compare_all({"a": {"acc": 0.5}}, None, {"a": {"acc": 0.5}}, {}, Thresholds(),
                       TierEvidence(required={"b": ["results"]}))
    assert overall_verdict(rows) == "invalid"
    assert invalid_reasons(rows) == ["b:results is missing from the quantized results"]


def test_a_nan_informational_metric_is_invalid_too():
    rows = compare_all({"perplexity": {"perplexity": 10.0, "top1_agreement": NAN}},
                       {"perplexity": {"perplexity": 10.0}}, {}, {}, Thresholds())
    assert overall_verdict(rows) == "invalid" and "top1_agreement" in invalid_reasons(rows)[0]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_a_non_finite_reference_is_refused(value):
    with pytest.raises(UsageError, match="non-finite value"):
        parse_reference([f"perplexity:perplexity={value}"])


def test_a_non_finite_reference_exits_2_with_one_sentence(tmp_path, capsys):
    from quark_ptq_eval.cli.main import main

    rc = main(["eval", "--quantized", str(tmp_path), "--workdir", str(tmp_path), "--tier", "ppl",
               "--reference", "perplexity:perplexity=nan"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.strip() == (
        "error: --reference 'perplexity:perplexity=nan' has the non-finite value nan: "
        "give the published score as a finite number."
    )
    assert not (tmp_path / "eval_results.json").exists()


def test_a_non_finite_model_card_score_is_no_reference(tmp_path):
    (tmp_path / "README.md").write_text(
        "---\nmodel-index:\n- name: m\n  results:\n  - dataset: {type: gsm8k}\n"
        "    metrics:\n    - {type: exact_match, value: .nan}\n    - {type: acc, value: 0.5}\n---\n"
    )
    assert model_card_reference(tmp_path) == {"gsm8k": {"acc": 0.5}}


def test_invalid_report_names_the_metric(tmp_path):
    from quark_ptq_eval.evaluate import api
    from quark_ptq_eval.evaluate import report as report_files
    from quark_ptq_eval.evaluate.context import TierInputs, TierOutcome

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    outcome = TierOutcome(
        quantized={"perplexity": {"perplexity": NAN, "kl_divergence": 0.001, "top1_agreement": 0.99}},
        baseline={"perplexity": {"perplexity": 20.0}},
        directions={"perplexity": {"perplexity": False, "kl_divergence": False, "top1_agreement": True}},
        informational=("top1_agreement",),
    )
    report = api.build_report(TierInputs(model, EvalOptions(), tmp_path, FlagApprover()), outcome, None, 1.0)
    report_files.write_all(report)
    assert report.verdict == "invalid" and report.remedies == []
    text = report.report_path.read_text()
    assert "**Verdict: invalid** — a metric is missing or not a number" in text
    assert "perplexity:perplexity is not a number (NaN)" in text
    results = json.loads(report.results_path.read_text())
    assert results["verdict"] == "invalid" and results["quantized"]["perplexity"]["perplexity"] is None


# ---------------------------------------------------------------- 9: overflow-safe


def test_an_overflowing_perplexity_or_kl_is_hurt_not_a_traceback():
    row = judge_metric("perplexity", "perplexity", Observed(INF, 20.0, None,
                         {"paired_log_delta": 1e30, "paired_log_stderr": 1e28}), False, Thresholds())
    assert (row.verdict, row.degradation_pct, row.ci95_pct) == ("hurt", INF, (INF, INF))
    kl = judge_metric("perplexity", "kl_divergence", Observed(1e30, None, None, {"stderr": 1e29}), False, Thresholds())
    assert kl.verdict == "hurt" and kl.degradation_pct == INF


def test_token_stats_stay_finite_where_float32_overflows():
    """Logits of +-3e38 are finite float32, but their differences (log-probabilities) are not."""
    import torch

    from quark_ptq_eval.evaluate.ppl.tier import token_stats

    gen = torch.Generator().manual_seed(0)
    logits = (torch.rand(2, 5, 7, generator=gen) * 2 - 1) * 3e38
    base = torch.randn(2, 5, 7, generator=gen)
    labels = torch.randint(0, 7, (2, 5), generator=gen)
    assert not torch.isfinite(torch.log_softmax(logits, -1)).all()  # the float32 way overflows
    stats = token_stats(logits, labels, base)
    log_q, log_b = torch.log_softmax(logits.double(), -1), torch.log_softmax(base.double(), -1)
    expected_nll = -log_q.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    expected_kl = (log_b.exp() * (log_b - log_q)).sum(-1)
    assert torch.isfinite(stats["nll"]).all() and torch.isfinite(stats["kl"]).all()
    assert torch.allclose(stats["nll"], expected_nll, rtol=1e-12)
    assert torch.allclose(stats["kl"], expected_kl, rtol=1e-12)
    assert torch.equal(stats["top1"], logits.argmax(-1) == base.argmax(-1))


def test_perplexity_stats_report_inf_with_the_finite_nll():
    from quark_ptq_eval.evaluate.ppl.tier import perplexity_stats

    stats = perplexity_stats([1e30, 2e30], 127)
    assert stats["perplexity"] == INF and stats["mean_nll"] == pytest.approx(1.5e30)


# ---------------------------------------------------------------- 10: sampling noise


def test_a_difference_within_the_paired_interval_is_within_noise_and_healthy_when_resolved():
    # perplexity 1 % worse, paired log-ratio interval +-0.5 %: resolved, within the healthy 2 %
    delta = math.log(1.01)
    row = judge_metric("p", "perplexity", Observed(10.1, 10.0, None,
                         {"paired_log_delta": delta, "paired_log_stderr": 0.005 / Z95}), False, Thresholds())
    assert row.verdict == "healthy" and row.noise == "beyond noise"
    low, high = row.ci95_pct
    assert low == pytest.approx(100 * math.expm1(delta - 0.005)) and high == pytest.approx(100 * math.expm1(delta + 0.005))
    row = judge_metric("p", "perplexity", Observed(10.01, 10.0, None,
                         {"paired_log_delta": math.log(1.001), "paired_log_stderr": 0.003}), False, Thresholds())
    assert row.verdict == "healthy" and row.noise == WITHIN_NOISE


def test_a_noisy_difference_is_neither_healthy_nor_hurt():
    # 10 % worse but the interval holds 0: within noise, so "watch", not "hurt"
    row = judge_metric("t", "acc", Observed(0.45, 0.5, None, {"stderr": 0.05, "baseline_stderr": 0.05}), True, Thresholds())
    assert row.noise == WITHIN_NOISE and row.verdict == "watch" and "too little data to call it hurt" in row.note
    # equal scores, but an interval of +-28 %: too little data to call it healthy
    row = judge_metric("t", "acc", Observed(0.5, 0.5, None, {"stderr": 0.05, "baseline_stderr": 0.05}), True, Thresholds())
    assert row.verdict == "watch" and "too little data to call it healthy" in row.note
    # the same 10 % drop with small standard errors: beyond noise, hurt
    row = judge_metric("t", "acc", Observed(0.45, 0.5, None, {"stderr": 0.002, "baseline_stderr": 0.002}), True, Thresholds())
    assert row.noise == "beyond noise" and row.verdict == "hurt"
    half = 100 * Z95 * math.hypot(0.002, 0.002) / 0.5
    assert row.ci95_pct == pytest.approx((10 - half, 10 + half))


def test_a_reference_comparison_uses_only_the_measured_noise():
    row = judge_metric("t", "acc", Observed(0.45, None, 0.5, {"stderr": 0.002, "baseline_stderr": 0.5}), True, Thresholds())
    half = 100 * Z95 * 0.002 / 0.5
    assert row.compared_to == "reference" and row.ci95_pct == pytest.approx((10 - half, 10 + half))


def test_lm_eval_standard_errors_enter_the_tier2_verdict(tmp_path):
    from quark_ptq_eval.evaluate import api
    from quark_ptq_eval.evaluate.context import TierInputs, TierOutcome
    from quark_ptq_eval.evaluate.lmeval.tier import noise_from_stderr, scores_from

    def results(acc, se):
        return {"results": {"arc": {"alias": "arc", "acc,none": acc, "acc_stderr,none": se}},
                "higher_is_better": {"arc": {"acc": True}}}

    q, q_se, directions = scores_from(results(0.45, 0.05))
    b, b_se, _ = scores_from(results(0.50, 0.05))
    assert q_se == {"arc": {"acc": 0.05}}
    outcome = TierOutcome(quantized=q, baseline=b, directions=directions,
                          details={"noise": noise_from_stderr(q_se, b_se)})
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    report = api.build_report(TierInputs(model, EvalOptions(tier="lm_eval"), tmp_path, FlagApprover()),
                               outcome, None, 1.0)
    assert report.verdict == "watch"  # 10 % worse without the noise: "hurt"
    assert report.comparisons[0].noise == WITHIN_NOISE


def test_a_limit_too_small_to_resolve_the_threshold_is_said_before_running():
    from quark_ptq_eval.evaluate.lmeval.tier import LmEvalWorkload, resolution_warning

    workload = LmEvalWorkload(per_task={"a": 6, "b": 30000})
    warning = resolution_warning(workload, EvalOptions(tier="lm_eval", limit=6, baseline=Path("src")))
    assert warning.startswith("--limit 6 is too small to resolve the healthy threshold: with 6 documents")
    assert "±113 %" in warning and "19,208 documents per task" in warning
    assert resolution_warning(LmEvalWorkload(per_task={"a": 10000}), EvalOptions(limit=10000)) is None
    assert resolution_warning(workload, EvalOptions(limit=None)) is None


# ---------------------------------------------------------------- 11: device clock


def test_timing_synchronises_the_device_before_reading_the_clock(monkeypatch):
    import torch

    from quark_ptq_eval.evaluate.lmeval import tier as tier_lmeval
    from quark_ptq_eval.evaluate.ppl import tier as tier_ppl

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    tier_ppl.synchronize("cpu")
    assert calls == []
    tier_ppl.synchronize("cuda:1")
    assert calls == ["cuda:1"]
    seconds = tier_lmeval._clock("cuda")
    assert calls == ["cuda:1", "cuda"] and seconds > 0


# ---------------------------------------------------------------- real exports (slow)


@pytest.fixture(scope="module")
def eval_text(corpus, tmp_path_factory) -> Path:
    text = corpus.read_text(encoding="utf-8")
    path = tmp_path_factory.mktemp("verdict-text") / "eval.txt"
    path.write_text(text[len(text) // 2 : len(text) // 2 + 12_000], encoding="utf-8")
    return path


def scale_tensor(model_dir: Path, name: str, factor: float) -> None:
    from safetensors.torch import load_file, save_file

    (shard,) = [s for s in model_dir.glob("*.safetensors") if name in load_file(s)]
    tensors = load_file(shard)
    tensors[name] = tensors[name] * factor
    save_file(tensors, shard, metadata={"format": "pt"})


@pytest.mark.slow
def test_a_badly_broken_export_is_hurt_with_its_numbers(quantized, copy_model, tiny_llama, eval_text, capsys):
    """lm_head x 1e30 in a real int8 export: logits near 1e30, whose exp() overflows any float."""
    from quark_ptq_eval.cli.main import main

    broken = copy_model(quantized("int8"), "huge-lm-head")
    scale_tensor(broken, "lm_head.weight", 1e30)
    work = broken.parent / "work"
    rc = main(["eval", "--quantized", str(broken), "--source", str(tiny_llama), "--baseline", "--tier", "ppl",
               "--workdir", str(work), "--eval-data", str(eval_text), "--seq-len", "128",
               "--max-windows", "8", "--device", "cpu"])
    assert rc == 0 and "Traceback" not in capsys.readouterr().err
    results = json.loads((work / "eval_results.json").read_text())
    assert results["verdict"] == "hurt"
    stats, kl, paired = results["details"]["quantized"], results["details"]["kl"], results["details"]["paired"]
    assert 1e25 < stats["mean_nll"] < 1e35 and results["quantized"]["perplexity"]["perplexity"] is None  # inf
    assert 1e25 < kl["kl_divergence"] < 1e35 and 0 <= kl["top1_agreement"] <= 1
    assert paired["delta_nll"] > 1e25 and paired["noise"] == "beyond noise"
    rows = {row["metric"]: row for row in results["deltas"]}
    assert rows["perplexity"]["verdict"] == rows["kl_divergence"]["verdict"] == "hurt"
    text = (work / "eval_report.md").read_text()
    assert "| perplexity | perplexity | inf | baseline |" in text and "+inf %" in text
    assert f"NLL {stats['mean_nll']:.6g}" in text


def test_resolution_is_projected_from_the_spread_of_the_windows():
    from quark_ptq_eval.evaluate.ppl.tier import resolution_pct

    values = [0.1, -0.1, 0.3, -0.3]  # sample standard deviation 0.2582
    sd = math.sqrt(sum(v * v for v in values) / 3)
    assert resolution_pct(values, 100) == pytest.approx(100 * math.expm1(Z95 * sd / 10))
    assert resolution_pct([0.5], 100) is None


@pytest.mark.slow
def test_too_few_windows_for_the_threshold_are_said_at_the_checkpoint(tiny_llama, eval_text):
    from quark_ptq_eval.evaluate import estimate_runtime

    options = EvalOptions(tier="ppl", eval_data=eval_text, seq_len=128, max_windows=4, device="cpu",
                          batch_size=2, reference={"perplexity": {"perplexity": 30.0}})
    warning = estimate_runtime(tiny_llama, options).warning
    assert warning.startswith("4 windows are too few to resolve the healthy threshold: the pilot's per-window")
    assert "windows would resolve it" in warning
    assert estimate_runtime(tiny_llama, EvalOptions(**{**options.__dict__, "reference": {}})).warning is None


def test_the_python_api_refuses_a_non_finite_reference_too():
    with pytest.raises(UsageError, match="perplexity:perplexity=inf is not a finite number"):
        EvalOptions(reference={"perplexity": {"perplexity": INF}})
