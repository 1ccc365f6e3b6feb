"""Remedies as plan variants (evaluate/remedy_variants.py): what is proposed from the plan and validation's evidence,
and how measured variants are judged beside the original. The real run is tests/validate/test_validate_damage.py's."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

from quark_ptq_eval.evaluate.remedy_variants import (
    HELPED,
    Evidence,
    Scored,
    judge,
    propose,
    shortfall,
    table_markdown,
)
from quark_ptq_eval.plan.request import PlanChange

SQ = {"global_scheme": "int8", "algorithm": "smoothquant", "exclude_layers": ["lm_head"],
      "calibration": {"num_samples": 16, "seq_len": 128}}
DAMAGE_REPORT = {"checks": {"decode": {"stats": {"quantization_damage": [{"weight": "model.layers.0.mlp.up_proj.weight"}]}},
                     "load": {"stats": {"quantization_error": [{"module": "model.layers.0.mlp", "error": 1.0,
                                                                "cause": "mostly weight rounding in a unit holding "
                                                                         "folded scales"}]}}}}
DAMAGE = Evidence.of(DAMAGE_REPORT)
NONE = Evidence.of(None)


def test_the_evidence_is_read_from_whichever_check_recorded_it():
    assert Evidence(("model.layers.0.mlp.up_proj.weight",), "model.layers.0.mlp",
                              "mostly weight rounding in a unit holding folded scales", 1.0) == DAMAGE
    assert DAMAGE.folded and not NONE.folded and Evidence() == NONE
    moved = {"checks": {"other": DAMAGE_REPORT["checks"]["decode"], "more": DAMAGE_REPORT["checks"]["load"]}}
    assert Evidence.of(moved) == DAMAGE


def test_the_fold_that_crushed_rows_is_removed_first_then_the_block_then_more_calibration():
    variants = propose(SQ, DAMAGE, 3)
    assert [(v.kind, v.request) for v in variants] == [
        ("algorithm_removed", PlanChange(algorithm="")),
        ("block_kept", PlanChange(exclude_layers=("lm_head", "model.layers.0.*"))),
        ("calibration", PlanChange(num_calib_samples=64))]
    assert variants[1].as_json()["request"] == {"exclude_layers": ["lm_head", "model.layers.0.*"]}
    assert "model.layers.0.mlp.up_proj.weight" in variants[0].why


def test_what_the_plan_already_does_is_never_proposed():
    done = {**SQ, "algorithm": None, "exclude_layers": ["lm_head", "model.layers.0.*"],
            "calibration": {"num_samples": 512, "seq_len": 128}}
    kinds = [v.kind for v in propose(done, DAMAGE, 5)]
    assert "algorithm_removed" not in kinds and "block_kept" not in kinds and "calibration" not in kinds
    assert kinds == ["algorithm_added", "wider_format"]  # SmoothQuant for W8A8, then fp8
    assert [v.kind for v in propose({**SQ, "algorithm": "gptq"}, NONE, 5)] == ["calibration", "wider_format"]


def test_linears_traced_to_input_outliers_are_kept_with_the_linears_vllm_fuses_them_with():
    errors = [{"module": "model.layers.9.mlp.down_proj", "error": 0.22, "input_outlier_ratio": 290.0, "input_outlier": True,
               "cause": "input absmax 290x its median channel: static per_tensor int8 activations"},
              {"module": "model.layers.29.mlp.up_proj", "error": 0.19, "input_outlier_ratio": 83.0, "input_outlier": True,
               "cause": "input absmax 83x its median channel: static per_tensor int8 activations"},
              {"module": "model.layers.3.self_attn.o_proj", "error": 0.05, "input_outlier_ratio": 3.0, "input_outlier": False,
               "cause": "static per_tensor int8 activations"}]
    evidence = Evidence.of({"checks": {"load": {"stats": {"quantization_error": errors}}}})
    plain = {**SQ, "algorithm": None}
    kept = ("lm_head", "model.layers.9.mlp.down_proj", "model.layers.29.mlp.gate_proj", "model.layers.29.mlp.up_proj")
    both, alone, searched = propose(plain, evidence, 3, offered=("smoothquant", "autosmoothquant"))
    assert both.request == PlanChange(algorithm="autosmoothquant", exclude_layers=kept)
    assert alone.kind == "outliers_kept" and alone.request == PlanChange(exclude_layers=kept)
    assert searched.request == PlanChange(algorithm="autosmoothquant")
    assert propose(plain, evidence, 1)[0] == replace(alone, label=alone.label)  # no AutoSmoothQuant offered
    errors.append({**errors[0], "module": "model.layers.10.mlp.down_proj"})  # a role listed in two layers: all
    evidence = Evidence.of({"checks": {"load": {"stats": {"quantization_error": errors}}}})
    assert propose(plain, evidence, 1)[0].request.exclude_layers == (
        "lm_head", "*down_proj", "model.layers.29.mlp.gate_proj", "model.layers.29.mlp.up_proj")
    assert "outliers_kept" not in [v.kind for v in propose(SQ, evidence, 5)]  # SmoothQuant's to move


def test_no_variant_asks_for_more_calibration_text_than_the_text_holds():
    plain = {**SQ, "algorithm": "gptq", "calibration": {"num_samples": 64, "seq_len": 256}}
    assert propose(plain, NONE, 1)[0].request == PlanChange(num_calib_samples=256)
    assert propose(plain, NONE, 1, calibration_room=204)[0].request == PlanChange(num_calib_samples=204)
    assert [v.kind for v in propose(plain, NONE, 5, calibration_room=64)] == ["wider_format"]  # no room: not proposed


def _row(delta, lo, hi, kl, verdict, validation="success"):
    return Scored.of({"status": "evaluated", "validation": validation, "delta_nll": delta, "delta_nll_ci95": [lo, hi],
            "kl_mean": kl, "verdict": verdict, "size_bytes": 2**20, "bits_per_weight": 8.3, "top1_agreement": 0.9,
            "ppl_increase_pct": 100 * delta})


def test_a_variant_measured_worse_than_the_original_is_never_recommended():
    variants = propose(SQ, DAMAGE, 3)
    original = _row(0.30, 0.25, 0.35, 0.30, "hurt")
    worse = {variants[0].label: _row(0.50, 0.45, 0.55, 0.5, "hurt"),  # beyond noise
             variants[1].label: _row(0.31, 0.26, 0.36, 0.31, "hurt"),  # within noise, but worse
             variants[2].label: Scored.of({"status": "failed", "failed_step": "validate", "error": "decode fail"})}
    judged = judge(original, variants, worse, "hurt")
    assert [r.outcome for r in judged.rows] == ["rejected: worse beyond noise", "rejected: worse (within noise)",
                                                   "rejected: not usable"]
    assert judged.recommendation is None and judged.cause is None
    assert "**Recommendation:** none" in table_markdown(original, judged, None)
    assert shortfall(judged) == ("none of the 3 variants measured reached healthy or watch: the closest, "
                                 f"{variants[1].label} ({variants[1].changed}), measured hurt at KL 0.31")
    helped = {**worse, variants[1].label: _row(0.01, 0.0, 0.02, 0.01, "healthy")}
    judged = judge(original, variants, helped, "hurt")
    assert judged.rows[1].outcome == HELPED and judged.recommendation.variant == variants[1]
    assert shortfall(judged) is None
    assert judged.cause.startswith("block 0 carries the harm") and "not the algorithm" in judged.cause
    helped[variants[0].label] = _row(0.002, -0.001, 0.005, 0.002, "healthy")
    judged = judge(original, variants, helped, "hurt")
    assert judged.recommendation.variant == variants[0] and judged.cause.startswith("smoothquant is the cause")


def _engine_log(workdir, split, ready=None):
    from quark_ptq_eval.base.process_exit import READY_LINE

    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    (workdir / "logs" / "engine.log").write_text(("" if ready is None else f"{READY_LINE}{ready} s\n")
                                                  + ("" if split is None else split.line() + "\n") + "done\n")


def test_the_estimate_scales_each_variant_from_the_runs_own_quantization(tmp_path):
    """Each variant: the run's quantization (less the engine's start-up: its log's ready line, else the validation's
    imports), its validation less the cold start (the comparison runs warm) and its side of Tier 1 (half the run's,
    which scored both); the baseline's side once. With the engine's split, more samples lengthen only the decoder
    forwards and the variant without the algorithm drops the algorithm's own work; without it, the whole step
    scales with the samples. No estimate where a step ran in an earlier process (a resumed run)."""
    from quark_ptq_eval.execute.quant_split import QuantSplit
    from quark_ptq_eval.flows.recipe.recipe_flow import IMPORT_SUFFIX
    from quark_ptq_eval.flows.recipe.remedy_cost import EXECUTE, VALIDATE, QuantCost, estimate_s, run_cost

    variants = propose(SQ, DAMAGE, 3)  # SmoothQuant removed, block 0 kept, 16 -> 64 calibration samples
    sq, results = ("smoothquant",), {"runtime": {"actual_s": 40.0}}
    timings = {EXECUTE: 100.0, VALIDATE: 30.0, VALIDATE + IMPORT_SUFFIX: 20.0}
    whole = run_cost(timings, tmp_path, sq, 16, None)  # no engine log: no split, the imports as start-up
    assert whole == QuantCost(80.0, sq, 16)
    assert estimate_s(timings, results, variants, whole, sq, 16) == 20 + 2 * (80 + 10 + 20) + (4 * 80 + 10 + 20)
    # the engine's split: 30 s in SmoothQuant, 10 s in decoder forwards (one calibration pass + SmoothQuant's 1.5)
    _engine_log(tmp_path, QuantSplit(30.0, 10.0, 10.0, 16), ready=35.0)
    split = run_cost(timings, tmp_path, sq, 16, 35.0)
    assert split is not None and split.seconds == 65.0 and split.parts() == (31.0, 16.0, 4.0)
    # without SmoothQuant: fixed 31 s + one pass; block 0 kept: as the run; 64 samples: four times the forwards
    assert [split.variant(v, sq, 16) for v in variants] == [35.0, 65.0, 95.0]
    assert estimate_s(timings, results, variants, split, sq, 16) == 20 + (35 + 10 + 20) + (65 + 10 + 20) + (95 + 10 + 20)
    # a validation measured again warm in the run's process replaces the cold one's figure
    assert estimate_s(timings, results, variants, split, sq, 16, 2.0) == 20 + (35 + 2 + 20) + (65 + 2 + 20) + (95 + 2 + 20)
    assert run_cost({VALIDATE: 30.0}, tmp_path, sq, 16, None) is None
    assert estimate_s(timings, {}, variants, split, sq, 16) is None and estimate_s(timings, results, variants, None, sq, 16) is None


def test_the_engine_splits_its_quantization_and_the_estimate_reads_it_back(tmp_path, capsys):
    """Quark's two steps wrapped on the instance only, decoder-layer forwards timed by hooks that are removed
    after; the line round-trips; a quantizer without those steps says nothing (the estimate falls back)."""
    import time

    import torch

    from quark_ptq_eval.execute.quant_split import STEPS, QuantSplit, measured

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(passes):
        for _ in range(passes):
            x = torch.ones(2, 4)
            for layer in model.layers:
                x = layer(x)
                time.sleep(0.01)  # inside no layer: not a forward

    class Quantizer:
        def _apply_advanced_quant_algo(self, m, data):
            forward(2)
            time.sleep(0.05)
            return m

        def _do_calibration(self, m, data):
            forward(1)
            return m

        def quantize_model(self, m, data):
            return self._do_calibration(self._apply_advanced_quant_algo(m, data), data)

    q = Quantizer()
    with measured(q, model, 16):
        q.quantize_model(model, None)
    line = capsys.readouterr().out
    _engine_log(tmp_path, None)
    (tmp_path / "logs" / "engine.log").write_text(f"loading\n{line}exporting\n")
    split = QuantSplit.read(tmp_path / "logs" / "engine.log")
    assert split is not None and split.samples == 16, line
    assert split.algorithm_s >= 0.05 + 0.06 and split.calibration_s >= 0.03 and split.forwards_s < 0.06, split
    assert not any(name in vars(q) for name in STEPS.values())  # the class's methods again
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in model.layers)
    with measured(object(), model, 16):
        pass
    assert capsys.readouterr().out == "" and QuantSplit.read(tmp_path / "none.log") is None


def test_an_engine_says_how_long_its_start_took_in_its_log(tmp_path):
    """A fresh engine process's line after its imports (its age from /proc), read back as a number; none in an
    engine run inside another process (compare's in-process engines), nor in a log without it."""
    from quark_ptq_eval.base.process_exit import READY_LINE, process_age_s, ready_after_s

    code = "from quark_ptq_eval.base.process_exit import say_ready; say_ready()"
    line = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert line.startswith(READY_LINE) and line.endswith(" s\n")
    log = tmp_path / "engine.log"
    log.write_text(f"loading\n{READY_LINE}9.0 s\n{line}done\n")
    assert ready_after_s(log) == float(line[len(READY_LINE):].split()[0]) >= 0  # the last one: a resumed engine
    age = process_age_s()
    assert age is not None and age > 0
    log.write_text("loading\ndone\n")
    assert ready_after_s(log) is None and ready_after_s(tmp_path / "none.log") is None


def test_the_pilot_estimates_the_others_from_the_first_variant_as_it_ran_here(tmp_path, monkeypatch):
    """The first variant is timed from its start to its end (the comparison's progress events); the others are said
    from it at once: its checks and scoring as they took, its quantization (its run summary's step and its engine's
    split) scaled to each, the algorithm it did not run at the rate the run measured; then set beside the time they
    took. Only one variant: nothing to estimate."""
    from quark_ptq_eval.base.fsio import write_json
    from quark_ptq_eval.execute.quant_split import QuantSplit
    from quark_ptq_eval.flows.recipe import remedy_cost
    from quark_ptq_eval.flows.recipe.remedy_cost import EXECUTE, Pilot, QuantCost

    clock = iter([0.0, 10.0, 30.0, 95.0]).__next__  # began, first started, first done, the others ended
    monkeypatch.setattr(remedy_cost.time, "monotonic", clock)
    variants = propose(SQ, DAMAGE, 3)  # the first: SmoothQuant removed; the third: 16 -> 64 calibration samples
    first = variants[0].label
    write_json(tmp_path / "work" / first / "run_summary.json", {"timings_s": {EXECUTE: 6.0, "phase2_validate": 2.0,
                                                                              "phase3_eval": 2.0}})
    _engine_log(tmp_path / "work" / first, QuantSplit(0.0, 2.0, 2.0, 16))  # fixed 4 s, one pass 2 s
    run = QuantCost(65.0, ("smoothquant",), 16, QuantSplit(30.0, 10.0, 10.0, 16))  # SmoothQuant's own: 16 s a pass
    said: list[str] = []
    pilot = Pilot(variants, ("smoothquant",), 16, tmp_path, said.append, run)
    for event, label in [("started", first), ("done", first), ("started", variants[1].label)]:
        pilot(event, label)
    # 20 s, of which 6 quantizing: block 0 kept 4 + 16 * 1.5 + 2 * 2.5; 64 samples 4 + 24 + 2 * 2.5 * 4
    assert pilot.rest_estimated_s == (20 - 6 + 33) + (20 - 6 + 48)
    assert len(said) == 1 and said[0].startswith(f"Remedies: {first} took 20 s here; the other 2: about "), said
    result = pilot.result()
    assert result is not None and result.rest_actual_s == 65.0 and result.seconds == 20.0
    assert result.as_json()["rest_estimated_over_actual"] == round(109.0 / 65.0, 3)
    monkeypatch.setattr(remedy_cost.time, "monotonic", iter([0.0, 1.0, 2.0, 3.0]).__next__)
    blind = Pilot(variants[:2], ("smoothquant",), 16, tmp_path / "nothing", said.append)  # no summary: as long as it
    blind("started", first)
    blind("done", first)
    assert blind.rest_estimated_s == 1.0
    monkeypatch.setattr(remedy_cost.time, "monotonic", iter([0.0, 1.0, 2.0]).__next__)
    lone = Pilot(variants[:1], ("smoothquant",), 16, tmp_path, said.append)
    lone("started", first)
    lone("done", first)
    assert lone.result() is None


def test_what_the_target_serves_natively_is_shown_and_preferred():
    """The served column follows the plan's own target (its native formats; weight-only runs anywhere), and among
    healthy variants that helped beyond noise the one the target runs natively is recommended over a lower KL
    it would emulate."""
    from quark_ptq_eval.flows.recipe.remedies_side import on_target

    mi300x = {"label": "MI300X", "native_formats": ["fp8", "int8"]}
    assert on_target({"global_scheme": "int8", "target": mi300x}) == "native on MI300X"
    assert on_target({"global_scheme": "int4_wo_128", "target": mi300x}) == "native on MI300X"
    assert on_target({"global_scheme": "mxfp4", "target": mi300x}) == "emulated on MI300X"
    assert on_target({"global_scheme": "int8"}) is None and on_target(None) is None
    variants = propose(SQ, DAMAGE, 2)
    original = _row(0.30, 0.25, 0.35, 0.30, "hurt")
    emulated = replace(_row(0.001, -0.01, 0.01, 0.001, "healthy"), on_target="emulated on MI300X")
    native = replace(_row(0.01, 0.0, 0.02, 0.01, "healthy"), on_target="native on MI300X")
    judged = judge(original, variants, {variants[0].label: emulated, variants[1].label: native}, "hurt")
    assert judged.recommendation is not None and judged.recommendation.variant == variants[1]
    assert "| emulated on MI300X |" in table_markdown(original, judged, None)
