"""HF vs vLLM Tier 1: perplexity of the same token windows through HF Tier 1 (our loader,
tier_ppl.score_batch) and through a vLLM server's prompt log-probabilities (evaluate/serving/ppl.py),
with the difference against the stated tolerance and the time of each (load / start-up, scoring).

Run: ``python -m bench.benchmarks.bench_vllm_ppl --model EXPORT [--vllm-python .venv-vllm/bin/python]``;
without --model the demo model's int8 export is built (demo assets, Quark's API engine).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: a small model on a shared host

ROOT = Path(__file__).resolve().parents[2]


def int8_export() -> tuple[Path, Path]:
    from bench.benchmarks.bench_ppl import ASSETS, build_assets
    from quark_ptq_eval.execute import quark_api_engine

    model, corpus = build_assets()
    out = ASSETS / "tiny-llama-int8"
    if not (out / "config.json").exists():
        assert quark_api_engine.main(["--model_dir", str(model), "--output_dir", str(out), "--quant_scheme", "int8",
                                      "--calib_data", str(corpus), "--num_calib_data", "16", "--seq_len", "128"]) == 0
    return out, corpus


def hf_side(model: Path, windows) -> tuple[list[float], float, float]:
    from quark_ptq_eval.evaluate.ppl import tier as tier_ppl
    from quark_ptq_eval.runtime.loading import load_model

    started = time.perf_counter()
    loaded = load_model(model, "cpu", False)
    load_s = time.perf_counter() - started
    acc = tier_ppl.Accumulator()
    started = time.perf_counter()
    for start in range(0, windows.shape[0], 4):
        tier_ppl.score_batch(loaded.model, windows[start : start + 4], acc)
    return acc.window_nll, load_s, time.perf_counter() - started


def vllm_side(model: Path, windows, python: Path) -> tuple[list[float], float, float, str]:
    from quark_ptq_eval.evaluate.serving import ppl as vllm_ppl
    from quark_ptq_eval.runtime import vllm_host, vllm_server

    host = vllm_host.find_host_vllm(python)
    port = vllm_host.free_port()
    argv = vllm_host.host_server_argv(host, model, port, "bench") + ["--max-model-len", "2048"]
    log = Path("/tmp") / f"bench_vllm_ppl_{port}.log"
    try:
        with vllm_server.vllm_server(argv, port, log, 900) as server:
            start_s = server.healthy_after_s
            nlls, score_s = vllm_ppl.vllm_window_nlls(f"http://127.0.0.1:{port}", "bench", windows)
    except vllm_server.ServerNotHealthy:
        raise SystemExit(f"vLLM did not become healthy; see {log}") from None
    return nlls, start_s, score_s, host.describe()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--text", type=Path)
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=32)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from quark_ptq_eval.evaluate.ppl import tier as tier_ppl
    from quark_ptq_eval.evaluate.serving import ppl as vllm_ppl

    model, corpus = (args.model, args.text) if args.model else int8_export()
    texts = tier_ppl.eval_texts(args.text or corpus)
    windows = tier_ppl.token_windows(AutoTokenizer.from_pretrained(model), texts, args.seq_len, args.max_windows)
    hf_nll, hf_load, hf_score = hf_side(model, windows)
    vl_nll, vl_start, vl_score, server = vllm_side(model, windows, args.vllm_python)
    result = vllm_ppl.compare(hf_nll, vl_nll, hf_seconds=hf_score, vllm_seconds=vl_score)
    print(result.sentence())
    print(f"| backend | perplexity | load / start-up s | scoring s ({windows.shape[0]} x {args.seq_len} tokens) |")
    print("|---|---:|---:|---:|")
    print(f"| HF Tier 1 (ours) | {result.hf_perplexity:.4f} | {hf_load:.1f} | {hf_score:.2f} |")
    print(f"| vLLM ({server}) | {result.vllm_perplexity:.4f} | {vl_start:.1f} | {vl_score:.2f} |")
    print(json.dumps(result.as_dict() | {"hf_load_s": hf_load, "vllm_start_s": vl_start, "model": str(model)}))


if __name__ == "__main__":
    main()
