"""Does the sensitivity proposal buy accuracy back? Two real runs on the demo model, same data.

Builds the embedded tiny Llama of ``make demo`` (or reuses it under ROOT), then runs the whole
recipe twice with an aggressive scheme, each evaluated by Tier 1 against the source model as
baseline on the same text as ``make demo``:

- **plain**: ``quark-ptq-eval run MODEL --scheme S ...`` (Quark's template exclusions only);
- **proposal**: the same command plus ``--sensitivity [--max-kl K]``: the scan's proposal goes into
  quant_plan.json: the layers kept unquantized (exclude_layers) or, when the same layers at the
  wider 8-bit scheme measured within the budget, at that scheme (layer_quant_config);
- **unquantized** (only when the proposal chose the wider scheme): the plain command with
  ``--exclude lm_head LAYERS``, the same layers kept unquantized, to compare size and KL.

It prints (and writes to ROOT/effect.json) per run: Tier 1 KL mean/p99, perplexity (quantized and
baseline), the exported weight bytes, the excluded layers, and for the proposal the scan's
predicted and re-measured KL next to Tier 1's measured KL.
Run: ``python -m bench.benchmarks.bench_sensitivity_effect ROOT [--scheme mxfp4] [--max-kl K] [--runs plain,proposal]``
(``--runs`` reruns only those, keeping the other rows of ROOT/effect.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def demo_model(root: Path) -> tuple[Path, Path]:
    """The model and corpus of ``make demo`` (same builder, same defaults)."""
    from quark_ptq_eval.flows.demo import build_corpus, build_tiny_model

    corpus, model = root / "corpus.txt", root / "tiny-llama"
    if not (model / "config.json").exists():
        build_corpus(corpus)
        build_tiny_model(model, corpus)
    return model, corpus


def run_recipe(root: Path, name: str, model: Path, corpus: Path, scheme: str, extra: list[str]) -> dict:
    """One ``quark-ptq-eval run`` with Tier 1 + baseline, the flags of ``make demo`` except the scheme."""
    out, work = root / f"{name}-model", root / f"{name}-run"
    argv = [sys.executable, "-m", "quark_ptq_eval", "run", str(model), "-o", str(out), "--workdir", str(work),
            "--scheme", scheme, "--calib-data", str(corpus), "--num-calib-samples", "32", "--calib-seq-len", "256",
            "--offline", "--yes", "--eval-tier", "ppl", "--eval-data", str(corpus), "--seq-len", "256",
            "--baseline", "--overwrite", "--execution-mode", "batch_execute", "--quiet", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (root / f"{name}.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed (rc {proc.returncode}); see {root / f'{name}.log'}")
    return summarize(name, out, work, time.perf_counter() - t0, argv[2:])


def summarize(name: str, out: Path, work: Path, seconds: float, argv: list[str]) -> dict:
    results = json.loads((work / "eval_results.json").read_text())
    plan = json.loads((work / "quant_plan.json").read_text())
    kl = results["details"]["kl"]
    row = {
        "run": name, "command": "quark-ptq-eval " + " ".join(argv), "seconds": round(seconds, 1),
        "verdict": results["verdict"],
        "kl_mean": kl["kl_divergence"], "kl_p99": kl["kl_p99"], "top1_agreement": kl["top1_agreement"],
        "ppl": results["details"]["quantized"]["perplexity"], "ppl_baseline": results["details"]["baseline"]["perplexity"],
        "weight_bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")),
        "exclude_layers": plan["exclude_layers"], "layer_quant_config": plan.get("layer_quant_config") or {},
    }
    sens = next((d for d in plan["decisions"] if d["decision"] == "sensitivity"), None)
    if sens:
        row["scan"] = {k: sens.get(k) for k in ("value", "whole_model_kl", "predicted_kl", "measured_kl", "max_kl",
                                                "extra_bytes")}
    if "sensitivity" in results:
        row["followup"] = results["sensitivity"]
    return row


def measure(root: Path, scheme: str, max_kl: float | None, wanted: list[str], extra: list[str] = ()) -> dict:
    """Do the ``wanted`` runs under ``root`` (keeping the other rows of ROOT/effect.json) and save the result."""
    root.mkdir(parents=True, exist_ok=True)
    model, corpus = demo_model(root)
    saved = root / "effect.json"
    rows = {r["run"]: r for r in json.loads(saved.read_text())["runs"]} if saved.exists() else {}
    budget = ["--max-kl", str(max_kl)] if max_kl else []
    if "plain" in wanted:
        rows["plain"] = run_recipe(root, "plain", model, corpus, scheme, [*extra])
    if "proposal" in wanted:
        rows["proposal"] = run_recipe(root, "proposal", model, corpus, scheme, ["--sensitivity", *budget, *extra])
    wider = rows["proposal"].get("layer_quant_config") if "proposal" in rows else None
    if "unquantized" in wanted and wider:  # the same layers kept at source precision, for comparison
        rows["unquantized"] = run_recipe(root, "unquantized", model, corpus, scheme,
                                         ["--exclude", *rows["plain"]["exclude_layers"], *wider, *extra])
    effect = {"scheme": scheme, "max_kl": max_kl, "runs": list(rows.values()),
              "versus_plain": {name: _versus(rows["plain"], row) for name, row in rows.items() if name != "plain"}}
    saved.write_text(json.dumps(effect, indent=2), encoding="utf-8")
    return effect


def run(quick: bool = False) -> list[dict]:
    """The ``make bench`` row: plain vs proposal (--quick: Tier 1 on 64 windows, no unquantized run)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-sens-effect-") as tmp:
        effect = measure(Path(tmp), "mxfp4", 0.004, ["plain", "proposal"] if quick else
                         ["plain", "proposal", "unquantized"], ["--max-windows", "64"] if quick else [])
    rows = {r["run"]: r for r in effect["runs"]}
    vs = effect["versus_plain"]["proposal"]
    note = (f"Tier 1 KL {rows['plain']['kl_mean']:.4g} -> {rows['proposal']['kl_mean']:.4g} "
            f"({-vs['kl_reduction_pct']:+.1f} %) for {vs['extra_bytes']:+,} B ({vs['extra_pct']:+.1f} %)")
    return [{"benchmark": "sensitivity proposal effect (mxfp4, demo model)", "ours_s": rows["proposal"]["seconds"],
             "peer": "plain plan", "peer_s": rows["plain"]["seconds"],
             "ratio": rows["plain"]["seconds"] / rows["proposal"]["seconds"],
             "target": "Tier 1 KL at least 25 % lower than the plain plan", "ok": vs["kl_reduction_pct"] >= 25,
             "note": note}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path, help="work folder (the demo model is built here once and reused)")
    p.add_argument("--scheme", default="mxfp4")
    p.add_argument("--max-kl", type=float, help="the proposal's KL budget (default: the healthy threshold)")
    p.add_argument("--runs", default="plain,proposal,unquantized", help="which runs to (re)do, comma-separated")
    args = p.parse_args()
    print(json.dumps(measure(args.root.resolve(), args.scheme, args.max_kl, args.runs.split(",")), indent=2))


def _versus(plain: dict, row: dict) -> dict:
    return {"kl_reduction_pct": 100.0 * (1 - row["kl_mean"] / plain["kl_mean"]) if plain["kl_mean"] else None,
            "kl_p99_reduction_pct": 100.0 * (1 - row["kl_p99"] / plain["kl_p99"]) if plain["kl_p99"] else None,
            "extra_bytes": row["weight_bytes"] - plain["weight_bytes"],
            "extra_pct": 100.0 * (row["weight_bytes"] / plain["weight_bytes"] - 1)}


if __name__ == "__main__":
    main()
