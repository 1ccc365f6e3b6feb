"""The load check's time and memory before and after the export emulation, on the same exports.

Builds the trained tiny Llama with outlier channels in BF16 (tests/fixtures/traits.py) and its int8,
fp8 and int8 + SmoothQuant exports, then runs ``load_check_alone`` on each in a fresh process per
code tree: ``--before SRC`` (a checkout of the code before the emulation, e.g.
``git worktree add /tmp/lc-before 47c1212`` and ``--before /tmp/lc-before/src``) and this tree's
``src``. Each child reports the check's wall time (imports excluded) and its peak RSS; the table
prints both and the after/before ratio, with the machine's load beside them, and each tree's verdict
(the old one fails the int8 export of a model with an outlier channel).

Run: ``python -m bench.benchmarks.bench_load_check_cost --before /tmp/lc-before/src [--work DIR] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
EXPORTS = {"int8": ("int8", None), "fp8": ("fp8", None), "int8-smoothquant": ("int8", "smoothquant")}
CHILD = """
import json, resource, sys, time
from pathlib import Path
from quark_ptq_eval.validate.loadcheck import load_check_alone
import torch, transformers  # imported before the clock starts
plan = json.loads(sys.argv[3])
start = time.perf_counter()
result = load_check_alone(Path(sys.argv[1]), Path(sys.argv[2]), plan)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "status": result.status, "first": [f.line()[:160] for f in result.failures][:1]}))
"""


def build(work: Path) -> tuple[Path, dict[str, Path], Path]:
    from quark_ptq_eval.flows.demo import build_corpus, build_tiny_model
    from tests.fixtures.traits import add_traits

    corpus = build_corpus(work / "corpus.txt")
    model = work / "tiny-llama-traits"
    if not (model / "config.json").exists():
        add_traits(build_tiny_model(model, corpus))
    exports = {}
    for name, (scheme, algorithm) in EXPORTS.items():
        out = work / name
        if not (out / "config.json").exists():
            argv = [sys.executable, "-m", "quark_ptq_eval.execute.quark_api_engine", "--model_dir", str(model),
                    "--output_dir", str(out), "--quant_scheme", scheme, "--calib_data", str(corpus),
                    "--num_calib_data", "16", "--seq_len", "128"] + (["--quant_algo", algorithm] if algorithm else [])
            subprocess.run(argv, check=True, capture_output=True)
        exports[name] = out
    return model, exports, corpus


def measure(src: Path, model: Path, export: Path, plan: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{ROOT}", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), str(export), json.dumps(plan)],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="src/ of the code before the emulation")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-load-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    model, exports, corpus = build(work)
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    print(f"{'export':18s} {'before s':>9s} {'after s':>9s} {'ratio':>6s} {'before MiB':>11s} {'after MiB':>10s} "
          f"{'ratio':>6s}  verdict before -> after")
    for name, (scheme, algorithm) in EXPORTS.items():
        plan = {"global_scheme": scheme, "algorithm": algorithm, "exclude_layers": ["lm_head"],
                "layer_quant_config": {}, "kv_cache_scheme": None,
                "calibration": {"path": str(corpus), "num_samples": 16, "seq_len": 128, "text_field": "text"}}
        runs = {label: [measure(src, model, exports[name], plan) for _ in range(args.repeats)]
                for label, src in (("before", args.before), ("after", ROOT / "src"))}
        t = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
        m = {k: max(r["peak_rss_mib"] for r in v) for k, v in runs.items()}
        verdicts = f"{runs['before'][0]['status']} -> {runs['after'][0]['status']}"
        print(f"{name:18s} {t['before']:9.2f} {t['after']:9.2f} {t['after'] / t['before']:6.2f} {m['before']:11.0f} "
              f"{m['after']:10.0f} {m['after'] / m['before']:6.2f}  {verdicts} {runs['before'][0]['first'][:1]}",
              flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f} (median of {args.repeats} runs; peak RSS: the largest)")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
