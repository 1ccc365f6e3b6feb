"""What this host must hold: the engine's peak memory, the output on disk, and the stop when it cannot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quark_ptq_eval.base.gates import FlagApprover
from quark_ptq_eval.base.plan_records import DeviceStrategy, PlannedCalibration
from quark_ptq_eval.context.preflight import detect_env
from quark_ptq_eval.intake import analyze_model
from quark_ptq_eval.plan import PlanRequest, make_plan
from quark_ptq_eval.plan import resources as R
from quark_ptq_eval.plan.fit_gate import hold_message
from quark_ptq_eval.plan.host_fit import assess
from tests.plan.test_plan_targets import LLAMA_8B, cpu_env, header_only_llama

# Runs the engine in a child and prints the child's peak RSS in bytes (Linux reports KiB).
PEAK_RSS = """
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


@pytest.fixture(scope="module")
def tiny_analysis(tiny_llama, catalog):
    return analyze_model(str(tiny_llama), offline=True, catalog=catalog)


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    return header_only_llama(tmp_path_factory.mktemp("llama8b") / "llama-8b", **LLAMA_8B)


@pytest.fixture(scope="module")
def llama8b_analysis(llama8b, catalog):
    return analyze_model(str(llama8b), offline=True, catalog=catalog)


def calib(samples=16, seq=128):
    return PlannedCalibration("local_file", None, "calibration.txt", samples, seq, 1)


@pytest.mark.parametrize("scheme", ["fp8", "int4_wo_128"])
def test_output_size_estimate_matches_a_real_export(quantized, tiny_analysis, catalog, scheme):
    real = sum(f.stat().st_size for f in quantized(scheme).glob("*.safetensors"))
    estimate = R.output_bytes(tiny_analysis, scheme, catalog["scheme_info"][scheme])
    assert abs(estimate - real) / real < 0.10, (estimate, real)


@pytest.mark.slow
def test_peak_memory_estimate_within_25_percent_of_a_measured_engine_run(tiny_llama, tiny_analysis, catalog,
                                                                          corpus, tmp_path):
    argv = [sys.executable, "-m", "quark_ptq_eval.execute.quark_api_engine", "--model_dir", str(tiny_llama),
            "--output_dir", str(tmp_path / "out"), "--quant_scheme", "fp8", "--calib_data", str(corpus),
            "--num_calib_data", "16", "--seq_len", "128"]
    rc, peak = map(int, subprocess.run([sys.executable, "-c", PEAK_RSS, *argv], capture_output=True, text=True,
                                       check=True).stdout.split())
    assert rc == 0
    estimate = R.estimate_quantize(tiny_analysis, catalog["scheme_info"]["fp8"], None, calib(), "cpu")
    assert abs(estimate["host_peak_bytes"] - peak) / peak < 0.25, (estimate, peak)


def test_an_8b_model_does_not_fit_a_24_gib_host_and_the_plan_proposes_what_does(llama8b_analysis, catalog,
                                                                                corpus, tmp_path):
    """The whole-model engine asked for does not fit: the plan stops and proposes what does, the sequential
    engine among them; asked for nothing, the plan picks the sequential engine itself."""
    req = PlanRequest(scheme="fp8", calib_data=str(corpus), target="mi300x", engine="quark-api")
    p = make_plan(llama8b_analysis, cpu_env(24), req, catalog, tmp_path / "a.json", tmp_path / "out")
    res = p.resources
    assert not res["fits"]
    sequential = next(x for x in res["proposals"] if x["change"] == "--engine sequential")
    assert "one decoder block at a time" in sequential["detail"] and "(fits)" in sequential["detail"]
    auto = make_plan(llama8b_analysis, cpu_env(24), PlanRequest(scheme="fp8", calib_data=str(corpus), target="mi300x"),
                     catalog, tmp_path / "a.json", tmp_path / "out")
    assert auto.engine.name == "sequential" and auto.resources["fits"], auto.engine
    reason = next(d for d in auto.decisions if d["decision"] == "engine")["reason"]
    assert "file-to-file cannot run this plan (the scheme has static activation scales" in reason, reason
    assert res["quantize"]["host_peak_bytes"] > 2 * llama8b_analysis.size["bytes"]  # measured factor > 2
    assert [x["what"] for x in res["problems"] if x["blocking"]] == ["host RAM"]
    rerun = next(x for x in res["proposals"] if x["change"] == "another host")["command"]
    assert rerun.startswith("quark-ptq-eval run ") and "--device cuda" in rerun and "--target mi300x" in rerun
    assert any(d["decision"] == "does not fit: host RAM" and d["value"] == "STOP" for d in p.decisions)
    roomy = make_plan(llama8b_analysis, cpu_env(512), req, catalog, tmp_path / "a.json", tmp_path / "out")
    assert roomy.resources["fits"] and not roomy.resources["proposals"] and roomy.engine.name == "quark-api"


def test_fewer_samples_and_no_algorithm_are_proposed_with_their_estimates(llama8b_analysis, catalog):
    info = catalog["scheme_info"]["int4_wo_128"]
    host = {"ram_bytes": 24 * R.GIB, "ram_available_bytes": None, "gpu_bytes_per_device": 0, "gpu_count": 0,
            "disk_free_bytes": None}
    res = assess(R.QuantizeWorkload(llama8b_analysis, "int4_wo_128", info, "gptq", calib(512, 2048),
                                    DeviceStrategy("cpu", False)), host, ["quark-ptq-eval", "run"])
    changes = [x["change"] for x in res["proposals"]]
    assert changes[:3] == ["--num-calib-samples 128", "--calib-seq-len 256", "--algorithm '' (plain PTQ)"]
    assert all("about" in x["detail"] for x in res["proposals"])


def test_gpu_memory_and_disk_are_checked_and_multi_device_proposed(llama8b_analysis, catalog):
    info = catalog["scheme_info"]["fp8"]
    host = {"ram_bytes": 256 * R.GIB, "ram_available_bytes": None, "gpu_bytes_per_device": 16 * R.GIB,
            "gpu_count": 2, "disk_free_bytes": 2 * R.GIB}
    res = assess(R.QuantizeWorkload(llama8b_analysis, "fp8", info, None, calib(), DeviceStrategy("cuda", False)),
                   host, [])
    assert {x["what"] for x in res["problems"] if x["blocking"]} == {"GPU memory", "disk"}
    assert "--multi-device" in [x["change"] for x in res["proposals"]]


def test_kv_cache_and_serving_fit_of_an_8b_llama(llama8b_analysis):
    assert R.kv_bytes_per_token(llama8b_analysis, "fp8") == 2 * 32 * 8 * 128  # K and V, 8 KV heads of 128, 1 byte
    assert R.kv_bytes_per_token(llama8b_analysis, None) == 2 * 2 * 32 * 8 * 128
    fit = R.serving_fit(llama8b_analysis, 8 * 10**9, "fp8", 80, {"devices": 1, "context": 131072, "batch": 16})
    assert fit.kv_cache_bytes == 65536 * 131072 * 16 and not fit.fits_budget and fit.devices_needed == 4
    assert list(fit.to_dict()) == ["weights_bytes", "kv_cache_bytes", "context", "batch", "device_memory_gb",
                                   "devices_needed", "fits_budget"]  # plan.json's target.serving_fit, as written


def test_only_a_named_approval_or_plan_only_lets_an_unfit_plan_past_the_checkpoint(llama8b_analysis, catalog,
                                                                                  corpus, tmp_path):
    req = PlanRequest(scheme="fp8", calib_data=str(corpus))
    p = make_plan(llama8b_analysis, cpu_env(3), req, catalog, tmp_path / "a.json", tmp_path / "out")  # no engine fits
    assert "cannot hold this plan" in hold_message(p, "batch_execute", FlagApprover(all_gates=True), False)
    assert hold_message(p, "batch_execute", FlagApprover(["plan"]), False) is None
    assert hold_message(p, "plan_only", FlagApprover(all_gates=True), False) is None


def test_cli_stops_a_plan_this_host_cannot_hold_before_anything_runs(cli, llama8b, corpus, tmp_path):
    env = detect_env()
    env["hardware"]["host_memory_gb"] = 3.0  # the host as the user states it: not even one block at a time fits
    (tmp_path / "env.json").write_text(json.dumps(env))
    wd, out = tmp_path / "work", tmp_path / "out"
    res = cli("run", llama8b, "-o", out, "--workdir", wd, "--scheme", "fp8", "--calib-data", corpus, "--offline",
              "--env-context", tmp_path / "env.json", "--yes")
    assert res.rc == 3, res.err
    assert "cannot hold this plan" in res.err and "--approve plan" in res.err and "Traceback" not in res.err
    saved = json.loads((wd / "quant_plan.json").read_text())
    assert saved["resources"]["fits"] is False and saved["resources"]["proposals"]
    assert not out.exists() and not (wd / "run_manifest.yaml").exists() and not (wd / "logs").exists()


def test_a_plan_only_the_disk_blocks_proposes_another_disk_not_another_host(llama8b_analysis, catalog):
    """The 405 B fp8 plan here fit the sequential engine in RAM but not its output on disk, and proposed "a host
    with at least 17.3 GiB of RAM" on a 23.5 GiB host: the proposal now follows what blocks."""
    info = catalog["scheme_info"]["fp8"]
    host = {"ram_bytes": 512 * R.GIB, "ram_available_bytes": None, "gpu_bytes_per_device": 0, "gpu_count": 0,
            "disk_free_bytes": 2 * R.GIB}
    res = assess(R.QuantizeWorkload(llama8b_analysis, "fp8", info, None, calib(), DeviceStrategy("cpu", False)), host, [])
    assert not res["fits"] and [x["what"] for x in res["problems"] if x["blocking"]] == ["disk"]
    assert [x["change"] for x in res["proposals"]] == ["-o on another disk"]
    assert R.gb(res["output_bytes"]) in res["proposals"][0]["detail"] and "memory is not the problem" in \
        res["proposals"][0]["detail"]
    host["ram_bytes"] = 8 * R.GIB  # memory blocks too: both said, the memory proposals after the disk's
    changes = [x["change"] for x in assess(R.QuantizeWorkload(llama8b_analysis, "fp8", info, None, calib(),
                                                             DeviceStrategy("cpu", False)), host, [])["proposals"]]
    assert changes[0] == "-o on another disk" and changes[-1] == "another host"


def test_where_the_sequential_engine_is_over_the_host_with_the_plans_calibration_fewer_samples_are_proposed(
        llama8b_analysis, catalog):
    """Llama-3.1-405B fp8 for MI300X here: the sequential engine with the plan's 128 x 512 calibration is about
    21.6 GiB on a 23.5 GiB host (over its 90 %), with 64 samples 17.6 GiB: the plan says both, the second as a
    command that fits. Here the same on the 8 B shape, a host sized between the two estimates."""
    info = catalog["scheme_info"]["fp8"]
    work = R.QuantizeWorkload(llama8b_analysis, "fp8", info, None, calib(128, 2048), DeviceStrategy("cpu", False))
    full = R.estimate_sequential(llama8b_analysis, None, calib(128, 2048))["host_peak_bytes"]
    half = R.estimate_sequential(llama8b_analysis, None, calib(64, 2048))["host_peak_bytes"]
    assert half < full
    host = {"ram_bytes": int((full + half) / 2 / R.HEADROOM), "ram_available_bytes": None, "gpu_bytes_per_device": 0,
            "gpu_count": 0, "disk_free_bytes": None}
    said = {x["change"]: x["detail"] for x in assess(work, host, [])["proposals"]}
    assert said["--engine sequential"].endswith("(still too much)")
    assert said["--engine sequential --num-calib-samples 64"].endswith(f"about {R.gb(half)} (fits)")
    host["ram_bytes"] = int(R.BASE_BYTES)  # nothing fits: no sample count is proposed
    assert not any("--num-calib-samples" in c and "sequential" in c for c in
                   (x["change"] for x in assess(work, host, [])["proposals"]))
