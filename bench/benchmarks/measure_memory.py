"""Peak RAM of our Quark-API engine child against model size, calibration tokens and algorithm.

Builds random-weight Llamas (BF16, offline; the tokenizer is the demo's byte-level BPE) of the
sizes asked for, runs ``python -m quark_ptq_eval.execute.quark_api_engine`` on each under
``/usr/bin/time -v`` (the child's own maximum resident set size) and writes one JSON row per run
with the model's parameters and bytes, the output's bytes on disk and what the planner's estimate
(``quark_ptq_eval.plan.resources``) said beforehand. Not part of ``make bench`` (it is not a
timing, and the large sizes take minutes on 2 cores).

Run: ``python -m bench.benchmarks.measure_memory --out /tmp/qpe-mem [--runs 10m:fp8 150m:fp8:awq ...]``, then
``--fit`` to fit the coefficients of ``plan/resources.py`` and print the table of docs/planning.md.
A run is ``SIZE:SCHEME[:ALGORITHM][:SAMPLESxSEQ]``; SIZE is one of SHAPES.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

# name -> (hidden, layers, intermediate, heads, kv_heads, vocab, tied): Llama shapes from ~15 M to 1.24 B.
SHAPES = {
    "10m": (384, 6, 1024, 6, 2, 8192, False),
    "50m": (640, 10, 1792, 10, 2, 16000, False),
    "150m": (1024, 12, 2816, 16, 4, 32000, False),
    "500m": (1536, 16, 4096, 12, 4, 32000, False),
    "1b": (2048, 16, 8192, 32, 8, 128256, True),  # Llama-3.2-1B's shape: 1.24 B, tied embeddings
}
SHARD = "500MB"  # saved in Hub-style shards, so the file-to-file engine has shards to stream
DEFAULT_RUNS = ("10m:fp8", "50m:fp8", "150m:fp8", "150m:fp8::64x512", "50m:int4_wo_128:awq",
                "150m:int4_wo_128:awq", "150m:int4_wo_128:gptq", "150m:int8:smoothquant", "150m:int8",
                "500m:fp8")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_random_llama(out: Path, shape: tuple[int, ...], tokenizer_dir: Path) -> Path:
    """A random-weight BF16 Llama of ``shape`` with the demo tokenizer (built in a child: its RAM is not ours)."""
    if (out / "config.json").exists():
        return out
    hidden, layers, inter, heads, kv, vocab, tied = shape
    code = f"""
import torch, transformers
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
cfg = transformers.LlamaConfig(vocab_size={vocab}, hidden_size={hidden}, intermediate_size={inter},
    num_hidden_layers={layers}, num_attention_heads={heads}, num_key_value_heads={kv},
    max_position_embeddings=4096, tie_word_embeddings={tied}, bos_token_id=0, eos_token_id=0, pad_token_id=1)
model = transformers.LlamaForCausalLM(cfg)
model.config.dtype = torch.bfloat16
model.save_pretrained({str(out)!r}, max_shard_size={SHARD!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, out / name)
    return out


def tokenizer_and_corpus(work: Path) -> tuple[Path, Path]:
    from quark_ptq_eval.flows.demo import build_corpus, build_tiny_model

    corpus = work / "corpus.txt"
    if not corpus.exists():
        build_corpus(corpus)
    tiny = work / "tokenizer-source"
    if not (tiny / "tokenizer.json").exists():
        build_tiny_model(tiny, corpus, train_steps=2)  # only its tokenizer is used
    return tiny, corpus


def measure(model: Path, corpus: Path, scheme: str, algorithm: str | None, samples: int, seq: int,
            out: Path) -> dict:
    argv = ["/usr/bin/time", "-v", sys.executable, "-m", "quark_ptq_eval.execute.quark_api_engine",
            "--model_dir", str(model), "--output_dir", str(out), "--quant_scheme", scheme, "--device", "cpu",
            "--calib_data", str(corpus), "--num_calib_data", str(samples), "--seq_len", str(seq),
            "--exclude_layers", "lm_head"]
    if algorithm:
        argv += ["--quant_algo", algorithm]
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=ENV, capture_output=True, text=True)
    wall = time.monotonic() - t0
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    if proc.returncode != 0 or not rss:
        raise RuntimeError(f"engine failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    return {"peak_rss_bytes": int(rss.group(1)) * 1024, "wall_s": round(wall, 1), "output_bytes": size}


def model_facts(model: Path) -> dict:
    from quark_ptq_eval.base.catalog import load_catalog
    from quark_ptq_eval.intake import analyze_model

    a = analyze_model(str(model), offline=True, catalog=load_catalog())
    return {"params": a.size["params"], "model_bytes": a.size["bytes"], "analysis": a}


def parse_run(spec: str) -> tuple[str, str, str | None, int, int]:
    parts = (spec.split(":") + ["", ""])[:4]
    size, scheme, algorithm, calib = parts
    samples, seq = (int(x) for x in calib.split("x")) if calib else (16, 128)
    return size, scheme, algorithm or None, samples, seq


def predicted(analysis, scheme: str, algorithm: str | None, samples: int, seq: int, catalog: dict) -> dict:
    from quark_ptq_eval.plan.resources import estimate_quantize, output_bytes

    calib = {"num_samples": samples, "seq_len": seq, "batch_size": 1}
    info = catalog["scheme_info"].get(scheme, {})
    est = estimate_quantize(analysis, info, algorithm, calib, "cpu")
    return {"estimate_bytes": est["host_peak_bytes"], "estimate_output_bytes": output_bytes(analysis, scheme, info)}


def fit(rows: list[dict]) -> dict:
    """Least squares over the plain-PTQ rows: peak = start-up + k x model bytes (+ x activations,
    from the rows that differ only in calibration); algorithms: their extra over that line, per model byte."""
    import numpy as np

    plain = [r for r in rows if not r["algorithm"] and (r["samples"], r["seq_len"]) == (16, 128)]
    x = np.array([[1.0, r["model_bytes"]] for r in plain])
    (base, k), *_ = np.linalg.lstsq(x, np.array([r["peak_rss_bytes"] for r in plain], dtype=float), rcond=None)
    extra = {}
    for r in rows:
        line = base + k * r["model_bytes"]
        if r["algorithm"]:
            extra.setdefault(r["algorithm"], []).append((r["peak_rss_bytes"] - line) / r["model_bytes"])
    return {"start_up_gib": base / 2**30, "weight_factor": k,
            "algorithm_weight_factor": {a: sum(v) / len(v) for a, v in extra.items()}}


def report(rows: list[dict]) -> str:
    """The Markdown table for docs/planning.md: measured peak vs the planner's estimate."""
    lines = ["| run | params | model | calibration | peak RSS | estimate | error | output | estimate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = (r["estimate_bytes"] - r["peak_rss_bytes"]) / r["peak_rss_bytes"]
        lines.append(f"| {r['scheme']}{' + ' + r['algorithm'] if r['algorithm'] else ''} | {r['params'] / 1e6:.0f} M "
                     f"| {r['model_bytes'] / 2**20:.0f} MiB | {r['samples']} x {r['seq_len']} "
                     f"| {r['peak_rss_bytes'] / 2**30:.2f} GiB | {r['estimate_bytes'] / 2**30:.2f} GiB | {err:+.0%} "
                     f"| {r['output_bytes'] / 2**20:.0f} MiB | {r['estimate_output_bytes'] / 2**20:.0f} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/qpe-mem"))
    p.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS))
    p.add_argument("--results", type=Path, help="append JSON rows here (default OUT/results.jsonl)")
    p.add_argument("--fit", action="store_true", help="fit and tabulate the rows in --results, run nothing")
    args = p.parse_args(argv)
    if args.fit:
        from quark_ptq_eval.base.catalog import load_catalog

        rows = [json.loads(line) for line in (args.results or args.out / "results.jsonl").read_text().splitlines()]
        print(json.dumps(fit(rows), indent=2))
        for r in rows:  # the estimate of the planner as it is now (the rows keep the one made at the time)
            a = model_facts(args.out / f"llama-{r['size']}")["analysis"]
            r.update(predicted(a, r["scheme"], r["algorithm"], r["samples"], r["seq_len"], load_catalog()))
        print(report(rows))
        return
    from quark_ptq_eval.base.catalog import load_catalog

    catalog = load_catalog()
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.results or args.out / "results.jsonl"
    tok, corpus = tokenizer_and_corpus(args.out)
    for spec in args.runs:
        size, scheme, algorithm, samples, seq = parse_run(spec)
        model = build_random_llama(args.out / f"llama-{size}", SHAPES[size], tok)
        facts = model_facts(model)
        row = {"run": spec, "size": size, "scheme": scheme, "algorithm": algorithm, "samples": samples,
               "seq_len": seq, "params": facts["params"], "model_bytes": facts["model_bytes"],
               **measure(model, corpus, scheme, algorithm, samples, seq, args.out / "output")}
        row.update(predicted(facts["analysis"], scheme, algorithm, samples, seq, catalog))
        print(json.dumps(row), flush=True)
        with results.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
