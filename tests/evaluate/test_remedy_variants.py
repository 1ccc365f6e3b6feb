"""Remedies as plan variants (evaluate/remedy_variants.py): what is proposed from the plan and validation's evidence,
and how measured variants are judged beside the original. The real run is tests/validate/test_validate_damage.py's."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

from quark_ptq_eval.evaluate.remedy_variants import HELPED, Evidence, Scored, judge, propose, table_markdown
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
    helped = {**worse, variants[1].label: _row(0.01, 0.0, 0.02, 0.01, "healthy")}
    judged = judge(original, variants, helped, "hurt")
    assert judged.rows[1].outcome == HELPED and judged.recommendation.variant == variants[1]
    assert judged.cause.startswith("block 0 carries the harm") and "not the algorithm" in judged.cause
    helped[variants[0].label] = _row(0.002, -0.001, 0.005, 0.002, "healthy")
    judged = judge(original, variants, helped, "hurt")
    assert judged.recommendation.variant == variants[0] and judged.cause.startswith("smoothquant is the cause")


def test_the_estimate_scales_from_what_this_runs_own_steps_took():
    """Each variant: the run's quantization and validation less the cold start its validation measured (the
    comparison runs warm), scaled by the calibration samples, and its side of Tier 1 (half the run's, which scored
    both); the baseline's side once. No estimate where a step ran in an earlier process (a resumed run)."""
    from quark_ptq_eval.flows.recipe.recipe_flow import IMPORT_SUFFIX
    from quark_ptq_eval.flows.recipe.remedies_side import EXECUTE, VALIDATE, estimate_s

    variants = propose(SQ, DAMAGE, 3)  # the third: 16 -> 64 calibration samples
    results = {"runtime": {"actual_s": 40.0}}
    timings = {EXECUTE: 100.0, VALIDATE: 30.0, VALIDATE + IMPORT_SUFFIX: 20.0}
    assert estimate_s(timings, results, variants, 16) == 20 + 2 * (80 + 10 + 20) + (4 * 80 + 10 + 20)
    assert estimate_s({EXECUTE: 100.0, VALIDATE: 30.0}, results, variants[:1], 16) == 20 + (100 + 30 + 20)
    assert estimate_s({VALIDATE: 30.0}, results, variants, 16) is None
    assert estimate_s(timings, {}, variants, 16) is None
    # the engine child's own start-up, from its log, replaces the validation's imports for the quantizations
    assert estimate_s(timings, results, variants, 16, 35.0) == 20 + 2 * (65 + 10 + 20) + (4 * 65 + 10 + 20)
    # and a validation measured again warm in the run's process replaces the cold one's figure
    assert estimate_s(timings, results, variants, 16, 35.0, 2.0) == 20 + 2 * (65 + 2 + 20) + (4 * 65 + 2 + 20)


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
    from it at once, its quantization share (its run summary's steps) scaled by each one's calibration samples, and
    set beside the time they took. Only one variant: nothing to estimate."""
    from quark_ptq_eval.base.fsio import write_json
    from quark_ptq_eval.flows.recipe import remedies_side
    from quark_ptq_eval.flows.recipe.remedies_side import EXECUTE, Pilot

    clock = iter([0.0, 10.0, 30.0, 95.0]).__next__  # began, first started, first done, the others ended
    monkeypatch.setattr(remedies_side.time, "monotonic", clock)
    variants = propose(SQ, DAMAGE, 3)  # the third: 16 -> 64 calibration samples
    first = variants[0].label
    write_json(tmp_path / "work" / first / "run_summary.json", {"timings_s": {EXECUTE: 6.0, "phase2_validate": 2.0,
                                                                              "phase3_eval": 2.0, EXECUTE + "_imports": 50.0}})
    said: list[str] = []
    pilot = Pilot(variants, 16, tmp_path, said.append)
    for event, label in [("started", first), ("done", first), ("started", variants[1].label)]:
        pilot(event, label)
    # 20 s each: 40 % others, 60 % quantization (the imports are not a step); the third's quantization x4
    assert pilot.rest_estimated_s == 20.0 + 20 * (0.4 + 0.6 * 4)
    assert len(said) == 1 and said[0].startswith(f"Remedies: {first} took 20 s here; the other 2: about "), said
    result = pilot.result()
    assert result is not None and result.rest_actual_s == 65.0 and result.seconds == 20.0
    assert result.as_json()["rest_estimated_over_actual"] == round(76.0 / 65.0, 3)
    monkeypatch.setattr(remedies_side.time, "monotonic", iter([0.0, 1.0, 2.0]).__next__)
    lone = Pilot(variants[:1], 16, tmp_path, said.append)
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
