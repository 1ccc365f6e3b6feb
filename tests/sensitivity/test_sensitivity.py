"""Sensitivity scan on the tiny demo model: real Quark fake-quant, real KL, checked independently.

One scan (int4 weight-only, group 32) is shared by the module. The independent check quantizes
a fresh copy of the model with Quark's public API, excluding every layer but the one measured,
and compares full forward passes: it shares nothing with the scan's toggling and replay.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

SCHEME = "int4_wo_32"
SAMPLES, SEQ = 4, 64


@pytest.fixture(scope="module")
def scan_setup(tmp_path_factory, tiny_llama, corpus):
    from quark_ptq_eval.sensitivity import ScanOptions

    root = tmp_path_factory.mktemp("sens")

    def options(cache: str = "cache", **kw) -> ScanOptions:
        return ScanOptions(model_dir=tiny_llama, scheme=SCHEME, calib_data=corpus, num_samples=SAMPLES,
                           seq_len=SEQ, cache_root=root / cache, **kw)

    return root, options


@pytest.fixture(scope="module")
def scanned(scan_setup):
    """The scan plus a proposal for a budget half the whole-model KL (so something must be kept)."""
    from quark_ptq_eval.sensitivity import run_sensitivity, scan

    root, options = scan_setup
    result, _ = scan(options())
    budget = result["whole_model_kl"] / 2
    messages: list[str] = []
    done = run_sensitivity(options(), root / "out", max_kl=budget, progress=messages.append)
    return result, done, budget, messages


def independent_kl(model_dir: Path, corpus: Path, quantized: set[str], layer_config: dict | None = None) -> float:
    """KL(unquantized || model with only ``quantized`` layers quantized), all by Quark's public API."""
    import torch
    from quark.torch import LLMTemplate, ModelQuantizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quark_ptq_eval.base.textdata import load_texts
    from quark_ptq_eval.execute.quark_api_parts import calibration_batches

    tok = AutoTokenizer.from_pretrained(model_dir)
    batches = calibration_batches(tok, load_texts(corpus), SEQ, SAMPLES, 1, "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    with torch.no_grad():
        ref = [model(b).logits.float().log_softmax(-1) for b in batches]
        config = LLMTemplate.get("llama").get_config(scheme=SCHEME, exclude_layers=sorted(linears - quantized),
                                                     layer_config=layer_config)
        model = ModelQuantizer(config).quantize_model(model, batches)
        total = sum(float((r.exp() * (r - model(b).logits.float().log_softmax(-1))).sum()) for b, r in
                    zip(batches, ref, strict=True))
    return total / sum(r.shape[0] * r.shape[1] for r in ref)


def test_every_layer_gets_a_finite_non_negative_kl(scanned):
    result, _, _, _ = scanned
    layers = result["layers"]
    assert len(layers) == 14  # 7 linears x 2 blocks; lm_head is excluded by Quark's llama template
    assert all(math.isfinite(r["kl"]) and r["kl"] >= 0 for r in layers)
    assert max(r["kl"] for r in layers) > 0
    assert result["method"].startswith("replay")  # the cheap path was validated against the reference pass
    assert result["cost"]["measurement_passes"] < len(layers)  # fewer than one full pass per layer


def test_ranking_agrees_with_an_independent_quark_quantization(scanned, tiny_llama, corpus):
    result, _, _, _ = scanned
    ranked = sorted(result["layers"], key=lambda r: -r["kl"])
    top, bottom = ranked[0], ranked[-1]
    top_kl = independent_kl(tiny_llama, corpus, {top["layer"]})
    bottom_kl = independent_kl(tiny_llama, corpus, {bottom["layer"]})
    assert top_kl > bottom_kl
    assert top_kl == pytest.approx(top["kl"], rel=0.05, abs=1e-6)


def test_proposal_meets_the_budget_on_a_remeasure(scanned, tiny_llama, corpus):
    result, done, budget, _ = scanned
    proposal = done.proposal
    assert proposal.exclude and proposal.met
    assert proposal.measured_kl <= budget < result["whole_model_kl"]
    assert proposal.extra_bytes > 0
    names = {r["layer"] for r in result["layers"]}
    kl = independent_kl(tiny_llama, corpus, names - set(proposal.exclude))
    assert kl <= budget * 1.05
    report = json.loads(done.reports["json"].read_text())
    assert report["proposal"]["exclude"] == proposal.exclude
    assert done.reports["png"].stat().st_size > 0
    assert "Layers ranked" in done.reports["md"].read_text()


def test_wider_scheme_alternative_is_measured_and_checked_independently(scanned, tiny_llama, corpus):
    """The proposed layers at int8 instead of unquantized: one more Quark quantization; its KL agrees with a
    fresh model quantized by Quark's public API with the same layer_config, and it costs fewer bytes."""
    from quark_ptq_eval.sensitivity.wider import wider_scheme

    result, done, _, messages = scanned
    proposal = done.proposal
    wider = proposal.wider
    assert wider_scheme(SCHEME) == "int8" and wider["scheme"] == "int8" and wider["bits"] == 8
    assert any("at int8 instead of unquantized" in m for m in messages)
    assert 0 < wider["extra_bytes"] < proposal.extra_bytes
    names = {r["layer"] for r in result["layers"]}
    kl = independent_kl(tiny_llama, corpus, names, layer_config={n: "int8" for n in proposal.exclude})
    assert kl == pytest.approx(wider["measured_kl"], rel=0.05, abs=1e-6)
    assert wider["chosen"] == (wider["measured_kl"] <= proposal.max_kl)
    assert proposal.layer_quant_config == ({n: "int8" for n in proposal.exclude} if wider["chosen"] else {})


def test_second_run_is_a_cache_hit(scan_setup, scanned):
    from quark_ptq_eval.sensitivity import scan

    result, _, _, _ = scanned
    _, options = scan_setup
    again, session = scan(options())
    assert again["cache_hit"] and session is None
    assert [r["kl"] for r in again["layers"]] == [r["kl"] for r in result["layers"]]


def test_an_interrupted_scan_resumes(scan_setup, scanned):
    from quark_ptq_eval.sensitivity import scan

    result, _, _, _ = scanned
    _, options = scan_setup

    def interrupt(msg: str) -> None:
        if "per layer" in msg:  # the estimate comes after the first layers were measured and journalled
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        scan(options("resume"), interrupt)
    messages: list[str] = []
    resumed, _ = scan(options("resume"), messages.append)
    assert any("resuming, 2 of 14" in m for m in messages)
    assert [r["kl"] for r in resumed["layers"]] == pytest.approx([r["kl"] for r in result["layers"]], abs=1e-9)


def test_cli_prints_the_proposal_from_the_cache(scan_setup, scanned, tiny_llama, corpus, cli, tmp_path):
    from quark_ptq_eval.base.catalog import cache_dir

    root, _ = scan_setup
    shutil.copytree(root / "cache", tmp_path / "cache")
    # spare the child the Quark imports a fresh cache costs: the scheme catalog and specs (each imports Quark to
    # list them) and the answer to Quark's scan of transformers (quark_import.py), all keyed by the installation
    for known in cache_dir().glob("quark-*.json"):
        shutil.copy(known, tmp_path / "cache" / known.name)
    res = cli("sensitivity", tiny_llama, "--scheme", SCHEME, "--calib-data", corpus, "--num-calib-samples",
              SAMPLES, "--calib-seq-len", SEQ, "--out", tmp_path / "out", "--json",
              env={"QUARK_PTQ_EVAL_CACHE": str(tmp_path / "cache")})
    assert res.rc == 0, res.err
    out = json.loads(res.out)
    assert out["cache_hit"] and (tmp_path / "out" / "sensitivity_report.md").exists()


@pytest.fixture(scope="module")
def sens_plan(tiny_llama, corpus, tmp_path_factory):
    """A real plan with --sensitivity (tight budget, so the proposal keeps layers unquantized)."""
    from quark_ptq_eval.flows.api import analyze_model, plan_quantization

    root = tmp_path_factory.mktemp("sens-plan")
    analysis = analyze_model(tiny_llama, offline=True)
    plan = plan_quantization(analysis, root / "out", workdir=root / "wd", scheme=SCHEME,
                             calib_data=str(corpus), num_calib_samples=SAMPLES, calib_seq_len=SEQ, device="cpu",
                             engine="quark-api", sensitivity=True, max_kl=1e-4)
    return root, plan


def test_plan_with_sensitivity_adds_the_proposal_as_a_decision(sens_plan):
    root, plan = sens_plan
    row = next(d for d in plan.decisions if d["decision"] == "sensitivity")
    # kept unquantized (exclude_layers) or, when the measured wider scheme met the budget, in layer_quant_config
    kept = set(plan.layer_quant_config) if row["layer_quant_config"] else set(plan.exclude_layers)
    assert row["value"] and set(row["value"]) <= kept and "lm_head" in plan.exclude_layers
    assert "sensitivity scan" in row["reason"] and row["measured_kl"] < row["whole_model_kl"]
    written = json.loads((root / "wd" / "quant_plan.json").read_text())
    assert written["exclude_layers"] == plan.exclude_layers
    assert written["layer_quant_config"] == plan.layer_quant_config
    assert (root / "wd" / "sensitivity_report.md").exists()


def test_eval_report_shows_predicted_against_measured_kl(sens_plan, tiny_llama, corpus):
    """A real export with the plan's exclusions, Tier 1 with baseline: the report pairs the scan's
    prediction with the KL Tier 1 measured; a plan made for another output is not used."""
    from quark_ptq_eval.base.gates import FlagApprover
    from quark_ptq_eval.evaluate import EvalOptions, evaluate
    from quark_ptq_eval.evaluate.scan_followup import sensitivity_followup
    from quark_ptq_eval.execute import quark_api_engine

    root, plan = sens_plan
    assert quark_api_engine.main(["--model_dir", str(tiny_llama), "--output_dir", str(root / "out"), "--quant_scheme",
                                  SCHEME, "--calib_data", str(corpus), "--num_calib_data", str(SAMPLES), "--seq_len",
                                  str(SEQ), "--exclude_layers", *plan.exclude_layers,
                                  *[a for kv in plan.layer_quant_config.items() for a in ("--layer_quant_scheme", *kv)]]) == 0
    options = EvalOptions(tier="ppl", eval_data=corpus, seq_len=SEQ, max_windows=8, device="cpu", baseline=tiny_llama)
    report = evaluate(root / "out", options, root / "wd", FlagApprover())
    row = next(d for d in plan.decisions if d["decision"] == "sensitivity")
    follow = json.loads(report.results_path.read_text())["sensitivity"]
    assert sorted([*follow["kept_unquantized"], *follow["layer_quant_config"]]) == sorted(row["value"])
    assert follow["scan_remeasured_kl"] == pytest.approx(row["measured_kl"])
    assert follow["tier1_kl"] == pytest.approx(report.details["kl"]["kl_divergence"]) and follow["tier1_kl"] > 0
    assert follow["ratio_measured_to_predicted"] == pytest.approx(follow["tier1_kl"] / row["measured_kl"])
    text = report.report_path.read_text()
    assert "predicted vs measured KL" in text and f"{follow['tier1_kl']:.4g}" in text
    assert sensitivity_followup(root / "wd", tiny_llama, report.details) is None


def test_hurt_remedies_name_the_scan_command():
    from quark_ptq_eval.evaluate.remedies import suggest_remedies

    remedies = suggest_remedies({"global_scheme": "mxfp4", "model": {"model_path": "/models/m"},
                                 "calibration": {"path": "/data/c.txt", "num_samples": 8}})
    assert any("quark-ptq-eval sensitivity /models/m --scheme mxfp4 --calib-data /data/c.txt" in r for r in remedies)


@pytest.mark.parametrize("bad, says", [(("--wider", "int9"), "no scheme named 'int9'"),
                                        (("--target", "mi999x"), "mi999x")])
def test_cli_refuses_an_unknown_wider_scheme_or_target_before_loading(tiny_llama, cli, tmp_path, bad, says):
    from quark_ptq_eval.base.catalog import cache_dir, catalog_path

    env = {}
    if catalog_path().exists():  # spare the child a Quark import just to list the schemes
        dst = tmp_path / "cache" / catalog_path().relative_to(cache_dir())
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(catalog_path(), dst)
        env = {"QUARK_PTQ_EVAL_CACHE": str(tmp_path / "cache")}
    res = cli("sensitivity", tiny_llama, "--scheme", SCHEME, *bad, "--out", tmp_path / "out", env=env)
    assert res.rc == 2 and says in res.err and "Traceback" not in res.err, res.err[-2000:]
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_directory_that_is_not_a_model(cli, tmp_path):
    res = cli("sensitivity", tmp_path, "--scheme", SCHEME, "--out", tmp_path / "out")
    assert res.rc == 2 and "no config.json" in res.err and "Traceback" not in res.err
