"""The file-to-file engine: chosen when the whole-model engine does not fit the host, refused for
what it cannot quantize, and its real export validated like any other."""

from __future__ import annotations

import json

import pytest

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.gates import FlagApprover
from quark_ptq_eval.base.plan_records import PlannedCalibration
from quark_ptq_eval.intake import analyze_model
from quark_ptq_eval.plan import PlanRequest, make_plan
from quark_ptq_eval.plan import resources as R
from quark_ptq_eval.plan.fit_gate import hold_message
from tests.plan.test_plan_targets import cpu_env


@pytest.fixture(scope="module")
def tiny_analysis(tiny_llama, catalog):
    return analyze_model(str(tiny_llama), offline=True, catalog=catalog)


def plan_for(analysis, catalog, corpus, tmp_path, host_gib: float, **request):
    req = PlanRequest(calib_data=str(corpus), **request)
    return make_plan(analysis, cpu_env(host_gib), req, catalog, tmp_path / "a.json", tmp_path / "out")


def engine_row(plan):
    return next(d for d in plan.decisions if d["decision"] == "engine")


def test_the_plan_picks_file2file_when_the_whole_model_engine_does_not_fit_the_host(tiny_analysis, catalog,
                                                                                   corpus, tmp_path):
    info = catalog["scheme_info"]["ptpc_fp8"]
    whole = R.estimate_quantize(tiny_analysis, info, None, PlannedCalibration("local_file", None, "c.txt", 32, 512, 1),
                                "cpu")["host_peak_bytes"]
    f2f = R.estimate_file2file(tiny_analysis, "cpu")["host_peak_bytes"]
    assert f2f < whole
    host_gib = (whole + f2f) / 2 / R.HEADROOM / R.GIB  # between the two estimates
    p = plan_for(tiny_analysis, catalog, corpus, tmp_path, host_gib, scheme="ptpc_fp8")
    assert p.engine.name == "file2file" and p.resources["fits"]
    reason = engine_row(p)["reason"]
    assert R.gb(whole) in reason and R.gb(host_gib * R.GIB) in reason and "file-to-file" in reason, reason
    assert p.resources["quantize"]["host_peak_bytes"] == f2f
    # A static scheme needs calibration: the whole-model engine stays and the plan stops (file2file is no proposal;
    # on a model this small one block and the embeddings are the model, so the sequential engine saves nothing).
    static = plan_for(tiny_analysis, catalog, corpus, tmp_path, host_gib, scheme="fp8")
    assert static.engine.name == "quark-api" and not static.resources["fits"]
    assert "--engine file2file" not in [x["change"] for x in static.resources["proposals"]]
    roomy = plan_for(tiny_analysis, catalog, corpus, tmp_path, 64, scheme="ptpc_fp8")
    assert roomy.engine.name == "quark-api" and roomy.resources["fits"]


def test_a_plan_no_engine_can_hold_stops_at_the_plan_checkpoint(tiny_analysis, catalog, corpus, tmp_path):
    p = plan_for(tiny_analysis, catalog, corpus, tmp_path, 0.5, scheme="ptpc_fp8")
    assert not p.resources["fits"] and p.engine.name == "quark-api"
    f2f_row = next(x for x in p.resources["proposals"] if x["change"] == "--engine file2file")
    assert "still too much" in f2f_row["detail"]
    assert "cannot hold this plan" in hold_message(p, "batch_execute", FlagApprover(all_gates=True), False)
    assert any(d["value"] == "STOP" for d in p.decisions)


@pytest.mark.parametrize("request_, why", [
    ({"scheme": "int4_wo_128"}, "integer weights"),
    ({"scheme": "fp8"}, "static activation scales"),
    ({"scheme": "ptpc_fp8", "kv_cache_scheme": "fp8"}, "KV-cache scales"),
])
def test_explicit_file2file_refuses_what_it_cannot_quantize(tiny_analysis, catalog, corpus, tmp_path, request_, why):
    with pytest.raises(UsageError, match=why):
        plan_for(tiny_analysis, catalog, corpus, tmp_path, 64, engine="file2file", **request_)


def test_run_engine_file2file_writes_a_validated_export(tiny_llama, corpus, tmp_path):
    # In process (the API behind `run --engine file2file`): the load check shares the session's Quark
    # import; the engine is still a child process, as for users.
    from quark_ptq_eval.flows import api

    wd, out = tmp_path / "work", tmp_path / "out"
    summary = api.run(tiny_llama, out, workdir=wd, approver=FlagApprover(all_gates=True), eval_tier="skip",
                      offline=True, scheme="mxfp4", engine="file2file", calib_data=str(corpus))
    assert summary["validation"] == "success", summary
    assert "## Loads and runs (probe against the source): pass" in (wd / "validation_report.md").read_text()
    manifest = (wd / "run_manifest.yaml").read_text()
    assert "quark_ptq_eval.execute.engines.file2file" in manifest and "--num_calib_data" not in manifest
    assert "peak RSS" in (wd / "logs" / "engine.log").read_text()
    card = (out / "README.md").read_text()  # the export's own card, not the base model's copied
    assert card != (tiny_llama / "README.md").read_text() and "Not evaluated: evaluation was skipped" in card
    assert "## Evaluation" in card and "model-index" not in card  # no results section invented
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["global_quant_config"]["weight"]["dtype"] == "fp4"
