"""Phase 2 validator: real Quark exports validate clean; each planted fault is caught by the right check."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from quark_ptq_eval.base.errors import CheckpointPending, ExitCode, UsageError, ValidationFailed
from quark_ptq_eval.base.gates import FlagApprover, Gatekeeper
from quark_ptq_eval.base.safetensors_io import INDEX_NAME, read_model_headers
from quark_ptq_eval.validate import (
    ValidationReport,
    add_validate_arguments,
    apply_fixes,
    cmd_validate,
    fix_and_revalidate,
    propose_fixes,
    validate_model,
)
from quark_ptq_eval.validate.checks import CHECKS

CONTRACT = (Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
            / "quark/_bundled_skills/_legacy_impl/shared/contracts/validation_report.schema.json")
LLAMA_SCHEMES = [("int8", None), ("fp8", None), ("int4_wo_128", None), ("int4_wo_128", "awq"), ("mxfp4", None),
                 ("nvfp4", None), ("int4_fp8", None)]
# The rest of LLMTemplate.get_supported_schemes() that Quark 0.13 exports on CPU (mx6, mx9 and
# bfp16 fail inside Quark's export there, so they have no output to validate).
MORE_SCHEMES = ["int4_wo_32", "int4_wo_per_channel", "int4_wa_64", "uint4_wo_128", "uint4_wo_per_channel", "ptpc_fp8",
                "mxfp4_weight_only", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_mxfp6_e2m3", "mxfp4_fp8", "amdfp4",
                "amdfp4_g32", "fp4_block16_scale_e4m3", "amdfp4_global16", "amdfp4_global32"]
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


# --- helpers to plant faults in raw safetensors files --------------------------------------------

def read_tensors(model_dir: Path) -> dict[str, tuple[str, list[int], bytes]]:
    out = {}
    for name, info in read_model_headers(model_dir).items():
        with open(info.file, "rb") as fh:
            fh.seek(info.start)
            out[name] = (info.dtype, list(info.shape), fh.read(info.nbytes))
    return out


def write_tensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def rewrite(model_dir: Path, edit) -> None:
    """Apply ``edit(tensors)`` to the single-file model in ``model_dir``."""
    tensors = read_tensors(model_dir)
    edit(tensors)
    write_tensors(model_dir / "model.safetensors", tensors)


def shard(model_dir: Path) -> list[Path]:
    """Split a single-file model into two shards with an index, as large models are stored."""
    tensors = read_tensors(model_dir)
    (model_dir / "model.safetensors").unlink()
    names = list(tensors)
    parts = [names[: len(names) // 2], names[len(names) // 2:]]
    files = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    weight_map = {}
    for part, fname in zip(parts, files, strict=True):
        write_tensors(model_dir / fname, {n: tensors[n] for n in part})
        weight_map.update({n: fname for n in part})
    (model_dir / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return [model_dir / f for f in files]


def shard_of(model_dir: Path, tensor: str) -> Path:
    return read_model_headers(model_dir)[tensor].file


def messages(report: ValidationReport, check: str) -> str:
    return "\n".join(f.line() for f in report.check(check).findings)


def own_plan(scheme: str, algorithm: str | None = None) -> dict:
    """The plan the export was made from: held against it, not against its own quantization_config."""
    return {"global_scheme": scheme, "exclude_layers": ["lm_head"], "layer_quant_config": {},
            "kv_cache_scheme": None, "algorithm": algorithm}


@pytest.fixture
def int8_copy(quantized, copy_model):
    return copy_model(quantized("int8"), "int8-out")


# --- every exported scheme validates clean -------------------------------------------------------

@pytest.mark.parametrize(("scheme", "algorithm"), LLAMA_SCHEMES, ids=[f"{s}-{a or 'plain'}" for s, a in LLAMA_SCHEMES])
def test_every_llama_scheme_validates_clean(tiny_llama, quantized, scheme, algorithm):
    report = validate_model(tiny_llama, quantized(scheme, algorithm=algorithm), own_plan(scheme, algorithm))
    assert report.status == "success", report.to_markdown()
    assert report.check("layout").stats["expectations_from"] == "plan"
    layout = report.check("layout").stats
    assert layout["quantized_layers"] == 2 * LINEARS_PER_LAYER
    assert report.check("md5").stats["excluded_checked"] == 1  # lm_head
    if algorithm is None:  # AWQ rewrites the four decoder norms on purpose: those are checked apart
        assert report.check("md5").stats["checked"] == 7  # and the embedding and five norms
    report.raise_for_status()


@pytest.mark.slow
@pytest.mark.parametrize("scheme", MORE_SCHEMES)
def test_every_other_exportable_scheme_validates_clean(tiny_llama, quantized, scheme):
    report = validate_model(tiny_llama, quantized(scheme), own_plan(scheme))
    assert report.status == "success", report.to_markdown()
    assert report.check("layout").stats["quantized_layers"] == 2 * LINEARS_PER_LAYER


def test_qwen3_validates_clean(tiny_model, quantized):
    report = validate_model(tiny_model("qwen3"), quantized("int8", arch="qwen3"))
    assert report.status == "success", report.to_markdown()
    assert report.check("layout").stats["quantized_layers"] == 2 * LINEARS_PER_LAYER


def test_wider_exclusions_and_a_plan_validate_clean(tiny_llama, quantized):
    out = quantized("int8", exclude=["lm_head", "*o_proj"])
    plan = {"exclude_layers": ["lm_head", "*o_proj"], "layer_quant_config": {}, "global_scheme": "int8"}
    report = validate_model(tiny_llama, out, plan)
    assert report.status == "success", report.to_markdown()
    assert report.exclusions_from == "plan"
    assert report.check("md5").stats["excluded_checked"] == 3  # lm_head and both o_proj weights
    assert report.check("layout").stats["quantized_layers"] == 2 * (LINEARS_PER_LAYER - 1)


def test_plan_exclusion_not_honoured_is_a_layout_failure(tiny_llama, quantized):
    plan = {"exclude_layers": ["lm_head", "*down_proj"], "layer_quant_config": {"*up_proj": "fp8"}}
    report = validate_model(tiny_llama, quantized("int8"), plan)
    text = messages(report, "layout")
    assert "model.layers.0.mlp.down_proj: is excluded from quantization but the output quantized it" in text
    assert "layer_quant_config['*up_proj']: the plan overrides it" in text


# --- planted faults, each caught by the right check -----------------------------------------------

def test_one_byte_in_an_excluded_tensor_fails_md5(tiny_llama, int8_copy):
    def flip(t):
        dtype, shape, data = t["lm_head.weight"]
        t["lm_head.weight"] = (dtype, shape, data[:1000] + bytes([data[1000] ^ 1]) + data[1001:])
    rewrite(int8_copy, flip)
    report = validate_model(tiny_llama, int8_copy)
    assert report.check("layout").status == "pass"
    [finding] = report.check("md5").failures
    assert finding.subject == "lm_head.weight" and finding.side == "quark"
    assert "payload differs from byte 1000 of 262144" in finding.message
    assert report.status == "failed" and report.structural_failure
    with pytest.raises(ValidationFailed) as exc:
        report.raise_for_status()
    assert exc.value.exit_code == ExitCode.VALIDATION == 4
    assert "md5" in str(exc.value) and "lm_head.weight" in str(exc.value)


def test_a_layer_left_unquantized_fails_layout(tiny_llama, int8_copy):
    module = "model.layers.1.mlp.down_proj"
    source = read_tensors(tiny_llama)

    def unquantize(t):
        for suffix in ("weight_scale", "weight_zero_point", "input_scale", "input_zero_point"):
            del t[f"{module}.{suffix}"]
        t[f"{module}.weight"] = source[f"{module}.weight"]
    rewrite(int8_copy, unquantize)
    report = validate_model(tiny_llama, int8_copy)
    finding = next(f for f in report.check("layout").failures if f.subject == module)
    assert "is not quantized: its weight is still F32 [128, 256] with no scale" in finding.message
    assert "mixed dtypes in model.layers.*.mlp.down_proj.weight" in " ".join(report.check("layout").notes)


def test_a_missing_tensor_fails_layout(tiny_llama, int8_copy):
    rewrite(int8_copy, lambda t: [t.pop("model.norm.weight"), t.pop("model.layers.0.self_attn.q_proj.weight_scale")])
    report = validate_model(tiny_llama, int8_copy)
    text = messages(report, "layout")
    assert "model.norm.weight: is missing from the output." in text
    assert "model.layers.0.self_attn.q_proj.weight_scale: is missing, but global_quant_config stores it" in text
    assert [f.subject for f in report.check("md5").failures] == ["model.norm.weight"]


def test_a_wrong_scale_size_fails_layout(tiny_llama, quantized, copy_model):
    out = copy_model(quantized("int4_wo_128"), "int4-out")
    name = "model.layers.0.mlp.up_proj.weight_scale"
    rewrite(out, lambda t: t.update({name: ("F32", [2, 256], t[name][2] * 2)}))
    report = validate_model(tiny_llama, out)
    assert (f"{name}: has shape [2, 256], but weight spec 1 (int4, per_group) with Quark's packing needs [1, 256]"
            in messages(report, "layout"))  # transposed [in/group, out], the shape of a real export


def test_a_missing_tokenizer_file_fails_aux_and_the_fix_recopies_it(tiny_llama, int8_copy):
    (int8_copy / "tokenizer.json").unlink()
    report = validate_model(tiny_llama, int8_copy)
    [finding] = report.check("aux").failures
    assert finding.subject == "tokenizer.json" and finding.side == "environment"
    assert "is missing from the output; the output's tokenizer differs in" in finding.message
    assert report.status == "failed" and not report.structural_failure
    fixes = propose_fixes(report, tiny_llama, int8_copy)
    assert [f.relative_path for f in fixes] == ["tokenizer.json"]
    with pytest.raises(CheckpointPending):
        apply_fixes(fixes, tiny_llama, int8_copy, FlagApprover())
    assert not (int8_copy / "tokenizer.json").exists()
    applied = apply_fixes(fixes, tiny_llama, int8_copy, FlagApprover(["fix"]))
    assert len(applied) == 1 and applied[0].startswith("re-copy tokenizer.json from the source (is missing")
    assert validate_model(tiny_llama, int8_copy).status == "success"


def test_the_one_fix_loop_announces_asks_the_fix_gate_applies_and_revalidates_once(tiny_llama, int8_copy):
    """The loop the validate command and the recipe's validation step share (validate/fixes.py)."""
    (int8_copy / "tokenizer.json").unlink()
    report, announced, runs = validate_model(tiny_llama, int8_copy), [], []

    def revalidate() -> ValidationReport:
        runs.append(1)
        return validate_model(tiny_llama, int8_copy)

    with pytest.raises(CheckpointPending):
        fix_and_revalidate(report, Gatekeeper(FlagApprover()), revalidate, announced.append)
    assert len(announced) == 1 and announced[0].startswith("- re-copy tokenizer.json from the source (is missing")
    assert runs == [] and not (int8_copy / "tokenizer.json").exists()  # refused: nothing applied, nothing re-run
    fixed = fix_and_revalidate(report, Gatekeeper(FlagApprover(["fix"])), revalidate, announced.append)
    assert fixed.status == "success" and runs == [1] and fixed.applied_fixes == [announced[0][2:]]
    assert fix_and_revalidate(fixed, Gatekeeper(FlagApprover()), revalidate, announced.append) is fixed  # nothing to fix


def test_a_changed_layer_count_fails_config_and_blames_the_export(tiny_llama, int8_copy):
    cfg = json.loads((int8_copy / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (int8_copy / "config.json").write_text(json.dumps(cfg))
    report = validate_model(tiny_llama, int8_copy)
    [finding] = report.check("config").failures
    assert finding.subject == "num_hidden_layers" and finding.message == "changed from 2 to 3."
    assert finding.side == "quark" and "weights hold 2 layers like the source" in finding.evidence
    assert report.check("layout").status == "pass"
    with pytest.raises(ValidationFailed, match="non-benign metadata"):
        report.raise_for_status()


def test_transformers_drift_passes_as_benign(tiny_llama, int8_copy):
    cfg = json.loads((int8_copy / "config.json").read_text())
    cfg["transformers_version"] = "9.9.9"
    cfg["torch_dtype"] = cfg.pop("dtype")
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope["rope_theta"], rope_scaling=None)
    (int8_copy / "config.json").write_text(json.dumps(cfg, indent=4))
    gen = json.loads((int8_copy / "generation_config.json").read_text())
    gen["transformers_version"] = "9.9.9"
    (int8_copy / "generation_config.json").write_text(json.dumps(gen))
    # A newer transformers repackages the tokenizer: merges as pairs, special tokens in their own file.
    tok = json.loads((int8_copy / "tokenizer.json").read_text())
    tok["model"]["merges"] = [m.split(" ") if isinstance(m, str) else m for m in tok["model"]["merges"]]
    (int8_copy / "tokenizer.json").write_text(json.dumps(tok))
    tcfg = json.loads((int8_copy / "tokenizer_config.json").read_text())
    special = {k: tcfg.pop(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    (int8_copy / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (int8_copy / "special_tokens_map.json").write_text(json.dumps(special))

    report = validate_model(tiny_llama, int8_copy)
    assert report.status == "partial", report.to_markdown()
    assert report.check("config").status == report.check("aux").status == "benign"
    config_subjects = {f.subject for f in report.check("config").findings}
    assert {"transformers_version", "dtype", "torch_dtype", "rope_parameters", "rope_theta"} <= config_subjects
    assert report.check("aux").stats["changed"] == 3 and report.check("aux").stats["extra"] == 1
    report.raise_for_status()  # benign drift does not stop the run
    assert "benign" in report.one_line()


def test_a_changed_vocabulary_is_not_benign(tiny_llama, int8_copy):
    tok = json.loads((int8_copy / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "X"] = vocab.pop(first)
    (int8_copy / "tokenizer.json").write_text(json.dumps(tok))
    report = validate_model(tiny_llama, int8_copy)
    [finding] = report.check("aux").failures
    assert finding.message == "changed: the tokenizer differs in vocab."


def test_a_truncated_shard_fails_layout_and_the_rest_is_still_judged(tiny_llama, int8_copy):
    path = int8_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    report = validate_model(tiny_llama, int8_copy)
    assert "is truncated: its data stops at byte" in messages(report, "layout")
    assert report.check("layout").failures[0].side == "environment"
    assert report.structural_failure
    assert report.check("md5").stats["checked"] > 0 and report.check("decode").stats["checked"] > 0


def test_a_header_length_beyond_the_file_fails_layout(tiny_llama, int8_copy):
    path = int8_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes((len(data) * 2).to_bytes(8, "little") + data[8:])
    report = validate_model(tiny_llama, int8_copy)
    assert f"its header claims {len(data) * 2} bytes but the file holds" in messages(report, "layout")


def test_a_non_json_header_fails_layout(tiny_llama, int8_copy):
    path = int8_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8] = ord("#")
    path.write_bytes(bytes(data))
    report = validate_model(tiny_llama, int8_copy)
    assert "its header is not valid JSON" in messages(report, "layout")


def test_sharded_outputs_validate_through_their_index(tiny_llama, int8_copy):
    shard(int8_copy)
    report = validate_model(tiny_llama, int8_copy)
    assert report.status == "success", report.to_markdown()


def test_an_index_naming_a_missing_shard_is_refused(tiny_llama, int8_copy):
    shards = shard(int8_copy)
    shards[1].unlink()
    report = validate_model(tiny_llama, int8_copy)
    assert f"Shard {shards[1]} does not exist" in messages(report, "layout")
    assert report.status == "failed"


def test_an_index_pointing_outside_the_model_is_refused_and_never_read(tiny_llama, int8_copy, tmp_path):
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"never read")
    shard(int8_copy)
    index = json.loads((int8_copy / INDEX_NAME).read_text())
    index["weight_map"]["lm_head.weight"] = "../outside.safetensors"
    (int8_copy / INDEX_NAME).write_text(json.dumps(index))
    report = validate_model(tiny_llama, int8_copy)
    assert "outside the model directory; refusing to follow it" in messages(report, "layout")
    link = int8_copy / "escape.safetensors"
    link.symlink_to(outside)
    index["weight_map"]["lm_head.weight"] = "escape.safetensors"
    (int8_copy / INDEX_NAME).write_text(json.dumps(index))
    report = validate_model(tiny_llama, int8_copy)
    assert "points outside the model directory" in messages(report, "layout")


def test_an_excluded_tensor_in_another_dtype_blames_the_environment(tiny_llama, int8_copy):
    def to_half_width(t):
        dtype, shape, data = t["lm_head.weight"]
        t["lm_head.weight"] = ("F16", shape, data[: len(data) // 2])
    rewrite(int8_copy, to_half_width)
    report = validate_model(tiny_llama, int8_copy)
    [finding] = report.check("md5").failures
    assert finding.side == "environment" and "header changed from F32 [512, 128] to F16 [512, 128]" in finding.message


# --- report, contract and CLI ---------------------------------------------------------------------

def test_report_contract_markdown_and_atomic_write(tiny_llama, quantized, tmp_path):
    report = validate_model(tiny_llama, quantized("fp8"))
    contract = report.to_contract()
    jsonschema.validate(contract, json.loads(CONTRACT.read_text()))
    assert contract["status"] == "success" and list(contract["checks"]) == [c.name for c in CHECKS.values()]
    md, js = report.write(tmp_path)
    assert (md.name, js.name) == ("validation_report.md", "validation_report.json")
    assert json.loads(js.read_text()) == json.loads(json.dumps(contract))
    text = md.read_text()
    for title in [c.title for c in CHECKS.values()] + ["Next actions"]:
        assert f"## {title}" in text
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_failed_report_validates_against_the_contract(tiny_llama, int8_copy):
    (int8_copy / "generation_config.json").unlink()  # README.md is the export's own card: not an aux copy
    report = validate_model(tiny_llama, int8_copy)
    contract = report.to_contract()
    jsonschema.validate(contract, json.loads(CONTRACT.read_text()))
    assert contract["status"] == "failed"
    assert any("generation_config.json" in line for line in contract["evidence"])


def test_max_samples_draws_a_seeded_subset(tiny_llama, quantized):
    out = quantized("int8", exclude=["lm_head", "*o_proj"])
    plan = {"exclude_layers": ["lm_head", "*o_proj"]}
    a = validate_model(tiny_llama, out, plan, max_samples=2, seed=7).check("md5").stats
    b = validate_model(tiny_llama, out, plan, max_samples=2, seed=7, workers=1).check("md5").stats
    assert a["checked"] == 2 and a["candidates"] == 9 and a["sampled"] is True  # lm_head, 2 o_proj, embed, 5 norms
    assert a["checked_names"] == b["checked_names"]
    with pytest.raises(UsageError):
        validate_model(tiny_llama, out, max_samples=0)


def test_the_keywords_validate_model_takes_are_its_options_fields():
    from dataclasses import fields

    from quark_ptq_eval.validate.runner import ValidateKeywords, ValidateOptions

    assert set(ValidateKeywords.__annotations__) == {f.name for f in fields(ValidateOptions)}


def test_missing_directories_are_usage_errors(tiny_llama, tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        validate_model(tiny_llama, tmp_path / "nope")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path)
    add_validate_arguments(parser)
    return parser.parse_args(argv)


def test_cmd_validate_clean_prints_one_line_and_writes_reports(tiny_llama, quantized, tmp_path, capsys):
    args = parse(["--source", str(tiny_llama), "--quantized", str(quantized("int8")), "--workdir", str(tmp_path)])
    assert cmd_validate(args, FlagApprover()) == 0
    out = capsys.readouterr().out
    assert out.startswith("Validation passed in")
    assert (tmp_path / "validation_report.md").exists() and (tmp_path / "validation_report.json").exists()


def test_cmd_validate_offers_the_fix_and_applies_it_on_approval(tiny_llama, int8_copy, tmp_path, capsys):
    (int8_copy / "generation_config.json").unlink()
    plan = tmp_path / "quant_plan.json"
    plan.write_text(json.dumps({"exclude_layers": ["lm_head"], "layer_quant_config": {}}))
    argv = ["--source", str(tiny_llama), "--quantized", str(int8_copy), "--plan", str(plan), "--workdir", str(tmp_path)]
    with pytest.raises(CheckpointPending) as exc:
        cmd_validate(parse(argv), FlagApprover())
    assert exc.value.exit_code == ExitCode.CHECKPOINT
    assert "generation_config.json" in capsys.readouterr().err
    assert json.loads((tmp_path / "validation_report.json").read_text())["status"] == "failed"
    assert cmd_validate(parse(argv), FlagApprover(["fix"])) == 0
    assert "Applied fix: re-copy generation_config.json" in capsys.readouterr().out
    saved = json.loads((tmp_path / "validation_report.json").read_text())
    assert saved["status"] == "success" and saved["applied_fixes"]


def test_cmd_validate_structural_failure_raises_exit_4(tiny_llama, int8_copy, tmp_path, capsys):
    rewrite(int8_copy, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    args = parse(["--source", str(tiny_llama), "--quantized", str(int8_copy), "--workdir", str(tmp_path)])
    with pytest.raises(ValidationFailed) as exc:
        cmd_validate(args, FlagApprover(["fix"]))
    assert exc.value.exit_code == 4
    assert "model.layers.0.mlp.up_proj.weight" in capsys.readouterr().err


def test_importing_the_validator_pulls_in_no_heavy_library():
    code = ("import sys, time; t = time.perf_counter(); import quark_ptq_eval.validate; "
            "print(time.perf_counter() - t); "
            "print(sorted(m for m in ('torch', 'transformers', 'quark', 'numpy', 'jsonschema') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[1] == "[]"  # its wall time is a benchmark row (bench/benchmarks/bench_validate.py), not a test


def test_cmd_validate_config_only_failure_stops_without_asking_for_a_fix(tiny_llama, int8_copy, tmp_path, capsys):
    cfg = json.loads((int8_copy / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (int8_copy / "config.json").write_text(json.dumps(cfg))
    args = parse(["--source", str(tiny_llama), "--quantized", str(int8_copy), "--workdir", str(tmp_path)])
    with pytest.raises(ValidationFailed, match="non-benign metadata"):
        cmd_validate(args, FlagApprover())  # no fix exists, so the fix gate is never asked
    err = capsys.readouterr().err
    assert err.count("hidden_act: changed from \"silu\" to \"gelu\".") == 1
