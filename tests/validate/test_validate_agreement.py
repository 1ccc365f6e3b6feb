"""Agreement with Quark's own validator (``quant_validation.py`` shipped in amd-quark), on the same pairs.

Its helper is imported from the installed package for the test only. On clean and faulty
source/output pairs its aux, config and MD5 verdicts (and the files, paths and tensors they
name) equal ours, and its fuzzy pattern summary equals our layout check's.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from quark_ptq_eval.validate import ValidationReport, validate_model
from tests.validate.test_validate import read_tensors, rewrite, write_tensors

HELPER = (Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
          / "quark/_bundled_skills/_legacy_impl/l1-atomic/torch/quark-torch-result-validator/quant_validation.py")
# Quark's aux helper ignores generation_config.json (exports may rewrite it); ours checks it and
# triages its drift, so the comparison leaves that one file out.
QUARK_AUX_IGNORED = {"generation_config.json"}


@pytest.fixture(scope="module")
def quark_validation():
    spec = importlib.util.spec_from_file_location("quark_quant_validation_peer", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flip_lm_head_byte(out: Path) -> None:
    def flip(t):
        dtype, shape, data = t["lm_head.weight"]
        t["lm_head.weight"] = (dtype, shape, bytes([data[0] ^ 0x80]) + data[1:])
    rewrite(out, flip)


def drop_tokenizer(out: Path) -> None:
    (out / "tokenizer.json").unlink()


def edit_readme(out: Path) -> None:  # README.md is the export's own card now: an aux file edited instead
    (out / "generation_config.json").write_text("edited after export\n")


def more_layers(out: Path) -> None:
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (out / "config.json").write_text(json.dumps(cfg))


def version_drift(out: Path) -> None:
    cfg = json.loads((out / "config.json").read_text())
    cfg["transformers_version"] = "9.9.9"
    (out / "config.json").write_text(json.dumps(cfg))


def lm_head_in_half_precision(out: Path) -> None:
    def cast(t):
        dtype, shape, data = t["lm_head.weight"]
        t["lm_head.weight"] = ("F16", shape, data[: len(data) // 2])
    rewrite(out, cast)


def truncate_lm_head(out: Path) -> None:
    tensors = read_tensors(out)
    lm_head = tensors.pop("lm_head.weight")
    write_tensors(out / "model.safetensors", {**tensors, "lm_head.weight": lm_head})  # lm_head's bytes last
    path = out / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-64])


def drop_lm_head(out: Path) -> None:
    rewrite(out, lambda t: t.pop("lm_head.weight"))


FAULTS = [None, flip_lm_head_byte, drop_tokenizer, edit_readme, more_layers, version_drift,
          lm_head_in_half_precision, truncate_lm_head, drop_lm_head]


def quark_verdicts(qv, source: Path, out: Path, report: ValidationReport) -> dict:
    aux = qv.check_auxiliary_files_copied(source, out)
    config = qv.check_config_json_equal_except_quantization(source / "config.json", out / "config.json")
    md5 = qv.check_non_quantized_tensors_md5_unchanged(
        source, out, {"exclude": report.exclude_patterns, "max_samples": 1000, "random_seed": 0})
    return {
        # README.md is the export's own model card (issue 35), never the base model's: Quark's validator
        # expects the base card copied, ours leaves it out on both sides
        "aux_ok": not (set(aux["missing_files"]) - {"README.md"})
        and not ({m["path"] for m in aux["mismatched_files"]} - {"README.md"}) and aux["ok"] is not None,
        "aux_missing": set(aux["missing_files"]) - {"README.md"},
        "aux_changed": {m["path"] for m in aux["mismatched_files"]} - {"README.md"},
        "config_ok": config["ok"],
        "config_paths": {m.split(":")[0] for m in config["mismatches"] if "value mismatch" in m},
        "md5_ok": md5["ok"],
        "md5_failed": {m["name"] for m in md5["mismatches"]},
        "md5_checked": md5["checked_count"],
    }


def our_verdicts(report: ValidationReport) -> dict:
    aux, config, md5 = report.check("aux"), report.check("config"), report.check("md5")
    missing = set(aux.stats["missing_files"]) - QUARK_AUX_IGNORED
    changed = set(aux.stats["changed_files"]) - QUARK_AUX_IGNORED
    return {
        "aux_ok": not missing and not changed,
        "aux_missing": missing,
        "aux_changed": changed,
        # Quark's verdict is "identical after removing quantization_config"; ours triages the same diff.
        "config_ok": not config.findings,
        "config_paths": {f.subject for f in config.findings if f.message.startswith("changed from")},
        "md5_ok": md5.status == "pass",
        "md5_failed": {f.subject for f in md5.failures},
        "md5_checked": md5.stats.get("excluded_checked", 1 if md5.failures else 0),
    }


@pytest.mark.parametrize("fault", FAULTS, ids=[f.__name__ if f else "clean" for f in FAULTS])
def test_verdicts_agree_with_quarks_validator(quark_validation, tiny_llama, quantized, copy_model, fault):
    out = copy_model(quantized("int8"), "int8-agreement")
    if fault:
        fault(out)
    report = validate_model(tiny_llama, out)
    ours, theirs = our_verdicts(report), quark_verdicts(quark_validation, tiny_llama, out, report)
    assert ours == theirs
    assert report.status == ("success" if fault is None else "partial" if fault is version_drift else "failed")


@pytest.mark.parametrize(("scheme", "arch"), [("fp8", "llama"), ("mxfp4", "llama"), ("int8", "qwen3")])
def test_clean_exports_agree_and_fuzzy_patterns_match(quark_validation, tiny_model, quantized, scheme, arch):
    source, out = tiny_model(arch), quantized(scheme, arch=arch)
    report = validate_model(source, out)
    ours, theirs = our_verdicts(report), quark_verdicts(quark_validation, source, out, report)
    assert ours == theirs and ours["aux_ok"] and ours["config_ok"] and ours["md5_ok"]
    layout = report.check("layout").stats
    assert layout["output_fuzzy"] == quark_validation.get_fuzzy_tensor_names(out)
    assert layout["source_fuzzy"] == quark_validation.get_fuzzy_tensor_names(source)
