"""The recipe judged on weights no one here trained: SmolLM2-135M-Instruct (tests/fixtures/real_model.py).

Its layers carry massive activations, as real LLMs do. The plan's advice for "int8 for MI300X, accuracy first" is
run as a user types it: validation must pass (SmoothQuant's crushed rows are the scheme's damage, not Quark's
fault), Tier 1 must agree with a perplexity computed by plain transformers on the same windows, and with
--remedies the run must end on an int8 export that is not hurt. Faults planted into the real export are each named,
all in one validation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CALIBRATION = ("--num-calib-samples", "16", "--calib-seq-len", "128")
SEQ_LEN, WINDOWS = 128, 8
TIER1 = ("--eval-tier", "ppl", "--seq-len", str(SEQ_LEN), "--max-windows", str(WINDOWS), "--baseline")


@pytest.fixture(scope="module")
def mi300x_run(cli, real_model, tmp_path_factory):
    """`run --goal "int8 for MI300X, accuracy first" --remedies 1` as a user types it, small windows."""
    root = tmp_path_factory.mktemp("real-mi300x")
    wd, out = root / "wd", root / "out"
    res = cli("run", real_model.path, "-o", out, "--workdir", wd, "--goal", "int8 for MI300X, accuracy first",
              "--calib-data", real_model.calibration, *CALIBRATION, "--eval-data", real_model.evaluation, *TIER1,
              "--remedies", "1", "--offline", "--yes", timeout=2400)
    return res, wd, out


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_int8_for_mi300x_accuracy_first_ends_on_an_int8_export_that_is_not_hurt(mi300x_run):
    res, wd, out = mi300x_run
    assert res.rc == 0, res.err[-3000:]
    plan = _json(wd / "quant_plan.json")
    assert (plan["global_scheme"], plan["kv_cache_scheme"]) == ("int8", "fp8")
    assert plan["algorithm"] is None  # SmoothQuant at alpha 1 is measured, never added by rule
    validation = _json(wd / "validation_report.json")
    assert validation["status"] == "success", {k: c["status"] for k, c in validation["checks"].items()}
    results = _json(wd / "eval_results.json")
    remedies = results["details"]["remedies"]
    rows = {r["label"]: r for r in remedies["variants"]}
    print("original", results.get("verdict"), remedies["original"].get("kl_mean"),
          [(r["label"], r.get("kl_mean"), r.get("verdict"), r["outcome"]) for r in rows.values()])
    best = remedies["recommendation"]
    assert best is not None, rows
    assert rows[best["label"]]["scheme"] == "int8" and best["verdict"] in ("healthy", "watch"), best


def test_tier1_agrees_with_plain_transformers_on_the_same_windows(mi300x_run, real_model):
    from tests.fixtures.real_model import independent_perplexity

    _, wd, out = mi300x_run
    details = _json(wd / "eval_results.json")["details"]
    for model, ours in ((real_model.path, details["baseline"]["perplexity"]), (out, details["quantized"]["perplexity"])):
        theirs = independent_perplexity(model, real_model.path, real_model.evaluation, SEQ_LEN, WINDOWS)
        assert abs(ours / theirs - 1) < 0.01, (model, ours, theirs)


def test_every_fault_planted_into_the_real_export_is_named_in_one_validation(mi300x_run, real_model, tmp_path,
                                                                             scale_in_file):
    """The run's own export (int8 + FP8 KV cache, Quark's files): a weight scale x1.25, a static input scale x0.5
    and a zeroed row of codes, each named in one validation; the load check runs although the decode check failed."""
    from safetensors.torch import load_file, save_file

    from quark_ptq_eval.validate.runner import validate_model

    _, wd, out = mi300x_run
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    scale_in_file(broken, "model.layers.3.self_attn.o_proj.weight_scale", 1.25)
    scale_in_file(broken, "model.layers.5.mlp.gate_proj.input_scale", 0.5)
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.7.mlp.down_proj.weight"][11] = 0  # a row of codes zeroed
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    plan = _json(wd / "quant_plan.json")
    report = validate_model(real_model.path, broken, plan, load_check=True)
    checks = {c.name: c for c in report.checks}
    named = [f"{f.subject}: {f.message}" for c in report.checks for f in c.failures]
    for planted in ("model.layers.3.self_attn.o_proj.weight", "model.layers.5.mlp.gate_proj.input_scale",
                    "model.layers.7.mlp.down_proj.weight"):
        assert any(line.startswith(planted) for line in named), (planted, named)
    assert checks["load"].status == "fail", checks["load"].to_dict()  # run although the decode check failed
