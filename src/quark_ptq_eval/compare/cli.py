"""`quark-ptq-eval compare`: its arguments and its command (cheap to import: no torch here)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..checkpoints import Approver
from ..errors import ExitCode

# flag -> PlanRequest field, shared by every scheme of the comparison
PLAN_FLAGS = {"--goal": "goal", "--target": "target", "--algorithm": "algorithm", "--kv-cache-scheme": "kv_cache_scheme",
              "--calib-data": "calib_data", "--calib-dataset": "calib_dataset", "--num-calib-samples": "num_calib_samples",
              "--calib-seq-len": "calib_seq_len", "--device": "device", "--engine": "engine"}
INT_FLAGS = ("--num-calib-samples", "--calib-seq-len")


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="local model directory (kept from the first call)")
    p.add_argument("--schemes", help="comma-separated Quark schemes, e.g. fp8,int8,int4_wo_128,mxfp4")
    p.add_argument("-o", "--output-root", dest="out_root", type=Path, required=True,
                   help="the comparison's directory: models, work dirs, baseline cache and the report")
    g = p.add_argument_group("quantization (every scheme)")
    for flag, dest in PLAN_FLAGS.items():
        g.add_argument(flag, dest=dest, type=int if flag in INT_FLAGS else str)
    g.add_argument("--exclude", dest="exclude_layers", nargs="+", metavar="PATTERN")
    g.add_argument("--trust-remote-code", action="store_true", default=None)
    g = p.add_argument_group("evaluation (Tier 1 against a baseline evaluated once)")
    g.add_argument("--eval-data", type=Path, help="local text (.txt/.jsonl/.parquet); default wikitext-2 test")
    g.add_argument("--seq-len", type=int, help="window length in tokens (default 2048)")
    g.add_argument("--max-windows", type=int, help="score at most this many windows")
    g.add_argument("--eval-batch-size", type=int)
    g.add_argument("--eval-device", help="cpu, cuda or auto (default)")
    g.add_argument("--top-k", type=int, help="baseline log-probabilities kept per token in the cache (default 64)")
    g = p.add_argument_group("task scores (Tier 2: lm-eval per scheme, paired tests against the baseline)")
    g.add_argument("--tasks", help="lm-eval tasks, comma-separated (e.g. arc_easy,hellaswag); none: Tier 1 only")
    g.add_argument("--include-path", type=Path, help="directory of local lm-eval task YAMLs")
    g.add_argument("--limit", type=float, help="lm-eval: documents per task (a fraction when below 1)")
    g.add_argument("--num-fewshot", type=int)
    g = p.add_argument_group("recommendation (accuracy budget)")
    g.add_argument("--max-kl", type=float, help="largest acceptable mean KL(baseline || scheme)")
    g.add_argument("--max-ppl-increase-pct", type=float,
                   help="largest acceptable perplexity increase in percent (default 2 when no budget is given)")
    g.add_argument("--max-task-drop-pct", type=float,
                   help="largest acceptable drop of any task metric, in percent of the baseline's (needs --tasks)")
    g = p.add_argument_group("run control")
    g.add_argument("--approve", default="", metavar="GATES", help="comma-separated approvals: intake,plan,execute,result,...")
    g.add_argument("--yes", "-y", action="store_true", help="approve every gate except overwrite and baseline")
    g.add_argument("--overwrite", action="store_true", default=None)
    g.add_argument("--offline", action="store_true", default=None)
    g.add_argument("--json", action="store_true", help="print comparison.json on stdout")
    g.add_argument("--quiet", "-q", action="store_true")


def cmd_compare(args: argparse.Namespace, approver: Approver) -> int:
    from . import compare

    plan = {dest: getattr(args, dest) for dest in (*PLAN_FLAGS.values(), "exclude_layers", "trust_remote_code")}
    if plan.get("calib_data"):
        plan["calib_data"] = os.path.abspath(plan["calib_data"])
    result = compare(args.model, args.schemes, args.out_root, approver=approver, quiet=args.quiet or args.json,
                     eval_data=args.eval_data, seq_len=args.seq_len, max_windows=args.max_windows,
                     eval_batch_size=args.eval_batch_size, eval_device=args.eval_device, top_k=args.top_k,
                     max_kl=args.max_kl, max_ppl_increase_pct=args.max_ppl_increase_pct, tasks=args.tasks,
                     include_path=args.include_path, limit=args.limit, num_fewshot=args.num_fewshot,
                     max_task_drop_pct=args.max_task_drop_pct, offline=args.offline,
                     overwrite=bool(args.overwrite), **{k: v for k, v in plan.items() if v is not None})
    if args.json:
        print(json.dumps(result, indent=2))
    return ExitCode.OK
