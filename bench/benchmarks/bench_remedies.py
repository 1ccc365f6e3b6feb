"""`run --remedies N` on a model where one block carries the harm: what each remedy measured, and the estimate said
before they ran against the time they took.

The fixture: the trained 8-block tiny Llama with the traits real LLMs have (tests/fixtures/traits.py), plus a
"super weight" in each group of 128 inputs of block ``BLOCK``'s down_proj and o_proj (traits.super_weights: an
exact, function-preserving rescale by a power of two F with up_proj's and v_proj's rows, as the few huge down_proj
weights of trained LLMs are). Under a 4-bit weight-only scheme with groups of 128 along the input, such a column
sets its group's scale in every row and the group's other weights round to zero: the block carries the damage;
the other blocks quantize as usual.

The run: ``quark-ptq-eval run SRC --scheme int4_wo_128 --eval-tier ppl --baseline --remedies N --yes`` (validation
with its defaults: the load check names the worst module). It prints each variant's KL, ΔNLL interval and outcome,
the recommendation, the remedies' estimate (said before they ran) beside their measured time and the ratio, and
the load average at the start and the end. The issue's bound on the estimate: within 30 % of the time taken. Two
estimates: the one said before any variant ran (from the run's own steps, which paid a cold start the comparison's
warm engines do not), and the pilot's (remedy_cost.Pilot: the first variant timed, the others estimated from it).

    .venv/bin/python -m bench.benchmarks.bench_remedies --work DIR [--case super-weights|smoothquant] [--remedies 2]

``--case smoothquant``: the trained 8-block tiny Qwen2 with outlier channels and block 0's MLP channel 100 large in
both activation and weight, the rest trained around it (traits.massive_channel), ``int8`` + SmoothQuant, the plan's
own advice for int8 and here the harm: the remedies should measure the plan without SmoothQuant healthy and name it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BLOCK = 0  # the block a tiny trained model leans on (removing block 1 costs KL 0.001, block 0 KL 1.0)


def fixture(work: Path, case: str, factor: float) -> tuple[Path, Path]:
    """(source, corpus): built once under ``work``."""
    from quark_ptq_eval.flows.demo import build_corpus
    from tests.fixtures.traits import massive_channel, super_weights, trained_with_traits

    corpus = work / "corpus.txt"
    if not corpus.exists():
        build_corpus(corpus)
    if case == "smoothquant":  # the Qwen2: outlier channels and a channel large in activation and weight
        source = work / "tiny-qwen2-8-massive-channel"
        if not (source / "config.json").exists():
            trained_with_traits(source, corpus, arch="qwen2", layers=8)
            massive_channel(source, corpus, 0, 100)
        return source, corpus
    source = work / f"tiny-llama-8-super-weights-attn-{BLOCK}-{int(factor)}"
    if not (source / "config.json").exists():
        trained_with_traits(source, corpus, arch="llama", layers=8)
        super_weights(source, BLOCK, factor)
    return source, corpus


CASES = {"super-weights": ["--scheme", "int4_wo_128"],  # one block carries the harm under a 4-bit scheme
         "smoothquant": ["--scheme", "int8", "--algorithm", "smoothquant"]}  # the plan's advice for int8 as the harm


def run(work: Path, case: str, source: Path, corpus: Path, remedies: int) -> tuple[dict, float, int]:
    wd, out = work / f"run-{case}", work / f"out-{case}"
    argv = [sys.executable, "-m", "quark_ptq_eval", "run", str(source), "-o", str(out), "--workdir", str(wd),
            *CASES[case], "--calib-data", str(corpus), "--num-calib-samples", "16", "--calib-seq-len",
            "128", "--offline", "--yes", "--overwrite", "--eval-tier", "ppl", "--seq-len", "128", "--max-windows",
            "16", "--baseline", "--remedies", str(remedies)]
    started = time.perf_counter()
    with open(work / f"run-{case}.log", "w") as log:
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
    results = json.loads((wd / "eval_results.json").read_text()) if (wd / "eval_results.json").exists() else {}
    return results, time.perf_counter() - started, rc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--case", choices=sorted(CASES), default="super-weights")
    ap.add_argument("--remedies", type=int, default=2)
    ap.add_argument("--factor", type=float, default=32.0, help="the super weight's factor (a power of two)")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    source, corpus = fixture(args.work, args.case, args.factor)
    load_before = os.getloadavg()[0]
    results, wall, rc = run(args.work, args.case, source, corpus, args.remedies)
    remedies = (results.get("details") or {}).get("remedies") or {}
    original = remedies.get("original") or {}
    print(f"run rc {rc}, {wall:.0f} s; verdict {results.get('verdict')}; load {load_before:.2f} -> "
          f"{os.getloadavg()[0]:.2f}")
    print(f"original: KL {original.get('kl_mean')}, ΔNLL {original.get('delta_nll')} {original.get('delta_nll_ci95')}")
    for row in remedies.get("variants") or []:
        print(f"  {row['label']}: {row['changed']}: KL {row.get('kl_mean')}, ΔNLL {row.get('delta_nll')} "
              f"{row.get('delta_nll_ci95')}, {row.get('verdict')}: {row['outcome']}")
    print(f"cause: {remedies.get('cause')}")
    print(f"recommended: {(remedies.get('recommendation') or {}).get('label')}")
    runtime = remedies.get("runtime") or {}
    ratio = runtime.get("estimated_over_actual")
    print(f"remedies' time: estimated {runtime.get('estimated_s')} s, measured {runtime.get('actual_s')} s, "
          f"estimate/actual {ratio if ratio is None else round(ratio, 2)} (bound: 0.7-1.3)")
    pilot = runtime.get("pilot") or {}
    print(f"pilot: {pilot.get('variant')} took {pilot.get('seconds')} s; the others estimated "
          f"{pilot.get('rest_estimated_s')} s, measured {pilot.get('rest_actual_s')} s, estimate/actual "
          f"{pilot.get('rest_estimated_over_actual')} (bound: 0.7-1.3)")
    (args.work / f"remedies-{args.case}.json").write_text(json.dumps({"rc": rc, "wall_s": wall, "load_before": load_before,
                                                          "remedies": remedies}, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
