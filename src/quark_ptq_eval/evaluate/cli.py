"""CLI pieces for `quark-ptq-eval eval` and for the eval options of `run` / `resume`.

`run` already owns --batch-size, --device and --trust-remote-code (calibration), so the eval
versions are --eval-batch-size / --eval-device everywhere; `eval` also accepts the short names.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..checkpoints import Gatekeeper
from ..errors import ExitCode, UsageError
from .tiers import TIERS, tier_checkpoint

# argparse dest -> EvalOptions field (dests differ where `run` already uses the plain name)
DEST_TO_FIELD = {
    "eval_data": "eval_data",
    "seq_len": "seq_len",
    "eval_batch_size": "batch_size",
    "eval_device": "device",
    "baseline": "baseline",
    "tasks": "tasks",
    "num_fewshot": "num_fewshot",
    "limit": "limit",
    "include_path": "include_path",
    "max_gen_toks": "max_gen_toks",
    "max_windows": "max_windows",
    "eval_text_limit": "eval_text_limit",
    "vllm_runtime": "vllm_runtime",
    "vllm_image": "vllm_image",
    "vllm_container": "vllm_container",
    "vllm_port": "vllm_port",
    "trust_remote_code": "trust_remote_code",
}


def add_eval_arguments(parser: argparse.ArgumentParser, standalone: bool = True) -> None:
    """Eval options; ``standalone`` (the `eval` command) adds --model, --source and the short names."""
    g = parser.add_argument_group("evaluation (Phase 3)")
    tier_help = "; ".join(f"{t.name}: tier {t.number}, {t.method} ({t.cost})" for t in TIERS.values())
    g.add_argument("--eval-tier", "--tier", dest="eval_tier", choices=list(TIERS), help=tier_help)
    if standalone:
        g.add_argument("--model", type=Path, required=True, help="the quantized model directory to evaluate")
        g.add_argument(
            "--source", type=Path, help="its unquantized source (model card reference; --baseline default)"
        )
        g.add_argument("--trust-remote-code", action="store_true", default=None)
    g.add_argument(
        "--eval-data",
        type=Path,
        metavar="PATH",
        help="local text (.txt/.jsonl/.parquet or a saved datasets dir); default wikitext-2 test",
    )
    g.add_argument("--seq-len", type=int, help="Tier 1 window length in tokens (default 2048, like Quark)")
    g.add_argument("--max-windows", type=int, help="Tier 1: score at most this many windows")
    g.add_argument("--eval-text-limit", type=int, metavar="DOCS", help="use only the first DOCS documents")
    batch = ["--eval-batch-size", "--batch-size"] if standalone else ["--eval-batch-size"]
    g.add_argument(
        *batch, dest="eval_batch_size", type=int, help="windows / requests per forward (default: auto)"
    )
    device = ["--eval-device", "--device"] if standalone else ["--eval-device"]
    g.add_argument(*device, dest="eval_device", help="auto (default), cpu, cuda")
    g.add_argument(
        "--baseline",
        nargs="?",
        const="<source>",
        metavar="SRC",
        help="also evaluate the unquantized model (about double the time); no value: the source",
    )
    g.add_argument(
        "--reference",
        action="append",
        metavar="TASK:METRIC=VALUE",
        help="a published score to compare with (repeatable), e.g. gsm8k:exact_match=0.62",
    )
    g.add_argument("--tasks", help="Tier 2/3 lm-eval tasks, comma-separated (e.g. gsm8k,arc_easy)")
    g.add_argument("--num-fewshot", type=int)
    g.add_argument("--limit", type=float, help="lm-eval: documents per task (a fraction when below 1)")
    g.add_argument("--include-path", type=Path, help="directory of local lm-eval task YAMLs")
    g.add_argument(
        "--max-gen-toks", type=int, help="generation budget (default: task's; large for reasoning models)"
    )
    g.add_argument("--healthy-pct", type=float, help="at most this much worse is healthy (default 2)")
    g.add_argument("--hurt-pct", type=float, help="more than this much worse is hurt (default 5)")
    g.add_argument("--vllm-runtime", choices=("auto", "docker", "host"), help="Tier 3 runtime (default auto)")
    g.add_argument("--vllm-image", help="Tier 3 docker image (default vllm/vllm-openai-rocm:latest)")
    g.add_argument("--vllm-container", help="Tier 3: reuse this running container")
    g.add_argument("--vllm-port", type=int, help="Tier 3 server port (default 8080)")


def eval_options_from_args(args: argparse.Namespace, explicit_only: bool = False):
    """EvalOptions from parsed args; ``explicit_only``: a dict of the fields actually given (for `run`)."""
    from .options import EvalOptions, Thresholds
    from .reference import parse_reference

    given: dict[str, Any] = {}
    for dest, name in DEST_TO_FIELD.items():
        value = getattr(args, dest, None)
        if value is not None:
            given[name] = value
    if given.get("tasks"):
        given["tasks"] = [t.strip() for t in given["tasks"].split(",") if t.strip()]
    if getattr(args, "reference", None):
        given["reference"] = parse_reference(args.reference)
    healthy, hurt = getattr(args, "healthy_pct", None), getattr(args, "hurt_pct", None)
    if healthy is not None or hurt is not None:
        defaults = Thresholds()
        given["thresholds"] = Thresholds(
            healthy if healthy is not None else defaults.healthy_pct,
            hurt if hurt is not None else defaults.hurt_pct,
        )
    if getattr(args, "eval_tier", None):
        given["tier"] = args.eval_tier
    if explicit_only:
        return given
    return EvalOptions(**given)


def cmd_eval(args: argparse.Namespace, approver) -> int:
    """`quark-ptq-eval eval --model OUT --tier ...`: one tier on its own."""
    from .api import evaluate

    if not getattr(args, "eval_tier", None):
        message, flag = tier_checkpoint()
        flag = flag.replace("--eval-tier", "--tier")
        Gatekeeper(approver, continue_with=lambda f: f"quark-ptq-eval eval --model {args.model} {f}").stop(
            "eval", message, flag)
    if not Path(args.model).is_dir():
        raise UsageError(f"The model directory {args.model} does not exist.")
    options = eval_options_from_args(args)
    workdir = Path(getattr(args, "workdir", None) or ".")
    report = evaluate(
        Path(args.model), options, workdir, approver, source_model=getattr(args, "source", None)
    )
    print(report.one_line())
    print(f"report: {report.report_path}")
    return ExitCode.OK
