"""Streamed Tier 1 on a DeepSeek-V3-shaped BF16 checkpoint: wall time and peak RSS when a MoE block exceeds the host.

A DeepSeek-V3 MoE block holds 256 routed experts x 3 x 7168 x 2048 in BF16 (~22.5 GB): more than a block of
one model may hold here (``evaluate/ppl/stream.py:block_budget()``, a quarter of the RAM free at the start), so
the streamed tier reads its routed experts a group at a time (``runtime/expert_groups.py``). This bench writes
(``bench_real_size_plans.mla_moe``: DeepSeek-V3's architecture, the release's tensor names, shapes and dtypes,
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` per expert; payloads left as holes that read as
zeros and cost no disk) a BF16 checkpoint of DeepSeek-V3's real config (hidden 7168, intermediate 18432,
moe_intermediate 2048, 256 routed + 1 shared expert, 8 per token, n_group 8 / topk_group 4, MLA with q_lora
1536, kv_lora 512, qk_nope 128, qk_rope 64, v_head 128, 128 heads, vocab 129280, YaRN rope) cut to
``num_hidden_layers=5``: blocks 0-2 dense (``first_k_dense_replace`` 3), blocks 3-4 MoE. Its tokenizer is
SmolLM2's (49,152 ids, all valid rows of the 129,280-row embedding) from ``--tokenizer``.

Then ``quark-ptq-eval eval --tier ppl --quantized CKPT --source CKPT --baseline`` runs in a child, as a user runs
it (the same checkpoint on both sides: two models streamed), on a short text. Printed: the checkpoint's
apparent size and disk use, each block's bytes, whether blocks were read by expert groups and the group size
(the tier's own notes and log line), wall time, peak RSS (the child's maximum resident set from ``wait4``, and
the whole process tree's summed RSS polled every 0.2 s with psutil), the load average before and after.

All-zero weights run every kernel at full size (every expert's tensors are read, the block's matmuls have
the real shapes), so time and memory are real; the routing is degenerate (all router logits equal: top-k by
index, every token to the same 8 experts), so each group's expert forward sees tokens only in the group holding
those experts, and the perplexity is that of uniform logits. That is fine for memory and time; correctness is
the tests' business (tests/runtime/test_expert_groups.py: equal to the in-memory tier on tiny models).

    flock /tmp/cpu-slot.lock .venv/bin/python -m bench.benchmarks.bench_giant_moe_tier1 [--work DIR] \
        [--tokenizer DIR] [--seq-len 128 --windows 2] [--case probe]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.benchmarks.bench_real_size_plans import mla_moe, nbytes, write_sparse

LAYERS = 5  # 3 dense blocks + 2 MoE blocks
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")
# DeepSeek-V3's config.json beyond the shapes mla_moe writes (the release's values)
DEEPSEEK_V3_EXTRA = {
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "moe_layer_freq": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "max_position_embeddings": 163840, "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 1, "initializer_range": 0.02, "use_cache": True,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
TEXT = ("The committee met on a grey morning to weigh the report on river levels, harbour dredging and the cost "
        "of rebuilding the old stone bridge. Each member read a section aloud, asked questions of the engineers, "
        "and noted where the figures disagreed with last year's survey. ")


def deepseek_v3_cut(case: str) -> tuple[dict, list[tuple[str, str, list[int]]], int]:
    """DeepSeek-V3 in BF16 (no MTP layer) cut to ``LAYERS`` blocks; ``probe``: the same layout, 16 experts."""
    config, tensors, _ = mla_moe(experts=256 if case == "deepseek-v3-5l" else 16, heads=128, vocab=129280, dense=3,
                                 mtp=False, fp8_blocks=False, shards=1)
    kept = [t for t in tensors if not t[0].startswith("model.layers.")
            or int(t[0].split(".")[2]) < LAYERS]
    config = {**config, **DEEPSEEK_V3_EXTRA, "num_hidden_layers": LAYERS}
    shards = max(1, round(sum(nbytes(d, s) for _, d, s in kept) / 5e9))  # ~5 GB shards, as releases cut them
    return config, kept, shards


def build(case: str, work: Path, tokenizer: Path) -> Path:
    out = work / case
    if not (out / "config.json").exists():
        config, tensors, shards = deepseek_v3_cut(case)
        write_sparse(out, config, tensors, shards)
        for name in TOKENIZER_FILES:
            if (tokenizer / name).exists():
                shutil.copy(tokenizer / name, out / name)
    return out


def eval_text(work: Path) -> Path:
    path = work / "eval.txt"
    path.write_text("\n\n".join(f"{i}. {TEXT}" for i in range(40)), encoding="utf-8")
    return path


def block_bytes(ckpt: Path) -> dict[str, int]:
    """Bytes per decoder block, and of the embedding and lm_head, from the safetensors headers."""
    from quark_ptq_eval.base.safetensors_io import read_model_headers

    parts: dict[str, int] = {}
    for name, info in read_model_headers(ckpt).items():
        key = f"block {name.split('.')[2]}" if name.startswith("model.layers.") else name.removesuffix(".weight")
        parts[key] = parts.get(key, 0) + info.nbytes
    return parts


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):  # a child that ended between the listing and the read
            total += proc.memory_info().rss
    return total


def run_eval(ckpt: Path, text: Path, workdir: Path, args: argparse.Namespace) -> dict:
    argv = [sys.executable, "-m", "quark_ptq_eval", "eval", "--tier", "ppl", "--quantized", str(ckpt),
            "--source", str(ckpt), "--baseline", "--eval-data", str(text), "--seq-len", str(args.seq_len),
            "--max-windows", str(args.windows), "--device", "cpu", "--offline", "--yes", "--workdir", str(workdir)]
    shutil.rmtree(workdir, ignore_errors=True)
    log_path = workdir.with_suffix(".log")
    load = os.getloadavg()[0]
    peak_tree, done = [0], threading.Event()
    started = time.perf_counter()
    with open(log_path, "w") as log:
        child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, "HF_HUB_OFFLINE": "1"})

        def poll() -> None:
            while not done.is_set():
                peak_tree[0] = max(peak_tree[0], _tree_rss(child.pid))
                done.wait(0.2)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        _, status, usage = os.wait4(child.pid, 0)
        done.set()
        poller.join()
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    wall = time.perf_counter() - started
    return {"rc": child.returncode, "wall_s": wall, "peak_rss_gib": usage.ru_maxrss / 2**20,
            "peak_tree_gib": peak_tree[0] / 2**30, "load": (load, os.getloadavg()[0]), "log": log_path,
            "workdir": workdir}


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def grouping(result: dict) -> list[str]:
    """The tier's own words on expert groups: its log line(s) and its note in eval_results.json."""
    lines = [line.strip() for line in result["log"].read_text(errors="replace").splitlines()
             if "routed experts" in line or "Streamed block by block" in line or "streaming " in line]
    results = result["workdir"] / "eval_results.json"
    if results.exists():
        data = json.loads(results.read_text())
        lines += [s for s in _strings(data) if "routed experts were read" in s or "Streamed block by block" in s]
        lines += [f"{k}: {v}" for k, v in _figures(data).items()]
    return list(dict.fromkeys(lines))


def _figures(data: dict) -> dict:
    found: dict = {}

    def walk(value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if k in ("perplexity", "baseline_perplexity", "kl_mean", "mean_kl", "top1_agreement") and not isinstance(
                        v, (dict, list)):
                    found.setdefault(k, v)
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(data)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench-giant-moe")
    parser.add_argument("--tokenizer", type=Path, default=Path("/tmp/rbench/smollm2-135m"))
    parser.add_argument("--case", choices=["deepseek-v3-5l", "probe"], default="deepseek-v3-5l")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--windows", type=int, default=2)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt = build(args.case, args.work, args.tokenizer)
    files = list(ckpt.glob("*.safetensors"))
    apparent = sum(f.stat().st_size for f in files)
    on_disk = sum(f.stat().st_blocks * 512 for f in files)
    parts = block_bytes(ckpt)
    print(f"{args.case}: {ckpt} ({len(files)} shards): apparent {apparent / 2**30:.1f} GiB, on disk "
          f"{on_disk / 2**20:.1f} MiB", flush=True)
    print("  " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in parts.items() if v >= 2**27), flush=True)
    from quark_ptq_eval.evaluate.ppl.stream import block_budget

    print(f"  block budget now (a quarter of MemAvailable): {block_budget() / 2**30:.2f} GiB a model", flush=True)
    result = run_eval(ckpt, eval_text(args.work), args.work / f"{args.case}-eval", args)
    print(f"  eval --tier ppl --baseline ({args.windows} windows of {args.seq_len} tokens): rc {result['rc']}", flush=True)
    for line in grouping(result):
        print(f"    {line}", flush=True)
    if result["rc"]:
        print("  child's log tail:\n" + result["log"].read_text(errors="replace")[-3000:], flush=True)
    print(f"  wall {result['wall_s']:.1f} s  peak RSS {result['peak_rss_gib']:.2f} GiB (wait4), process tree "
          f"{result['peak_tree_gib']:.2f} GiB (psutil, 0.2 s polls)  (load {result['load'][0]:.2f} -> "
          f"{result['load'][1]:.2f})", flush=True)
    limit = 16.0
    peak = max(result["peak_rss_gib"], result["peak_tree_gib"])
    print(f"  peak {'under' if peak < limit else 'OVER'} {limit:.0f} GiB", flush=True)


if __name__ == "__main__":
    main()
