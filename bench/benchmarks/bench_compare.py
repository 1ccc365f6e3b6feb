"""`compare` over four schemes against four separate `run --baseline`, on the demo model.

Builds the demo corpus and tiny Llama (``quark_ptq_eval.flows.demo``, as ``make demo`` does) in a temp
dir, warms the capability catalog, then times, each as one fresh process with fresh directories:

- ours: ``quark-ptq-eval compare M --schemes fp8,int8,int4_wo_128,mxfp4 -o ROOT --calib-data corpus.txt
  --num-calib-samples 32 --calib-seq-len 256 --eval-data corpus.txt --seq-len 256 --max-windows N
  --offline --yes --quiet`` (one intake, four engine runs, four validations, the baseline scored once);
- peer: for each scheme ``quark-ptq-eval run M -o O --workdir W --scheme S`` with the same calibration
  and evaluation flags and ``--eval-tier ppl --baseline`` (each run scores the baseline itself).

It prints the wall-time ratio (peer / ours: above 1 compare is faster), where the time goes on
both sides (the engine child's own seconds from each manifest, the runs' phase timings), that
every scheme's perplexity in comparison.json equals its separate run's to 1e-4 (relative), and
the baseline cache's size on disk against full float32 logits (windows x scored tokens x
vocabulary x 4 bytes). Run: ``python -m bench.benchmarks.bench_compare [--max-windows N] [--model DIR --corpus FILE]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

from bench.benchmarks.bench_orchestration import ENV, our_cli, timed, warm_catalog

SCHEMES = ["fp8", "int8", "int4_wo_128", "mxfp4"]
PPL_RTOL = 1e-4


def shared_flags(corpus: Path, windows: int) -> list[str]:
    """Calibration and evaluation flags both sides get (the demo's, with a window limit)."""
    return ["--calib-data", str(corpus), "--num-calib-samples", "32", "--calib-seq-len", "256",
            "--eval-data", str(corpus), "--seq-len", "256", "--max-windows", str(windows), "--offline", "--yes",
            "--quiet"]


def time_compare(model: Path, corpus: Path, root: Path, windows: int) -> tuple[float, dict]:
    argv = [*our_cli(), "compare", str(model), "--schemes", ",".join(SCHEMES), "-o", str(root),
            *shared_flags(corpus, windows)]
    seconds = timed(argv, root.parent / "compare.log")
    return seconds, json.loads((root / "comparison.json").read_text(encoding="utf-8"))


def time_runs(model: Path, corpus: Path, root: Path, windows: int) -> tuple[dict[str, float], dict[str, Path]]:
    seconds, workdirs = {}, {}
    for scheme in SCHEMES:
        base = root / scheme
        argv = [*our_cli(), "run", str(model), "-o", str(base / "out"), "--workdir", str(base / "work"),
                "--scheme", scheme, *shared_flags(corpus, windows), "--eval-tier", "ppl", "--baseline",
                "--execution-mode", "batch_execute"]
        seconds[scheme] = timed(argv, base.with_suffix(".log"))
        workdirs[scheme] = base / "work"
    return seconds, workdirs


def engine_seconds(workdir: Path) -> float:
    import yaml

    manifest = yaml.safe_load((workdir / "run_manifest.yaml").read_text(encoding="utf-8"))
    return float(manifest["runs"][-1]["seconds"])


def perplexity_check(doc: dict, workdirs: dict[str, Path]) -> list[dict]:
    rows = {r["scheme"]: r for r in doc["schemes"]}
    out = []
    for scheme, wd in workdirs.items():
        alone = json.loads((wd / "eval_results.json").read_text(encoding="utf-8"))["details"]
        ours, theirs = rows[scheme].get("perplexity"), alone["quantized"]["perplexity"]
        base_ours, base_theirs = rows[scheme].get("baseline_perplexity"), alone["baseline"]["perplexity"]
        rel = abs(ours / theirs - 1) if ours else math.inf
        base_rel = abs(base_ours / base_theirs - 1) if base_ours else math.inf
        out.append({"scheme": scheme, "compare_ppl": ours, "run_ppl": theirs, "rel_diff": rel,
                    "baseline_rel_diff": base_rel, "ok": rel <= PPL_RTOL and base_rel <= PPL_RTOL,
                    "kl_cached": rows[scheme].get("kl_mean"), "kl_full": alone["kl"]["kl_divergence"]})
    return out


def cache_sizes(doc: dict, model: Path) -> dict:
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    s = doc["settings"]
    full = s["windows"] * (s["seq_len"] - 1) * config["vocab_size"] * 4  # scored tokens: seq_len - 1 per window
    return {"cache_bytes": doc["baseline_cache"]["bytes"], "full_logits_bytes": full,
            "full_logits_bytes_meta": doc["baseline_cache"]["full_logits_bytes"], "windows": s["windows"],
            "seq_len": s["seq_len"], "vocab": config["vocab_size"], "top_k": s["top_k"]}


def run(quick: bool, windows: int | None = None, model: Path | None = None, corpus: Path | None = None,
        keep: Path | None = None) -> list[dict]:
    """``keep``: work there and leave every directory behind (default: a temp dir, removed)."""
    windows = windows or (32 if quick else 128)
    with tempfile.TemporaryDirectory(prefix="qpe-bench-compare-") as tmp:
        root = Path(keep).resolve() if keep else Path(tmp)
        if model is None or corpus is None:
            from quark_ptq_eval.flows.demo import build_corpus, build_tiny_model

            corpus = build_corpus(root / "assets" / "corpus.txt")
            model = build_tiny_model(root / "assets" / "tiny-llama", corpus)  # the demo's model, as trained there
        model, corpus = Path(model).resolve(), Path(corpus).resolve()
        catalog_s = warm_catalog()
        ours_s, doc = time_compare(model, corpus, root / "compare" / "out", windows)
        run_s, workdirs = time_runs(model, corpus, root / "runs", windows)
        return [_row(ours_s, run_s, doc, workdirs, model, catalog_s)]


def _row(ours_s: float, run_s: dict[str, float], doc: dict, workdirs: dict[str, Path], model: Path,
         catalog_s: float) -> dict:
    peer_s = sum(run_s.values())
    checks = perplexity_check(doc, workdirs)
    cache = cache_sizes(doc, model)
    by = {r["scheme"]: r for r in doc["schemes"]}
    compare_engines = sum(by[s].get("quantize_s") or 0.0 for s in SCHEMES)
    run_engines = sum(engine_seconds(wd) for wd in workdirs.values())
    phases = {s: json.loads((wd / "run_summary.json").read_text(encoding="utf-8")).get("timings_s", {})
              for s, wd in workdirs.items()}
    return {"benchmark": f"compare {','.join(SCHEMES)} vs 4 x run --baseline", "ours_s": round(ours_s, 2),
            "peer": "4 separate `run --eval-tier ppl --baseline`", "peer_s": round(peer_s, 2),
            "ratio": round(peer_s / ours_s, 3), "target": "ratio > 1 (baseline once), perplexities equal to 1e-4",
            "ok": peer_s > ours_s and all(c["ok"] for c in checks), "runs_s": run_s, "perplexities": checks,
            "cache": cache, "engine_s": {"compare": compare_engines, "runs": run_engines}, "run_phases_s": phases,
            "recommendation": doc["recommendation"]["reason"], "catalog_warmup_s": round(catalog_s, 1),
            "note": f"engine children: compare {compare_engines:.1f} s, runs {run_engines:.1f} s of the wall time"}


def report(row: dict) -> str:
    c = row["cache"]
    lines = [f"cores: {os.cpu_count()}; load average {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M')}",
             f"compare (one process, 4 schemes): {row['ours_s']:.1f} s",
             f"4 x run --baseline: {row['peer_s']:.1f} s ("
             + ", ".join(f"{s} {v:.1f} s" for s, v in row["runs_s"].items()) + ")",
             f"ratio (runs / compare): {row['ratio']:.2f}x",
             f"engine children (quark import + quantize + export): compare {row['engine_s']['compare']:.1f} s, "
             f"runs {row['engine_s']['runs']:.1f} s",
             "run phases: " + "; ".join(f"{s}: " + ", ".join(f"{k} {v:.1f}" for k, v in p.items())
                                        for s, p in row["run_phases_s"].items()),
             "perplexity, compare vs separate run (relative difference; baseline's in brackets):"]
    for p in row["perplexities"]:
        lines.append(f"  {p['scheme']:<12} {p['compare_ppl']:.6f} vs {p['run_ppl']:.6f}  {p['rel_diff']:.1e} "
                     f"[{p['baseline_rel_diff']:.1e}]  {'ok' if p['ok'] else 'DIFFERENT'}; KL cached "
                     f"{p['kl_cached']:.5f} vs full {p['kl_full']:.5f}")
    lines += [f"baseline cache: {c['cache_bytes'] / 2**20:.2f} MiB on disk (top-{c['top_k']}) vs full float32 logits "
              f"{c['windows']} windows x {c['seq_len'] - 1} tokens x {c['vocab']} vocab x 4 B = "
              f"{c['full_logits_bytes'] / 2**20:.2f} MiB ({c['full_logits_bytes'] / c['cache_bytes']:.1f}x smaller)",
              f"recommendation: {row['recommendation']}",
              f"{'met' if row['ok'] else 'MISSED'}: {row['target']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-windows", type=int, help="Tier 1 windows of 256 tokens (default 128; 32 with --quick)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model", type=Path, help="reuse a tiny model dir (with --corpus) instead of building one")
    p.add_argument("--corpus", type=Path, help="calibration and evaluation text for --model")
    p.add_argument("--keep", type=Path, help="work in this (new) directory and keep it, with bench_compare.json")
    args = p.parse_args(argv)
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ})
    row = run(args.quick, args.max_windows, args.model, args.corpus, args.keep)[0]
    if args.keep:
        (args.keep / "bench_compare.json").write_text(json.dumps(row, indent=2, default=str), encoding="utf-8")
    print(report(row))


if __name__ == "__main__":
    main()
