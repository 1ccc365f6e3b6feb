"""`quark-ptq-eval compare`: its arguments and its command (cheap to import: no torch here)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from quark_ptq_eval.base.errors import ExitCode
from quark_ptq_eval.base.gates import Approver
from quark_ptq_eval.base.options import add_flags, add_offline_flag, given
from quark_ptq_eval.base.ui import noise_to_log

# PlanRequest / EvalOptions fields every scheme of the comparison shares (their flags are declared there)
PLAN_SHARED = ("goal", "target", "algorithm", "kv_cache_scheme", "exclude_layers", "calib_data", "calib_dataset",
               "num_calib_samples", "calib_seq_len", "device", "engine", "trust_remote_code")
TIER1_SHARED = ("eval_data", "seq_len", "max_windows", "batch_size", "device")
TIER2_SHARED = ("tasks", "include_path", "limit", "num_fewshot")


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    from quark_ptq_eval.evaluate.options import EvalOptions
    from quark_ptq_eval.plan.request import PlanRequest

    p.add_argument("model", nargs="?", help="local model directory (kept from the first call)")
    p.add_argument("--schemes", help="comma-separated Quark schemes, e.g. fp8,int8,int4_wo_128,mxfp4")
    p.add_argument("-o", "--output-root", dest="out_root", type=Path, required=True,
                   help="the comparison's directory: models, work dirs, baseline cache and the report")
    add_flags(p.add_argument_group("quantization (every scheme)"), PlanRequest, only=PLAN_SHARED)
    g = p.add_argument_group("evaluation (Tier 1 against a baseline evaluated once)")
    add_flags(g, EvalOptions, only=TIER1_SHARED)
    g.add_argument("--top-k", type=int, help="baseline log-probabilities kept per token in the cache (default 64)")
    add_flags(p.add_argument_group("task scores (Tier 2: lm-eval per scheme, paired tests against the baseline)"),
              EvalOptions, only=TIER2_SHARED)
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
    add_offline_flag(g)
    g.add_argument("--json", action="store_true", help="print comparison.json on stdout")
    g.add_argument("--quiet", "-q", action="store_true")


def cmd_compare(args: argparse.Namespace, approver: Approver) -> int:
    from quark_ptq_eval.evaluate.options import EvalOptions
    from quark_ptq_eval.plan.request import PlanRequest

    plan = given(PlanRequest, args, only=PLAN_SHARED)
    if plan.get("calib_data"):
        plan["calib_data"] = os.path.abspath(plan["calib_data"])
    ev = given(EvalOptions, args, only=TIER1_SHARED + TIER2_SHARED)
    with noise_to_log(Path(args.out_root).resolve() / "logs" / "compare.log"):  # library chatter: the log
        result = _compare(args, approver, plan, ev)
    if args.json:
        print(json.dumps(result, indent=2))
    return ExitCode.OK


def _compare(args: argparse.Namespace, approver: Approver, plan: dict, ev: dict) -> dict:
    from quark_ptq_eval.flows.compare import compare

    return compare(args.model, args.schemes, args.out_root, approver=approver, quiet=args.quiet or args.json,
                   eval_data=ev.get("eval_data"), seq_len=ev.get("seq_len"), max_windows=ev.get("max_windows"),
                   eval_batch_size=ev.get("batch_size"), eval_device=ev.get("device"), top_k=args.top_k,
                   max_kl=args.max_kl, max_ppl_increase_pct=args.max_ppl_increase_pct, tasks=ev.get("tasks"),
                   include_path=ev.get("include_path"), limit=ev.get("limit"), num_fewshot=ev.get("num_fewshot"),
                   max_task_drop_pct=args.max_task_drop_pct, offline=args.offline,
                   overwrite=bool(args.overwrite), **plan)
