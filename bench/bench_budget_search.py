"""Issue 41's must-show: the budget search against the plans a user would try by hand, measured.

On a trained 8-block tiny Llama: `run --budget-bits B --formats int4_wo_32,int8 --eval-tier ppl --baseline`
(the serving check with the project's vLLM where it is built), uniform int4_wo_32, and the naive mix
(the first and last blocks in int8), each Tier 1 KL on the same windows; the export's effective bits are
read from its safetensors headers. Run: ``python -m bench.bench_budget_search [--root DIR]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM = ROOT / ".venv-vllm" / "bin" / "python"


def _run(name: str, model: Path, root: Path, corpus: Path, *plan: str, serve: bool = False) -> dict:
    wd, out = root / f"wd-{name}", root / f"out-{name}"
    argv = [sys.executable, "-m", "quark_ptq_eval", "run", str(model), "-o", str(out), "--workdir", str(wd),
            "--calib-data", str(corpus), "--offline", "--yes", "--num-calib-samples", "16", "--calib-seq-len", "128",
            "--eval-tier", "ppl", "--eval-data", str(corpus), "--seq-len", "128", "--max-windows", "32", "--baseline",
            *plan, *(["--vllm-python", str(VLLM)] if serve and (VLLM.parent.parent / ".installed").exists() else [])]
    t0 = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    results = json.loads((wd / "eval_results.json").read_text())
    validation = json.loads((wd / "validation_report.json").read_text())
    search = next((d for d in json.loads((wd / "quant_plan.json").read_text())["decisions"]
                   if d["decision"] == "budget search"), {})
    return {"plan": name, "bits": _export_bits(model, out), "tier1_kl": results["details"]["kl"]["kl_divergence"],
            "predicted_kl": search.get("predicted_kl"), "validation": validation["status"],
            "serve": validation["checks"]["serve"]["status"], "seconds": round(time.time() - t0, 1)}


def _export_bits(model: Path, out: Path) -> float:
    """8 x bytes of the quantized linears' tensors in the export (weights, scales, zero points) / their weights."""
    from quark_ptq_eval.base.safetensors_io import read_model_headers
    from quark_ptq_eval.plan.scheme_fit import linear_shapes

    shapes = linear_shapes(str(model), ["lm_head"])
    written = sum(i.nbytes for t, i in read_model_headers(str(out)).items() if t.rpartition(".")[0] in shapes)
    return round(8 * written / sum(r * c for r, c in shapes.values()), 4)


def measure(root: Path, budget: float = 6.0) -> list[dict]:
    """The four plans' rows (search, uniform int4_wo_32, naive mix, the search at the naive mix's bits)."""
    from quark_ptq_eval.flows.demo import TinyShape, build_corpus, build_tiny_model

    corpus = build_corpus(root / "corpus.txt")
    model = root / "tiny8"
    if not (model / "config.json").exists():
        build_tiny_model(model, corpus, shape=TinyShape(layers=8))
    search = ("--budget-bits", str(budget), "--formats", "int4_wo_32,int8")
    rows = [_run("search", model, root, corpus, *search, serve=True),
            _run("int4_wo_32", model, root, corpus, "--scheme", "int4_wo_32"),
            _run("naive", model, root, corpus, "--scheme", "int4_wo_32", "--layer-quant-scheme", "model.layers.0.*",
                 "int8", "--layer-quant-scheme", "model.layers.7.*", "int8")]
    naive_bits = rows[-1]["bits"]  # the search again at no more bits than the naive mix
    rows.append(_run("search-at-naive-bits", model, root, corpus, "--budget-bits", f"{naive_bits - 0.001:.3f}",
                     "--formats", "int4_wo_32,int8"))
    (root / "bench_budget_search.json").write_text(json.dumps(rows, indent=2))
    return rows


def run(quick: bool = False) -> list[dict]:
    """One row for `make bench`: the search's Tier 1 KL against the naive mix's (ratio: naive KL / ours)."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = {r["plan"]: r for r in measure(Path(tmp))}
    ours, naive, uniform, fair = rows["search"], rows["naive"], rows["int4_wo_32"], rows["search-at-naive-bits"]
    ok = ours["tier1_kl"] < uniform["tier1_kl"] and fair["tier1_kl"] <= naive["tier1_kl"] and fair["bits"] <= naive["bits"]
    note = "; ".join(f"{r['plan']}: {r['bits']} bits, Tier 1 KL {r['tier1_kl']:.3g}" for r in rows.values())
    return [{"benchmark": "budget search: Tier 1 KL (not seconds)", "ours_s": fair["tier1_kl"], "peer": "naive mix",
             "peer_s": naive["tier1_kl"], "ratio": naive["tier1_kl"] / fair["tier1_kl"],
             "target": "below uniform int4_wo_32, no higher than the naive mix at no more bits", "ok": ok, "note": note}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=None)
    parser.add_argument("--budget", type=float, default=6.0)
    args = parser.parse_args()
    rows = measure(args.root or Path(tempfile.mkdtemp(prefix="bench-budget-")), args.budget)
    print("| plan | effective bits | predicted KL | Tier 1 KL | validation | serve | s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        pred = f"{r['predicted_kl']:.3g}" if r["predicted_kl"] is not None else "-"
        print(f"| {r['plan']} | {r['bits']} | {pred} | {r['tier1_kl']:.3g} | {r['validation']} | {r['serve']} | "
              f"{r['seconds']} |")


if __name__ == "__main__":
    main()
