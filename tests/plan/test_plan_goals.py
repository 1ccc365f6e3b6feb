"""Issue 20: every plan the product makes for a named GPU passes its own validation.

A goal that names a target plans that target's scheme with an FP8 KV cache; the plan checks group
and block sizes against every quantized linear before anything runs; the validator knows Quark's
encoding of a KV-cache scheme and holds every attention layer's KV scales to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.docgen.matrix import Setup
from bench.docgen.plan_matrix import run_goal_cell
from quark_ptq_eval.base.errors import ExitCode, UsageError
from quark_ptq_eval.intake import analyze_model
from quark_ptq_eval.plan import PlanRequest, make_plan
from tests.plan.test_plan_targets import cpu_env, header_only_llama
from tests.publish.test_model_card import assert_card_matches
from tests.validate.test_validate_plan import failures, plan_for, run_cli

KV_SCALES = [f"model.layers.{i}.self_attn.{p}.output_scale" for i in (0, 1) for p in ("k_proj", "v_proj")]
DEMO_GOALS = ("fp8 for MI300X, accuracy first", "fp8 for MI300X")  # README.md and docs/planning.md, as written


def _plan(catalog, tmp_path, corpus, model: Path, goal: str = "", **request):
    analysis = analyze_model(str(model), offline=True, catalog=catalog)
    req = PlanRequest(goal=goal, calib_data=str(corpus), **request)
    return make_plan(analysis, cpu_env(), req, catalog, tmp_path / "a.json", tmp_path / "out")


def _same_plan(a: dict, b) -> bool:
    return (a["global_scheme"], a["kv_cache_scheme"], a["algorithm"], a["exclude_layers"], a["layer_quant_config"]) \
        == (b.global_scheme, b.kv_cache_scheme, b.algorithm, b.exclude_layers, b.layer_quant_config)


# --- the README's goal, run as a user runs it ----------------------------------------------------

@pytest.mark.slow
def test_readme_goal_runs_green_and_the_report_lists_the_kv_scales(cli, tiny_llama, corpus, catalog, tmp_path):
    wd, out = tmp_path / "wd", tmp_path / "out"
    r = cli("run", tiny_llama, "-o", out, "--workdir", wd, "--goal", DEMO_GOALS[0], "--calib-data", corpus,
            "--num-calib-samples", "8", "--calib-seq-len", "64", "--offline", "--yes", "--eval-tier", "ppl",
            "--eval-data", corpus, "--seq-len", "64", "--max-windows", "16", "--baseline")
    assert r.rc == 0, r.err[-2000:]
    plan = json.loads((wd / "quant_plan.json").read_text())
    assert (plan["global_scheme"], plan["kv_cache_scheme"]) == ("fp8", "fp8")
    report = json.loads((wd / "validation_report.json").read_text())
    assert report["status"] == "success", report["evidence"]
    assert report["checks"]["load"]["status"] == "pass"
    kv = report["checks"]["calibration"]["stats"]
    assert sorted(kv["kv_scales_checked"]) == KV_SCALES and all(v > 0 for v in kv["kv_scales_checked"].values())
    assert any("KV-cache scales checked (4 of 4" in n for n in report["checks"]["calibration"]["notes"])
    assert "KV-cache scales checked" in (wd / "validation_report.md").read_text()
    verdict = json.loads((wd / "eval_results.json").read_text())["verdict"]
    assert verdict in ("healthy", "watch"), verdict
    card = assert_card_matches(out, wd)  # the KV-cache scheme, the exclusions and the target's serving line
    assert "--kv-cache-dtype fp8" in card.text and "MI300X" in card.text
    # The docs' goal and the balanced MI300X / H100 goals plan the same export: validated against each plan.
    for i, goal in enumerate((DEMO_GOALS[1], "for MI300X", "for H100")):
        other = _plan(catalog, tmp_path, corpus, tiny_llama, goal)
        assert _same_plan(plan, other), goal
        (check := tmp_path / f"check-{i}").mkdir()
        rc, rep = run_cli(tiny_llama, out, check, other.to_dict(), "--no-load-check")
        assert (rc, rep["status"]) == (0, "success"), (goal, rep["evidence"])


# --- one balanced goal per target family, and the plan matrix's CI slice, for real -------------

@pytest.fixture(scope="module")
def goal_setup(tmp_path_factory, corpus, catalog, tiny_llama) -> Setup:
    env = cpu_env(24.0)
    return Setup(tmp_path_factory.mktemp("plan-matrix"), corpus, tiny_llama, catalog, env, 4, 2)


# (target, priority): the balanced goal of each family not covered above, then the CI slice
CELLS = [("mi355x", "balanced"), ("b200", "balanced"), ("a100", "balanced"), ("mi300x", "accuracy"),
         ("h100", "size")]


@pytest.mark.slow
def test_each_target_familys_goal_goes_green_through_quantize_validate_and_tier1(goal_setup, tiny_llama):
    runs: dict = {}
    rows = [run_goal_cell(goal_setup, "llama", tiny_llama, t, p, runs) for t, p in CELLS]
    for row in rows:
        assert row["outcome"] == "green", f"{row['goal']}: {row['stage']} {row.get('cause')}: {row['message']}"
        assert row["kv"] == "fp8" and row["verdict"], row
        assert row["ppl"] is not None and row["ppl_base"] is not None
    assert [r["scheme"] for r in rows] == ["mxfp4", "nvfp4", "int8", "ptpc_fp8", "int4_wo_128"]


# --- planted faults in a real KV-quantized export -------------------------------------------------

def _planted(copy_model, export: Path, name: str, edit) -> Path:
    from safetensors.torch import load_file, save_file

    out = copy_model(export, name)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.slow
def test_kv_scale_faults_planted_in_a_real_export_exit_4_naming_the_layer(tiny_llama, quantized, copy_model, tmp_path):
    export = quantized("fp8", kv="fp8")
    plan = {**plan_for("fp8", kv_cache_scheme="fp8"), "model": {"model_type": "llama"}}
    rc, report = run_cli(tiny_llama, export, tmp_path, plan, "--no-load-check")
    assert (rc, report["status"]) == (0, "success"), report["evidence"]
    assert sorted(report["checks"]["calibration"]["stats"]["kv_scales_checked"]) == KV_SCALES

    removed = _planted(copy_model, export, "removed", lambda t: t.pop(KV_SCALES[3]))
    rc, report = run_cli(tiny_llama, removed, tmp_path, plan, "--no-load-check")
    assert rc == ExitCode.VALIDATION
    assert f"{KV_SCALES[3]}: is missing: the KV-cache scheme fp8 quantizes model.layers.1.self_attn's cache" in \
        failures(report, "calibration")

    for value, name in ((float("nan"), KV_SCALES[0]), (float("inf"), KV_SCALES[2])):
        bad = _planted(copy_model, export, f"bad-{value}", lambda t, n=name, v=value: t[n].fill_(v))
        rc, report = run_cli(tiny_llama, bad, tmp_path, plan, "--no-load-check")
        assert rc == ExitCode.VALIDATION
        layer = name.rsplit(".", 2)[0]
        assert f"{name}: is {value!r}: {layer}'s KV cache would be quantized with a non-finite" in \
            failures(report, "calibration")


@pytest.mark.slow
def test_a_plan_whose_kv_scheme_the_export_ignores_exits_4_naming_each_layer(tiny_llama, quantized, tmp_path):
    """A real fp8 export made without a KV-cache scheme, held against a plan that asked for one."""
    plan = {**plan_for("fp8", kv_cache_scheme="fp8"), "model": {"model_type": "llama"}}
    rc, report = run_cli(tiny_llama, quantized("fp8"), tmp_path, plan, "--no-load-check")
    assert rc == ExitCode.VALIDATION
    text = failures(report, "layout")
    assert "quantization_config.kv_cache_quant_config: is empty, but the plan's KV-cache scheme 'fp8'" in text
    assert all(f"{n}: is missing: the KV-cache scheme fp8" in failures(report, "calibration") for n in KV_SCALES)


def test_an_export_with_a_kv_cache_the_plan_did_not_ask_for_fails(tiny_llama, quantized, tmp_path):
    rc, report = run_cli(tiny_llama, quantized("fp8", kv="fp8"), tmp_path, plan_for("fp8"), "--no-load-check")
    assert rc == ExitCode.VALIDATION
    assert "kv_cache_quant_config: quantizes the KV cache, but the plan has no KV-cache scheme" in \
        failures(report, "layout")


# --- the plan checks group and block sizes before anything runs ------------------------------

@pytest.fixture(scope="module")
def hidden96(tmp_path_factory) -> Path:
    """A Llama with hidden size 96: no group of 128 (nor 64) divides its linears' inputs."""
    return header_only_llama(tmp_path_factory.mktemp("h96") / "llama-96", hidden_size=96, intermediate_size=192,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


def test_a_chosen_int4_that_does_not_divide_falls_back_to_the_nearest_group(catalog, tmp_path, corpus, hidden96):
    plan = _plan(catalog, tmp_path, corpus, hidden96, "int4 for H100, smallest")
    assert plan.global_scheme == "int4_wo_32"
    why = next(d for d in plan.decisions if d["decision"] == "global_scheme")["reason"]
    assert "int4_wo_32 instead of int4_wo_128" in why and "input dimension 96 is no multiple of 128" in why


def test_a_named_scheme_that_does_not_divide_is_refused_at_the_plan_with_the_alternative(catalog, tmp_path, corpus,
                                                                                        hidden96):
    with pytest.raises(UsageError) as err:
        _plan(catalog, tmp_path, corpus, hidden96, scheme="int4_wo_128")
    assert err.value.exit_code == ExitCode.USAGE
    assert "int4_wo_128 cannot quantize this model: model.layers.0.self_attn.q_proj's input dimension 96" in \
        err.value.message
    assert "--scheme int4_wo_32" in err.value.hint
    with pytest.raises(UsageError, match="model.layers.0.self_attn.q_proj's input dimension 96 is no multiple of 64"):
        _plan(catalog, tmp_path, corpus, hidden96, scheme="int8", layer_quant_config={"*q_proj": "int4_wo_64"})


def test_mx_needs_blocks_of_32_and_the_target_falls_back_to_a_format_that_fits(catalog, tmp_path, corpus):
    model = header_only_llama(tmp_path / "llama-80", hidden_size=80, intermediate_size=160, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    plan = _plan(catalog, tmp_path, corpus, model, "for MI355X")
    assert plan.global_scheme == "fp8", "mxfp4's blocks of 32 cannot split 80: the target's FP8 instead"
    assert "fp8 instead of mxfp4" in next(d for d in plan.decisions if d["decision"] == "global_scheme")["reason"]
    with pytest.raises(UsageError, match="mxfp4 cannot quantize this model: .* 80 is no multiple of 32"):
        _plan(catalog, tmp_path, corpus, model, scheme="mxfp4")


def test_moe_experts_are_held_to_the_group_size(catalog, tmp_path, corpus, tiny_llama):
    """qwen3_moe's tiny experts (moe_intermediate_size 64): down_proj's input takes groups of 64, not 128."""
    from tests.fixtures.families import build_family

    model = build_family("qwen3_moe", tmp_path / "qwen3_moe", tiny_llama)  # the demo model's tokenizer
    plan = _plan(catalog, tmp_path, corpus, model, "smallest for H100")
    why = next(d for d in plan.decisions if d["decision"] == "global_scheme")["reason"]
    assert plan.global_scheme == "int4_wo_64" and "experts" in why and "no multiple of 128" in why
