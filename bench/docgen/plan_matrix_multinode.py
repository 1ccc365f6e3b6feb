"""The plan matrix's multi-node cells: BF16 baselines too large for one node of the target, at real size.

Per cell a sparse checkpoint with the published model's BF16 tensor names and shapes (bench_real_size_plans:
valid safetensors whose data regions are holes, no disk cost) is taken through intake and an fp8 plan for
the target (its serving fit sizes the quantized server), then through Tier 3's own command planning
(``served_models`` -> ``plan_commands`` -> ``write_script``) with the BF16 checkpoint as the baseline. A cell
is green when every server wider than one node (``vllm_multinode.GPUS_PER_NODE`` GPUs) is launched with
tensor parallel within a node, pipeline parallel across nodes and ``--distributed-executor-backend ray``,
the script holds the Ray bring-up and its ``srun`` form and checks the cluster's GPUs before any server
starts, and ``bash -n`` accepts it.

    python -m bench.docgen.plan_matrix_multinode [--work DIR]      (or: python -m bench.docgen.plan_matrix --multinode)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.benchmarks.bench_real_size_plans import BF16, F8, deepseek_v3, mla_moe, write_sparse


def bf16_release(shapes):
    """A release's shapes as its BF16 checkpoint: FP8 weights in BF16, no block scales, no quantization_config."""
    config, tensors, shards = shapes()
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    tensors = [(n, BF16 if d == F8 else d, s) for n, d, s in tensors if not n.endswith("_scale_inv")]
    return config, tensors, shards * 2


def kimi_k2():
    """Kimi-K2 as its BF16 checkpoint: DeepSeek-V3's architecture with 384 routed experts, 64 heads,
    vocabulary 163840, the first layer dense, no MTP layer."""
    return mla_moe(experts=384, heads=64, vocab=163840, dense=1, mtp=False, fp8_blocks=False, shards=128)


CELLS = {  # name -> (BF16 shapes, target)
    "kimi-k2-bf16/mi300x": (kimi_k2, "mi300x"),
    "deepseek-v3-bf16/mi300x": (lambda: bf16_release(deepseek_v3), "mi300x"),
    "deepseek-v3-bf16/h100": (lambda: bf16_release(deepseek_v3), "h100"),
}


def run_cell(name: str, work: Path) -> dict:
    from quark_ptq_eval.base.catalog import load_catalog
    from quark_ptq_eval.context.preflight import detect_env
    from quark_ptq_eval.evaluate import EvalOptions
    from quark_ptq_eval.evaluate.serving.commands import plan_commands, served_models
    from quark_ptq_eval.evaluate.serving.detect import Environment
    from quark_ptq_eval.evaluate.serving.multinode import layout_for
    from quark_ptq_eval.evaluate.vllm.script import write_script
    from quark_ptq_eval.flows import api
    from quark_ptq_eval.intake import analyze_model

    shapes, target = CELLS[name]
    config, tensors, shards = shapes()
    base = work / name.replace("/", "-")
    model, wd = base / "bf16", base / "work"
    wd.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not (model / "config.json").exists():
        write_sparse(model, config, tensors, shards)
    analysis = analyze_model(str(model), offline=True, catalog=load_catalog())
    analysis.write(wd)
    plan = api.plan_quantization(analysis, base / "fp8", env_context=detect_env(), workdir=wd, scheme="fp8",
                                 target=target, num_calib_samples=32, calib_seq_len=512, offline=False)
    models, notes = served_models(base / "fp8", model, plan.to_dict())
    options = EvalOptions(tier="vllm")
    env = Environment(rocm=True, rocm_evidence=["plan matrix"], docker=True, in_container=False, vllm=False,
                      lm_eval_api=False)
    commands = plan_commands(models, options, wd, "docker", env)
    script, _ = write_script(commands, models, options, wd)
    text = script.read_text(encoding="utf-8")
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    servers = {}
    for m in models:
        layout = layout_for(m.tensor_parallel or 1)
        line = next(c.argv for c in commands.per_model[m.label] if c.background)
        flags = " ".join(line)
        ok = (f"--tensor-parallel-size {layout.tensor_parallel}" in flags
              and (("--distributed-executor-backend ray" in flags
                    and f"--pipeline-parallel-size {layout.pipeline_parallel}" in flags) == layout.multi_node))
        servers[m.label] = {"devices": m.tensor_parallel, "layout": layout.text(), "multi_node": layout.multi_node,
                            "ok": ok, "serve": flags[flags.index("vllm"):] if "vllm" in flags else flags}
    wide = any(s["multi_node"] for s in servers.values())
    script_ok = syntax.returncode == 0 and (not wide or all(
        k in text for k in ("ray start --head", "srun --nodes=1", "RAY_GPUS=")))
    return {"cell": name, "target": target, "params": analysis.size.get("params"),
            "baseline_bytes": sum(p.stat().st_size for p in model.glob("*.safetensors")),
            "servers": servers, "script_ok": script_ok, "script": str(script), "notes": notes,
            "outcome": "green" if script_ok and all(s["ok"] for s in servers.values()) else "failed",
            "seconds": round(time.perf_counter() - t0, 1)}


def run_cells(work: Path, names: list[str] | None = None) -> list[dict]:
    return [run_cell(n, work) for n in names or CELLS]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--cell", choices=sorted(CELLS), action="append")
    args = p.parse_args()
    rows = run_cells(args.work or Path(tempfile.mkdtemp(prefix="plan-multinode-")), args.cell)
    for r in rows:
        print(json.dumps(r, indent=1))
    return 0 if all(r["outcome"] == "green" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
