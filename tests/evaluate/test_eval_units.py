"""Fast checks of the evaluation pieces that need no model: verdicts, references, CLI, registry."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from quark_ptq_eval.base.errors import CheckpointPending, UsageError
from quark_ptq_eval.base.gates import FlagApprover
from quark_ptq_eval.base.options import given
from quark_ptq_eval.evaluate import (
    TIERS,
    EvalOptions,
    Thresholds,
    add_eval_arguments,
    cmd_eval,
    eval_options_from_args,
)
from quark_ptq_eval.evaluate.reference import align_scale, model_card_reference, parse_reference
from quark_ptq_eval.evaluate.remedies import suggest_remedies
from quark_ptq_eval.evaluate.verdict import compare_all, compare_metric, overall_verdict
from quark_ptq_eval.runtime.loading import QUARK, TRANSFORMERS, choose_loader

HEAVY = ("torch", "transformers", "quark", "lm_eval", "datasets", "matplotlib")


def test_importing_evaluate_pulls_in_no_heavy_library():
    code = f"import sys, quark_ptq_eval.evaluate; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == ""


def test_registry_holds_the_three_tiers_the_speed_tier_and_skip():
    assert list(TIERS) == ["ppl", "lm_eval", "vllm", "speed", "skip"]
    assert [t.number for t in TIERS.values()] == ["1", "2", "3", "speed", "-"]
    assert TIERS["skip"].runner is None and all(TIERS[n].runner for n in ("ppl", "lm_eval", "vllm", "speed"))


@pytest.mark.parametrize(
    ("metric", "value", "other", "verdict"),
    [
        ("perplexity", 10.1, 10.0, "healthy"),  # 1 % higher perplexity
        ("perplexity", 10.3, 10.0, "watch"),
        ("perplexity", 11.0, 10.0, "hurt"),
        ("perplexity", 9.0, 10.0, "healthy"),  # lower perplexity is better, never "hurt"
        ("acc", 0.60, 0.61, "healthy"),
        ("acc", 0.50, 0.61, "hurt"),  # accuracy falls: hurt
        ("acc", 0.70, 0.61, "healthy"),
        ("bits_per_byte", 1.2, 1.0, "hurt"),
    ],
)
def test_verdicts_are_direction_aware(metric, value, other, verdict):
    row = compare_metric("t", metric, value, other, None, metric == "acc", Thresholds())
    assert row.verdict == verdict and row.compared_to == "baseline"


def test_thresholds_are_configurable_and_checked():
    loose = Thresholds(healthy_pct=15, hurt_pct=20)
    assert compare_metric("t", "perplexity", 11.0, 10.0, None, False, loose).verdict == "healthy"
    with pytest.raises(UsageError):
        Thresholds(healthy_pct=6, hurt_pct=5)


def test_baseline_wins_over_reference_and_none_gives_unknown():
    rows = compare_all(
        {"gsm8k": {"exact_match,flexible-extract": 0.5}},
        {"gsm8k": {"exact_match,flexible-extract": 0.5}},
        {"gsm8k": {"exact_match": 0.9}},
        {},
        Thresholds(),
    )
    assert rows[0].compared_to == "baseline" and rows[0].verdict == "healthy"
    rows = compare_all(
        {"gsm8k": {"exact_match,flexible-extract": 0.5}},
        None,
        {"gsm8k": {"exact_match": 0.9}},
        {},
        Thresholds(),
    )
    assert rows[0].compared_to == "reference" and rows[0].verdict == "hurt"  # base metric name matches
    rows = compare_all({"gsm8k": {"acc": 0.5}}, None, {}, {}, Thresholds())
    assert rows[0].verdict == "unknown" and overall_verdict(rows) == "unknown"


def test_kl_is_judged_against_zero():
    assert (
        compare_metric("perplexity", "kl_divergence", 0.001, None, None, False, Thresholds()).verdict
        == "healthy"
    )
    assert (
        compare_metric("perplexity", "kl_divergence", 0.2, None, None, False, Thresholds()).verdict == "hurt"
    )


def test_reference_parsing_and_percent_alignment():
    ref = parse_reference(["gsm8k:exact_match,flexible-extract=62.5", "arc_easy:acc=0.7"])
    assert ref == {"gsm8k": {"exact_match,flexible-extract": 62.5}, "arc_easy": {"acc": 0.7}}
    notes = align_scale(ref, {"gsm8k": {"exact_match,flexible-extract": 0.6}})
    assert ref["gsm8k"]["exact_match,flexible-extract"] == pytest.approx(0.625) and notes
    for bad in ["gsm8k=0.5", "gsm8k:acc=high", "gsm8k:acc"]:
        with pytest.raises(UsageError):
            parse_reference([bad])


def test_model_card_model_index_is_read(tmp_path):
    (tmp_path / "README.md").write_text(
        "---\nlicense: mit\nmodel-index:\n- name: m\n  results:\n  - task: {type: text-generation}\n"
        "    dataset: {name: GSM8K, type: gsm8k}\n    metrics:\n    - {type: exact_match, value: 61.2}\n"
        "  - task: {type: text-generation}\n    dataset: {name: ARC, type: arc_easy}\n"
        "    metrics:\n    - {type: acc, value: 0.8, name: accuracy}\n---\n# card\n"
    )
    assert model_card_reference(tmp_path) == {"gsm8k": {"exact_match": 61.2}, "arc_easy": {"acc": 0.8}}
    (tmp_path / "README.md").write_text("---\nmodel-index: [unclosed\n---\n")
    assert model_card_reference(tmp_path) == {}
    assert model_card_reference(tmp_path / "absent") == {}


def test_loader_is_chosen_from_the_quantization_config():
    single = {
        "quantization_config": {"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "int8"}}}
    }
    two_level = {
        "quantization_config": {
            "quant_method": "quark",
            "global_quant_config": {
                "weight": [{"dtype": "fp4"}, {"dtype": "fp8_e4m3", "is_scale_quant": True}]
            },
        }
    }
    layer_two_level = {
        "quantization_config": {
            "quant_method": "quark",
            "global_quant_config": {},
            "layer_quant_config": {"*mlp*": {"weight": [{}, {}]}},
        }
    }
    assert choose_loader({})[0] == TRANSFORMERS
    assert choose_loader(single)[0] == TRANSFORMERS
    assert choose_loader(two_level)[0] == QUARK and choose_loader(layer_two_level)[0] == QUARK
    assert choose_loader({"quantization_config": {"quant_method": "gptq"}})[0] == TRANSFORMERS


def test_remedies_follow_the_plan():
    bare = suggest_remedies(
        {
            "global_scheme": "int4_wo_128",
            "algorithm": None,
            "exclude_layers": ["lm_head"],
            "calibration": {"num_samples": 128},
        },
        num_layers=32,
    )
    text = " ".join(bare)
    assert "awq" in text and "down_proj" in text and "model.layers.31.*" in text and "512" in text
    assert "int8" in text  # a wider format for int4
    tried = suggest_remedies(
        {
            "global_scheme": "fp8",
            "algorithm": "smoothquant",
            "exclude_layers": ["lm_head", "*down_proj", "model.layers.0.*"],
            "calibration": {"num_samples": 1024},
        }
    )
    joined = " ".join(tried)
    assert (
        "already uses smoothquant" in joined
        and "Exclude the first" not in joined
        and "more data" not in joined
    )


def _parser(standalone: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    if not standalone:  # `run` already owns these (calibration); eval options must not clash
        parser.add_argument("--batch-size", type=int)
        parser.add_argument("--device")
        parser.add_argument("--trust-remote-code", action="store_true", default=None)
    add_eval_arguments(parser, standalone=standalone)
    return parser


def test_cli_options_for_eval_and_for_run(tmp_path):
    args = _parser(True).parse_args(
        [
            "--quantized",
            str(tmp_path),
            "--tier",
            "ppl",
            "--seq-len",
            "128",
            "--batch-size",
            "4",
            "--device",
            "cpu",
            "--baseline",
            "--reference",
            "perplexity:perplexity=12.5",
            "--healthy-pct",
            "1",
            "--hurt-pct",
            "3",
        ]
    )
    options = eval_options_from_args(args)
    assert isinstance(options, EvalOptions)
    assert (options.tier, options.seq_len, options.batch_size, options.device) == ("ppl", 128, 4, "cpu")
    assert str(options.baseline) == "<source>" and options.reference == {"perplexity": {"perplexity": 12.5}}
    assert (options.thresholds.healthy_pct, options.thresholds.hurt_pct) == (1, 3)
    run_args = _parser(False).parse_args(
        [
            "--batch-size",
            "8",
            "--eval-tier",
            "lm_eval",
            "--eval-batch-size",
            "2",
            "--tasks",
            "arc_easy, gsm8k",
            "--limit",
            "10",
        ]
    )
    explicit = given(EvalOptions, run_args).values  # what `run` keeps: the fields given, not the defaults
    assert explicit == {"batch_size": 2, "tasks": ["arc_easy", "gsm8k"], "limit": 10.0, "tier": "lm_eval"}
    assert run_args.batch_size == 8  # the calibration batch size is untouched


def test_eval_still_takes_model_for_quantized_and_says_it_is_deprecated(tmp_path, capsys):
    args = _parser(True).parse_args(["--model", str(tmp_path), "--tier", "ppl"])
    assert args.quantized == tmp_path
    assert capsys.readouterr().err == "--model is deprecated: use --quantized\n"
    assert _parser(True).parse_args(["--quantized", str(tmp_path)]).quantized == tmp_path
    assert capsys.readouterr().err == ""


def test_cmd_eval_without_a_tier_stops_at_the_checkpoint(tmp_path):
    args = _parser(True).parse_args(["--quantized", str(tmp_path)])
    args.workdir = tmp_path
    with pytest.raises(CheckpointPending) as stopped:
        cmd_eval(args, FlagApprover())
    assert "--tier" in stopped.value.hint and stopped.value.exit_code == 3


def test_skip_writes_a_report_and_runs_nothing(tmp_path):
    from quark_ptq_eval.evaluate import evaluate

    report = evaluate(tmp_path / "not-needed", EvalOptions(tier="skip"), tmp_path / "work", FlagApprover())
    assert report.verdict == "unknown" and report.quantized == {}
    assert "skipped" in (tmp_path / "work" / "eval_report.md").read_text()


def test_unknown_tier_and_bad_seq_len_are_usage_errors(tmp_path):
    from quark_ptq_eval.evaluate import evaluate

    with pytest.raises(UsageError, match="Unknown evaluation tier"):
        evaluate(tmp_path, EvalOptions(tier="tier9"), tmp_path, FlagApprover())
    with pytest.raises(UsageError):
        EvalOptions(seq_len=1)
    with pytest.raises(UsageError, match="config.json"):
        evaluate(tmp_path, EvalOptions(tier="ppl"), tmp_path / "w", FlagApprover())


def test_baseline_flag_without_path_needs_the_source(tmp_path):
    from quark_ptq_eval.evaluate import evaluate

    with pytest.raises(UsageError, match="--baseline SRC"):
        evaluate(tmp_path, EvalOptions(tier="ppl", baseline=Path("<source>")), tmp_path, FlagApprover())


def test_report_files_for_lm_eval_scores(tmp_path):
    import json

    from quark_ptq_eval.evaluate import api
    from quark_ptq_eval.evaluate import report as report_files
    from quark_ptq_eval.evaluate.context import TierInputs, TierOutcome

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 4}')
    outcome = TierOutcome(
        quantized={"arc_easy": {"acc": 0.50, "acc_norm": 0.55}},
        baseline={"arc_easy": {"acc": 0.60, "acc_norm": 0.555}},
        directions={"arc_easy": {"acc": True, "acc_norm": True}},
        details={
            "stderr": {"quantized": {"arc_easy": {"acc": 0.02}}},
            "noise": {"arc_easy": {"acc": {"stderr": 0.02}}},
        },
    )
    plan = {
        "global_scheme": "mxfp4",
        "algorithm": None,
        "exclude_layers": ["lm_head"],
        "calibration": {"num_samples": 128},
    }
    ctx = TierInputs(model, EvalOptions(tier="lm_eval"), tmp_path / "work", FlagApprover(), plan=plan)
    report = api.build_report(ctx, outcome, None, 12.0)
    report_files.write_all(report)
    assert report.verdict == "hurt" and {c.verdict for c in report.comparisons} == {"hurt", "healthy"}
    assert any("model.layers.3.*" in r for r in report.remedies) and any(
        "mxfp6" in r for r in report.remedies
    )
    text = report.report_path.read_text()
    # 16.67 % worse, +-100 * 1.96 * 0.02 / 0.6 = 6.53 %: beyond noise and past the hurt threshold
    assert (
        "| arc_easy | acc | 0.5000 | baseline | 0.6000 | +16.67 % | +10.13 % … +23.20 % | beyond noise | hurt |"
        in text
    )
    assert "| arc_easy | acc_norm | 0.5500 | baseline | 0.5550 | +0.90 % | - | - | healthy |" in text
    assert "Standard errors" in text and "## Remedies" in text
    results = json.loads(report.results_path.read_text())
    assert results["quantized"] == outcome.quantized and results["baseline"] == outcome.baseline
    assert results["verdict"] == "hurt" and len(results["deltas"]) == 2
    assert report.chart_path.read_bytes()[:4] == b"\x89PNG"


def test_estimate_spans_the_whole_wait_and_the_kl_histogram_keeps_every_token(tmp_path):
    """The announced total = measured part + predicted rest; the report's ratio uses that total;
    every per-token KL lands in a histogram bin (the extremes too) or in the zero count."""
    import torch

    from quark_ptq_eval.evaluate import report as report_files
    from quark_ptq_eval.evaluate.context import SPAN, RuntimeEstimate
    from quark_ptq_eval.evaluate.ppl import tier as tier_ppl

    estimate = RuntimeEstimate("1 (ppl)", 30.0, "CPU", 2**20, "1 window", "pilot", elapsed_s=12.0, finish_s=1.0,
                               parts={"load": 9.0, "pilot": 2.5})
    assert estimate.total_s == 43.0 and not estimate.long  # long is judged on what approving costs: 30 s
    assert "about 43 s from approval to report (12.0 s spent: load 9.0 s, pilot 2.5 s; about 31 s left)" in (
        estimate.summary())
    report = SimpleNamespace(estimate=estimate, actual_s=40.0)
    runtime = report_files.runtime_document(report)
    assert runtime["span"] == SPAN and runtime["estimated_s"] == 43.0
    assert runtime["estimated_over_actual"] == pytest.approx(43.0 / 40.0)
    acc = tier_ppl.Accumulator(window_nll=[2.0, 2.5], base_window_nll=[1.9, 2.6])
    acc.kl_values = [torch.tensor([0.0, 1e-12, 3e-5, 0.2, 0.7], dtype=torch.double)]
    dist = tier_ppl.distribution(acc)
    assert dist["window_nll_delta"] == pytest.approx([0.1, -0.1])
    hist = dist["token_kl_histogram"]
    assert hist["zero"] == 1 and sum(hist["counts"]) == 4 and hist["edges"][-1] == 0.7
    assert hist["edges"][0] == pytest.approx(0.7e-8)  # at most 8 decades: 1e-12 is counted in the first bin
