"""Remedies as plan variants (evaluate/remedy_variants.py): what is proposed from the plan and validation's evidence,
and how measured variants are judged beside the original. The real run is tests/validate/test_validate_damage.py's."""

from __future__ import annotations

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
