"""The sequential engine against the whole-model engine: wall time on a model that fits, peak RSS as the model grows.

Cases (real published shapes, sparse files: payloads are holes that read as zeros, so quantizing, exporting and
validating run in full at real size and cost no disk):

- ``1b``: TinyLlama-1.1B's shape (22 blocks). Both engines, ``int8`` (static scales) on the same calibration
  windows: wall time and peak RSS of each, their ratio (the issue's bound: the sequential engine at most 1.3x);
- ``8b``: Llama-3-8B's shape, the sequential engine alone (the whole-model engine needs ~35 GiB: not on this host);
- ``70b-2``: Llama-3-70B's shape cut to 2 blocks (its 128k-vocabulary embedding and lm_head and real-size blocks):
  the sequential engine's peak at 70 B; the 80-block run is ``quark-ptq-eval run`` itself (docs/planning.md).

Each engine runs in a child of its own (``python -m ...``, as the recipe runs it); its peak RSS is the child's
maximum resident set (``wait4``). The load average is printed beside every figure (the host is shared).

    .venv/bin/python -m bench.benchmarks.bench_sequential --work DIR [--case 1b --case 8b --case 70b-2] [--samples 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.benchmarks.bench_real_size_plans import write_sparse
from bench.benchmarks.bench_validate_memory import copy_tokenizer, llama, tokenizer_dir

CASES = {
    "1b": (llama(2048, 5632, 22, 32, 4, 32000, 1), True),  # TinyLlama-1.1B
    "8b": (llama(4096, 14336, 32, 32, 8, 128256, 4), False),  # Llama-3-8B
    "70b-2": (llama(8192, 28672, 2, 64, 8, 128256, 2), False),  # Llama-3-70B, two blocks
}
ENGINES = {"whole-model": "quark_ptq_eval.execute.quark_api_engine", "sequential": "quark_ptq_eval.execute.engines.sequential"}


def source(work: Path, name: str) -> Path:
    shapes, _ = CASES[name]
    folder = work / f"{name}-source"
    if not (folder / "config.json").exists():
        config, tensors, shards = shapes()
        write_sparse(folder, config, tensors, shards)
        copy_tokenizer(tokenizer_dir(work), (folder,))
    return folder


def run_engine(module: str, model: Path, out: Path, corpus: Path, samples: int, seq_len: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "-m", module, "--model_dir", str(model), "--output_dir", str(out), "--quant_scheme",
            "int8", "--calib_data", str(corpus), "--num_calib_data", str(samples), "--seq_len", str(seq_len)]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    return {"rc": os.waitstatus_to_exitcode(status), "wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2), "load": [round(load, 2), round(os.getloadavg()[0], 2)]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--case", action="append", choices=list(CASES))
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / "corpus.txt"
    tokenizer_dir(args.work)  # writes the corpus beside the demo tokenizer
    for name in args.case or ["1b", "70b-2"]:
        model = source(args.work, name)
        _, both = CASES[name]
        row: dict = {"case": name}
        for engine, module in ENGINES.items():
            if engine == "whole-model" and not both:
                continue
            row[engine] = run_engine(module, model, args.work / f"{name}-{engine}", corpus, args.samples, args.seq_len)
        if both:
            row["sequential_over_whole_model"] = round(row["sequential"]["wall_s"] / row["whole-model"]["wall_s"], 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
