"""Issue 10, Phase 2: each class of wrong export, planted into a real Quark export, fails with exit 4
and a finding that names the tensor or field, what the plan expected and what was found."""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import pytest

from quark_ptq_eval.base.errors import ExitCode, QpeError
from quark_ptq_eval.base.gates import FlagApprover
from quark_ptq_eval.base.safetensors_io import INDEX_NAME
from quark_ptq_eval.validate import add_validate_arguments, cmd_validate, validate_model
from quark_ptq_eval.validate.checks import CHECKS
from quark_ptq_eval.validate.loadcheck import load_check_alone
from tests.validate.test_validate import read_tensors, rewrite, shard

MLP = ("gate_proj", "up_proj", "down_proj")


def plan_for(scheme: str, **extra) -> dict:
    return {"global_scheme": scheme, "exclude_layers": ["lm_head"], "layer_quant_config": {},
            "kv_cache_scheme": None, "algorithm": None, **extra}


def run_cli(source: Path, out: Path, workdir: Path, plan: dict | None, *flags: str) -> tuple[int, dict]:
    """``validate`` as the CLI runs it: exit code and the JSON report it wrote."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path)
    add_validate_arguments(parser)
    argv = ["--source", str(source), "--quantized", str(out), "--workdir", str(workdir), *flags]
    if plan is not None:
        (workdir / "quant_plan.json").write_text(json.dumps(plan))
        argv += ["--plan", str(workdir / "quant_plan.json")]
    try:
        rc = cmd_validate(parser.parse_args(argv), FlagApprover())
    except QpeError as exc:  # ValidationFailed (4), or CheckpointPending (3) when a fix is offered
        rc = int(exc.exit_code)
    return rc, json.loads((workdir / "validation_report.json").read_text())


def failures(report: dict, check: str) -> str:
    return "\n".join(f"{f['subject']}: {f['message']} {f['evidence']}" for f in report["checks"][check]["findings"]
                     if not f["benign"])


# --- 1. conformance to the plan ---------------------------------------------------------------------

def test_an_export_with_another_scheme_than_the_plan_fails_naming_both(tiny_llama, quantized, tmp_path):
    rc, report = run_cli(tiny_llama, quantized("fp8"), tmp_path, plan_for("int8"), "--no-load-check")
    assert rc == 4
    text = failures(report, "layout")
    assert ("quantization_config.global_quant_config.weight: does not match the plan's scheme 'int8': the plan "
            "needs int8 per_tensor, the export holds fp8_e4m3 per_tensor (as scheme 'fp8' would).") in text
    assert "input_tensors: does not match the plan's scheme 'int8'" in text


def test_the_same_export_conforms_to_its_own_plan(tiny_llama, quantized, tmp_path):
    rc, report = run_cli(tiny_llama, quantized("fp8"), tmp_path, plan_for("fp8"), "--no-load-check")
    assert rc == 0 and report["status"] == "success"
    layout = report["checks"]["layout"]["stats"]
    assert layout["expectations_from"] == "plan"
    assert layout["quantized_share"] == layout["expected_share"] and 0.5 < layout["expected_share"] < 1


def test_an_export_where_nothing_is_quantized_fails(tiny_llama, copy_model, tmp_path):
    unquantized = copy_model(tiny_llama, "not-quantized")  # the source saved again: nothing quantized
    rc, report = run_cli(tiny_llama, unquantized, tmp_path, plan_for("int8"), "--no-load-check")
    assert rc == 4
    text = failures(report, "layout")
    assert "quantization_config: is absent, but the plan quantizes with 'int8'." in text
    assert "quantized share: the plan quantizes" in text and "but the export quantizes none" in text


def test_a_large_share_left_in_float_fails_with_both_shares(tiny_llama, quantized, copy_model, tmp_path):
    out = copy_model(quantized("int8"), "mlp-in-float")
    source = read_tensors(tiny_llama)

    def unquantize_mlp(t):
        for name in [n for n in t if any(f"mlp.{p}." in n for p in MLP)]:
            del t[name]
        t.update({n: v for n, v in source.items() if any(f"mlp.{p}." in n for p in MLP)})
    rewrite(out, unquantize_mlp)
    rc, report = run_cli(tiny_llama, out, tmp_path, plan_for("int8"), "--no-load-check")
    assert rc == 4
    text = failures(report, "layout")
    assert "quantized share: " in text and "of the matrix parameters the plan quantizes are left in the source's " \
                                            "float dtype" in text
    assert "model.layers.1.mlp.down_proj: is not quantized" in text
    stats = report["checks"]["layout"]["stats"]
    assert stats["quantized_share"] < stats["expected_share"]


def test_a_plan_override_with_its_own_scheme_is_checked(tiny_llama, quantized, tmp_path):
    plan = plan_for("int8", layer_quant_config={"*down_proj": "fp8"})
    rc, report = run_cli(tiny_llama, quantized("int8"), tmp_path, plan, "--no-load-check")
    assert rc == 4
    assert "layer_quant_config['*down_proj']: the plan overrides it with 'fp8'" in failures(report, "layout")


# --- 2. shapes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["int4_wo_128", "mxfp4"])
def test_a_scale_of_the_right_size_but_wrong_shape_fails_at_that_tensor(tiny_llama, quantized, copy_model, tmp_path,
                                                                       scheme):
    out = copy_model(quantized(scheme), f"{scheme}-shape")
    name = "model.layers.0.mlp.up_proj.weight_scale"
    rewrite(out, lambda t: t.update({name: (t[name][0], list(reversed(t[name][1])), t[name][2])}))
    rc, report = run_cli(tiny_llama, out, tmp_path, plan_for(scheme), "--no-load-check")
    assert rc == 4
    assert f"{name}: has shape" in failures(report, "layout")


def test_a_packed_weight_of_the_right_size_but_wrong_shape_fails(tiny_llama, quantized, copy_model, tmp_path):
    out = copy_model(quantized("int4_wo_128"), "int4-weight-shape")
    name = "model.layers.1.self_attn.q_proj.weight"
    rewrite(out, lambda t: t.update({name: (t[name][0], list(reversed(t[name][1])), t[name][2])}))
    rc, report = run_cli(tiny_llama, out, tmp_path, plan_for("int4_wo_128"), "--no-load-check")
    assert rc == 4 and f"{name}: has shape" in failures(report, "layout")


# --- 3. every byte that must not change -----------------------------------------------------------------

@pytest.mark.parametrize("tensor", ["model.norm.weight", "model.layers.1.input_layernorm.weight",
                                    "model.embed_tokens.weight"])
def test_one_byte_in_any_unquantized_tensor_fails(tiny_llama, quantized, copy_model, tmp_path, tensor):
    out = copy_model(quantized("int8"), "byte")

    def flip(t):
        dtype, shape, data = t[tensor]
        t[tensor] = (dtype, shape, data[:5] + bytes([data[5] ^ 0x10]) + data[6:])
    rewrite(out, flip)
    rc, report = run_cli(tiny_llama, out, tmp_path, plan_for("int8"), "--no-load-check")
    assert rc == 4
    assert f"{tensor}: must be byte-identical to the source but its payload differs from byte 5" in \
        failures(report, "md5")


def test_awq_rewrites_are_reported_not_failed_but_a_nan_in_them_fails(tiny_llama, quantized, copy_model, tmp_path):
    plan = plan_for("int4_wo_128", algorithm="awq")
    rc, report = run_cli(tiny_llama, quantized("int4_wo_128", algorithm="awq"), tmp_path, plan, "--no-load-check")
    assert rc == 0, failures(report, "md5")
    md5 = report["checks"]["md5"]
    assert md5["stats"]["rewritten"] > 0 and any("rewritten by awq" in n for n in md5["notes"])
    out = copy_model(quantized("int4_wo_128", algorithm="awq"), "awq-nan")
    name = "model.layers.0.post_attention_layernorm.weight"

    def poison(t):
        dtype, shape, data = t[name]
        t[name] = (dtype, shape, struct.pack("<f", float("nan")) + data[4:])
    rewrite(out, poison)
    rc, report = run_cli(tiny_llama, out, tmp_path, plan, "--no-load-check")
    assert rc == 4
    assert f"{name}: was rewritten by awq into 1 non-finite value(s)." in failures(report, "md5")


# --- 4. tokenizer behaviour --------------------------------------------------------------------------

def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(("field", "edit", "file"), [
    ("normalizer", lambda d: d.update(normalizer={"type": "Lowercase"}), "tokenizer.json"),
    ("post processor", lambda d: d.update(post_processor={"type": "TemplateProcessing", "single": [
        {"Sequence": {"id": "A", "type_id": 0}}], "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
        "special_tokens": {}}), "tokenizer.json"),
    ("add bos token", lambda d: d.update(add_bos_token=not d.get("add_bos_token", True)), "tokenizer_config.json"),
    ("model max length", lambda d: d.update(model_max_length=7), "tokenizer_config.json"),
])
def test_a_behavioural_tokenizer_change_fails_naming_the_field(tiny_llama, quantized, copy_model, tmp_path,
                                                              field, edit, file):
    out = copy_model(quantized("int8"), "tok")
    _edit_json(out / file, edit)
    rc, report = run_cli(tiny_llama, out, tmp_path, plan_for("int8"), "--no-load-check")
    assert rc == ExitCode.CHECKPOINT and report["status"] == "failed"  # not structural: re-copying is offered
    assert f"changed: the tokenizer differs in {field}" in failures(report, "aux") or \
        f", {field}" in failures(report, "aux")


def test_a_pre_tokenizer_change_shows_in_the_probe_encoding(tiny_llama, quantized, copy_model, tmp_path):
    out = copy_model(quantized("int8"), "tok-probe")
    _edit_json(out / "tokenizer.json", lambda d: d.update(pre_tokenizer={"type": "Whitespace"}))
    rc, report = run_cli(tiny_llama, out, tmp_path, plan_for("int8"), "--no-load-check")
    assert rc == ExitCode.CHECKPOINT and report["status"] == "failed"
    text = failures(report, "aux")
    assert "pre tokenizer" in text and "probe encoding" in text


# --- 5. sharded checkpoints --------------------------------------------------------------------------

def test_an_index_entry_naming_the_wrong_shard_fails(tiny_llama, quantized, copy_model, tmp_path):
    out = copy_model(quantized("int8"), "sharded")
    shard(out)
    index = json.loads((out / INDEX_NAME).read_text())
    first, second = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == first)
    index["weight_map"][name] = second
    (out / INDEX_NAME).write_text(json.dumps(index))
    rc, report = run_cli(tiny_llama, out, tmp_path, plan_for("int8"), "--no-load-check")
    assert rc == 4
    assert f"{INDEX_NAME}: {name}: maps to {second} but the tensor is in {first}." in failures(report, "index")


def test_a_shard_tensor_missing_from_the_index_fails(tiny_llama, quantized, copy_model, tmp_path):
    out = copy_model(quantized("int8"), "sharded-drop")
    shard(out)
    index = json.loads((out / INDEX_NAME).read_text())
    del index["weight_map"]["model.norm.weight"]
    (out / INDEX_NAME).write_text(json.dumps(index))
    rc, report = run_cli(tiny_llama, out, tmp_path, plan_for("int8"), "--no-load-check")
    assert rc == 4
    assert f"{INDEX_NAME}: model.norm.weight: is in shard" in failures(report, "index")


# --- 6. it loads and runs ------------------------------------------------------------------------------

def test_the_load_check_runs_by_default_and_states_its_limit(tiny_llama, quantized, tmp_path, capsys):
    rc, report = run_cli(tiny_llama, quantized("int8"), tmp_path, plan_for("int8"))
    assert rc == 0, failures(report, "load")
    shown = capsys.readouterr()  # only our lines: transformers' loading bars go to the command's log
    assert "Loading weights" not in shown.out + shown.err and "Validation passed" in shown.out
    assert "Loading weights" in (tmp_path / "logs" / "validate.log").read_text()
    load = report["checks"]["load"]
    stats = load["stats"]
    # every linear, the embedding and lm_head of the 2-layer model, replayed one by one and held to the
    # export's emulation (decoded weights, activations quantized as exported) within float rounding
    assert load["status"] == "pass" and stats["modules_replayed"] == stats["modules_emulated"] == 16
    assert 0 <= stats["max_loader_error"] <= stats["loader_error_limit"] == 0.03
    assert stats["greedy_agreement"] >= 0.6  # reported; the replay judges
    assert 0 < stats["max_quantization_error"] < 0.45  # int8's own error against the source: evidence only
    assert any("limit 3%, floating-point rounding" in n for n in load["notes"])
    assert any("loaded with transformers" in n for n in load["notes"])


def test_no_load_check_is_said_in_the_report(tiny_llama, quantized, tmp_path):
    rc, report = run_cli(tiny_llama, quantized("int8"), tmp_path, plan_for("int8"), "--no-load-check")
    assert rc == 0 and report["checks"]["load"]["status"] == "skipped"
    assert "--no-load-check" in report["checks"]["load"]["skipped_reason"]
    assert "Loads and runs" in (tmp_path / "validation_report.md").read_text()


def test_nan_scales_pass_the_headers_but_fail_the_load_check(tiny_llama, quantized, copy_model, tmp_path):
    out = copy_model(quantized("int8"), "nan-scale")
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    rewrite(out, lambda t: t.update({name: (t[name][0], t[name][1], struct.pack("<f", float("nan")) * (
        len(t[name][2]) // 4))}))
    rc, report = run_cli(tiny_llama, out, tmp_path, plan_for("int8"))
    assert rc == 4
    assert all(report["checks"][c]["status"] in ("pass", "skipped") for c in ("layout", "index", "md5"))
    assert "model.layers.0.self_attn.q_proj.weight: decodes to more than" in failures(report, "decode")
    # The load check alone (structural failures skip it): transformers' int8 path turns the NaN scale
    # into garbage, not NaN, logits on CPU; a loader that propagates NaN fails on finiteness instead.
    text = "\n".join(f.line() for f in load_check_alone(tiny_llama, out, plan_for("int8")).failures)
    assert "logits: are not finite" in text or "model.layers.0.self_attn.q_proj: gives outputs" in text, text


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_a_scale_read_four_times_too_large_fails_the_load_check_naming_the_module(
        tiny_llama, quantized, copy_model, scale_in_file, tmp_path, scheme):
    """Finite and plausible: headers, layout and the unquantized bytes are all as exported, and the
    greedy tokens may still mostly agree; the module's own output is 300 % off."""
    out = copy_model(quantized(scheme), f"scale-x4-{scheme}")
    scale_in_file(out, "model.layers.1.mlp.down_proj.weight_scale", 4)
    rc, report = run_cli(tiny_llama, out, tmp_path, plan_for(scheme))
    assert rc == 4
    assert all(report["checks"][c]["status"] in ("pass", "skipped") for c in ("layout", "index", "md5"))
    assert "model.layers.1.mlp.down_proj.weight: decodes to more than" in failures(report, "decode")
    # The load check alone: the loader reads the file as written (the emulation agrees with it), and the
    # module's distance from the source, reported as its quantization error, is the 4x: (4 s - s) / s
    load = load_check_alone(tiny_llama, out, plan_for(scheme))
    assert load.status == "pass" and load.stats["max_loader_error"] <= load.stats["loader_error_limit"]
    worst = load.stats["quantization_error"][0]
    assert worst["module"] == "model.layers.1.mlp.down_proj" and 2.5 < worst["error"] < 3.5


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_an_activation_scale_calibration_never_set_fails_naming_it(tiny_llama, quantized, copy_model, tmp_path,
                                                                    scheme):
    """1.0 is what Quark's observer returns when it saw no data (an MoE expert no calibration token reached):
    the export is otherwise intact, and under fp8 the load check alone may pass it."""
    import torch
    from safetensors.torch import load_file, save_file

    out = copy_model(quantized(scheme), f"unobserved-{scheme}")
    name = "model.layers.1.mlp.up_proj.input_scale"
    tensors = load_file(out / "model.safetensors")
    assert float(tensors[name].float()) != 1.0  # calibrated on the demo text
    tensors[name] = torch.ones_like(tensors[name])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    rc, report = run_cli(tiny_llama, out, tmp_path, plan_for(scheme), "--no-load-check")
    assert rc == 4
    assert all(report["checks"][c]["status"] in ("pass", "skipped") for c in ("layout", "index", "md5"))
    assert failures(report, "calibration").startswith(f"{name}: is exactly 1.0, the scale Quark keeps for an observer")
    assert report["checks"]["calibration"]["stats"] == {"activation_scales": 14, "uncalibrated": 1}
    assert any("--num-calib-samples" in a for a in report["next_actions"])
    (tmp_path / "healthy").mkdir()
    rc, report = run_cli(tiny_llama, quantized(scheme), tmp_path / "healthy", plan_for(scheme), "--no-load-check")
    assert rc == 0 and report["checks"]["calibration"]["status"] == "pass"


def test_in_an_awq_export_a_linear_is_judged_after_its_exports_norm(tiny_llama, quantized, copy_model, scale_in_file,
                                                                    tmp_path):
    """AWQ folded scales into input_layernorm and multiplied k_proj's input channels back: k_proj alone
    is not the source's k_proj, the export's norm followed by it is. A scale read 4x still fails there."""
    healthy = quantized("int4_wo_128", algorithm="awq")
    plan = plan_for("int4_wo_128", algorithm="awq")
    rc, report = run_cli(tiny_llama, healthy, tmp_path, plan)
    assert rc == 0, failures(report, "load")
    assert any("replayed after their export's norm" in n for n in report["checks"]["load"]["notes"])
    out = copy_model(healthy, "awq-k-scale-x4")
    scale_in_file(out, "model.layers.0.self_attn.k_proj.weight_scale", 4)
    (tmp_path / "again").mkdir()
    rc, report = run_cli(tiny_llama, out, tmp_path / "again", plan)
    assert rc == 4
    assert "model.layers.0.self_attn.k_proj.weight: decodes after undoing" in failures(report, "decode")
    worst = load_check_alone(tiny_llama, out, plan).stats["quantization_error"][0]  # the file's 4x, as evidence
    assert worst["module"] == "model.layers.0.self_attn.k_proj" and worst["error"] > 1


def test_fold_units_follow_the_exports_scaling_layers():
    """Llama's AWQ groups as Quark 0.13 records them: what each module is replayed as."""
    from quark_ptq_eval.validate.folds import ReplayUnit, fold_units

    groups = [("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
              ("self_attn.v_proj", ["self_attn.o_proj"]),
              ("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"]), ("mlp.up_proj", ["mlp.down_proj"])]
    layer = "model.layers.3"
    linears = [f"{layer}.{r}" for prev, layers in groups for r in layers]
    units = fold_units(["model.embed_tokens", *linears, "lm_head"], groups, {*linears, "model.embed_tokens", "lm_head"},
                       lambda name: True)
    attn, mlp = f"{layer}.self_attn", f"{layer}.mlp"
    assert units == [ReplayUnit("model.embed_tokens"),
                     ReplayUnit(f"{attn}.q_proj", f"{layer}.input_layernorm"), ReplayUnit(f"{attn}.k_proj", f"{layer}.input_layernorm"),
                     ReplayUnit(attn, f"{layer}.input_layernorm"),  # v_proj and o_proj exchange a scale: their attention
                     ReplayUnit(f"{mlp}.gate_proj", f"{layer}.post_attention_layernorm"),
                     ReplayUnit(mlp, f"{layer}.post_attention_layernorm"),  # up_proj and down_proj: their MLP
                     ReplayUnit("lm_head")]
    # no scaling_layers recorded, or a unit that cannot run alone: the whole decoder layer
    assert fold_units([f"{attn}.q_proj"], [], set(linears), lambda name: True) == [ReplayUnit(layer, residual=True)]
    assert fold_units([f"{attn}.q_proj"], groups, set(linears), lambda name: name == layer) == [ReplayUnit(layer, residual=True)]

# --- registry ---------------------------------------------------------------------------------------------

def test_report_sections_and_progress_come_from_the_registry(tiny_llama, quantized):
    calls = []
    report = validate_model(tiny_llama, quantized("int8"), progress=lambda c, d, t: calls.append((c, d, t)))
    names = [c.name for c in CHECKS.values()]
    assert [c.name for c in report.checks] == names
    assert [(c, d, t) for c, d, t in calls if t == len(names)] == [(n, i + 1, len(names)) for i, n in enumerate(names)]
    md = report.to_markdown()
    assert all(f"## {c.title}: " in md for c in CHECKS.values())
    assert set(report.structural) == {c.name for c in CHECKS.values() if c.structural}


# --- 7. no false failures: algorithms that rewrite on purpose -------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize(("scheme", "algorithm", "by"), [("int8", "smoothquant", "smooth"), ("int4_wo_128", "gptq", None)])
def test_each_algorithm_validates_clean_against_its_plan(tiny_llama, quantized, scheme, algorithm, by):
    report = validate_model(tiny_llama, quantized(scheme, algorithm=algorithm), plan_for(scheme, algorithm=algorithm))
    assert report.status == "success", report.to_markdown()
    notes = " ".join(report.check("md5").notes)
    assert (f"rewritten by {by}" in notes) if by else report.check("md5").stats["rewritten"] == 0
