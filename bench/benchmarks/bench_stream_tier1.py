"""Tier 1 streamed one decoder block at a time against the in-memory Tier 1, and at 70 B shape.

Each case writes (``bench_real_size_plans.write_sparse``: the published names, shapes and dtypes, payloads left
as holes that read as zeros) a BF16 Llama source and the FP8 export Quark writes of it (``F8_E4M3`` weights,
per-tensor scales written into the holes: non-zero), with the demo model's tokenizer (its ids are valid rows of
any of these vocabularies). All-zero weights run every kernel at full size, so time and memory are real; the
numbers themselves are the tests' business (tests/evaluate/ppl/test_stream_tier1.py: equal to the in-memory tier).

Each run is ``quark-ptq-eval eval --tier ppl --baseline SRC [--stream-blocks]`` in a child, as a user runs it:
wall time, peak RSS (the child's maximum resident set, from ``wait4``), the load average before and after.

- ``1b`` (TinyLlama-1.1B's shape): in-memory vs streamed wall time and peak RSS; the issue's bound is 1.2x.
- ``70b`` (Llama-3.1-70B's shape, 141 GB + 71 GB): streamed only (in memory would need ~213 GB here), beside
  the time to read both checkpoints once through the streamer's own reader (the physical floor on this host).

    .venv/bin/python -m bench.benchmarks.bench_stream_tier1 [--work DIR] [--case 1b --case 70b] [--seq-len 64 --windows 4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.benchmarks.bench_validate_memory import copy_tokenizer, llama, tokenizer_dir, write_pair

CASES = {
    "1b": llama(2048, 5632, 22, 32, 4, 32000, 1),  # TinyLlama-1.1B
    "70b": llama(8192, 28672, 80, 64, 8, 128256, 30),  # Llama-3.1-70B
}


def build(name: str, work: Path, tokenizer: Path) -> tuple[Path, Path]:
    config, tensors, shards = CASES[name]()
    source, export = write_pair(work, name, {**config, "max_position_embeddings": 4096}, tensors, shards)
    copy_tokenizer(tokenizer, (source, export))
    return source, export


def eval_text(work: Path) -> Path:
    path = work / "eval.txt"
    if not path.exists():
        text = (work / "corpus.txt").read_text(encoding="utf-8")
        path.write_text(text[: 200_000], encoding="utf-8")
    return path


def run_eval(source: Path, export: Path, text: Path, out: Path, stream: bool, args: argparse.Namespace) -> dict:
    argv = [sys.executable, "-m", "quark_ptq_eval", "eval", "--quantized", str(export), "--tier", "ppl",
            "--baseline", str(source), "--eval-data", str(text), "--seq-len", str(args.seq_len),
            "--max-windows", str(args.windows), "--device", "cpu", "--workdir", str(out), "--yes"]
    argv += ["--stream-blocks"] if stream else []
    load = os.getloadavg()[0]
    started = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    return {"rc": os.waitstatus_to_exitcode(status), "wall_s": wall, "peak_rss_gib": usage.ru_maxrss / 2**20,
            "load": (load, os.getloadavg()[0])}


def read_floor(*models: Path) -> tuple[float, float]:
    """Seconds and GiB to read every tensor of ``models`` once, with the streamer's own reader."""
    from quark_ptq_eval.base.safetensors_io import read_model_headers
    from quark_ptq_eval.runtime.blocks import read_tensor

    started, total = time.perf_counter(), 0
    for model in models:
        for info in read_model_headers(model).values():
            read_tensor(info)
            total += info.nbytes
    return time.perf_counter() - started, total / 2**30


def planned_gib(source: Path, export: Path, args: argparse.Namespace) -> float:
    """The plan's model of the streamed tier's peak (plan/resources.py) for these windows."""
    from quark_ptq_eval.base.catalog import load_catalog
    from quark_ptq_eval.intake import analyze_model
    from quark_ptq_eval.plan.resources import estimate_eval_streamed

    analysis = analyze_model(str(source), offline=True, catalog=load_catalog())
    out = sum(f.stat().st_size for f in export.glob("*.safetensors"))
    return estimate_eval_streamed(analysis, out, args.seq_len, args.windows)["host_peak_bytes"] / 2**30


def show(label: str, r: dict) -> None:
    print(f"  {label:<10} rc {r['rc']}  wall {r['wall_s']:7.1f} s  peak RSS {r['peak_rss_gib']:5.2f} GiB  "
          f"(load {r['load'][0]:.2f} -> {r['load'][1]:.2f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench-stream-tier1")
    parser.add_argument("--case", action="append", choices=list(CASES))
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--windows", type=int, default=8)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer, text = tokenizer_dir(args.work), eval_text(args.work)
    for name in args.case or ["1b"]:
        source, export = build(name, args.work, tokenizer)
        print(f"{name}: {args.windows} windows of {args.seq_len} tokens, baseline {source.name}, export {export.name}")
        streamed = run_eval(source, export, text, args.work / f"{name}-streamed", True, args)
        planned = planned_gib(source, export, args)
        print(f"  plan's model of the streamed peak: {planned:.2f} GiB; measured {streamed['peak_rss_gib']:.2f} GiB "
              f"({streamed['peak_rss_gib'] / planned - 1:+.0%})", flush=True)
        if name == "70b":
            show("streamed", streamed)
            seconds, gib = read_floor(source, export)
            print(f"  read both checkpoints once: {gib:.1f} GiB in {seconds:.1f} s; streamed / read = "
                  f"{streamed['wall_s'] / seconds:.2f}x; the in-memory tier would hold ~{gib:.0f} GiB of weights",
                  flush=True)
            continue
        memory = run_eval(source, export, text, args.work / f"{name}-memory", False, args)
        show("in memory", memory)
        show("streamed", streamed)
        print(f"  streamed / in memory: wall {streamed['wall_s'] / memory['wall_s']:.2f}x, peak RSS "
              f"{streamed['peak_rss_gib'] / memory['peak_rss_gib']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
