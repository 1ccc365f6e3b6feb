"""The recipe judged on weights no one here trained: SmolLM2-135M-Instruct (tests/fixtures/real_model.py).

Its layers carry massive activations, as real LLMs do. The plan's advice for "int8 for MI300X, accuracy first" is
run as a user types it: validation must pass (SmoothQuant's crushed rows are the scheme's damage, not Quark's
fault), Tier 1 must agree with a perplexity computed by plain transformers on the same batches of windows, and with
--remedies the run must end on an int8 export that is not hurt. Faults planted into the real export (a truncated
shard among them) are each named, all in one validation.
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
        theirs = independent_perplexity(model, real_model.path, real_model.evaluation, SEQ_LEN, WINDOWS,
                                        details["batch_size"])
        assert abs(ours / theirs - 1) < 0.01, (model, ours, theirs)


def test_every_fault_planted_into_the_real_export_is_named_in_one_validation(mi300x_run, real_model, tmp_path):
    """The run's own export (int8 + FP8 KV cache, Quark's files) cut into two shards as a larger release ships, with
    a weight scale x1.25, a static input scale x0.5 and a zeroed row of codes in the first shard and the second
    truncated (a partial download): all four named in one validation; the load check runs on the blocks whose bytes
    are all there although the decode check failed."""
    from safetensors.torch import load_file, save_file

    from quark_ptq_eval.validate.runner import validate_model

    _, wd, out = mi300x_run
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    tensors = load_file(broken / "model.safetensors")
    (broken / "model.safetensors").unlink()
    tensors["model.layers.3.self_attn.o_proj.weight_scale"] *= 1.25
    tensors["model.layers.5.mlp.gate_proj.input_scale"] *= 0.5
    tensors["model.layers.7.mlp.down_proj.weight"][11] = 0  # a row of codes zeroed
    second = {n for n in tensors if n.startswith("model.layers.") and int(n.split(".")[2]) >= 20}
    shards = {"model-00001-of-00002.safetensors": sorted(tensors.keys() - second),
              "model-00002-of-00002.safetensors": sorted(second)}
    for shard, names in shards.items():
        save_file({n: tensors[n] for n in names}, broken / shard, metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: shard for shard, names in shards.items() for n in names}}))
    cut = broken / "model-00002-of-00002.safetensors"
    with open(cut, "r+b") as fh:  # the download stopped a third of the way before the end
        fh.truncate(cut.stat().st_size * 2 // 3)
    report = validate_model(real_model.path, broken, _json(wd / "quant_plan.json"), load_check=True)
    checks = {c.name: c for c in report.checks}
    named = [f"{f.subject}: {f.message}" for c in report.checks for f in c.failures]
    for planted in ("model.layers.3.self_attn.o_proj.weight", "model.layers.5.mlp.gate_proj.input_scale",
                    "model.layers.7.mlp.down_proj.weight", "model-00002-of-00002.safetensors: is truncated"):
        assert any(line.startswith(planted) for line in named), (planted, named)
    assert checks["index"].status == "pass", checks["index"].to_dict()
    load = checks["load"]
    assert load.status == "fail" and load.stats["blocks_replayed"] < 30, load.to_dict()  # the blocks before the cut
    assert any("past a truncated shard's cut" in n for n in load.notes), load.notes
