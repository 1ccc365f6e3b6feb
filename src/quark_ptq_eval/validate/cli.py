"""The ``validate`` sub-command's pieces, used by the main CLI (which owns the parser and approver)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import cast

from quark_ptq_eval.base.artifacts import PlanJson
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.fsio import read_json
from quark_ptq_eval.base.gates import Approver, Gatekeeper
from quark_ptq_eval.base.ui import noise_to_log
from quark_ptq_eval.validate.fixes import fix_and_revalidate
from quark_ptq_eval.validate.load_sample import LOAD_MINUTES_HELP, load_budget_s
from quark_ptq_eval.validate.report import ValidationReport
from quark_ptq_eval.validate.runner import validate_model

MAX_PRINTED = 20


def add_validate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", required=True, type=Path, help="the unquantized model directory")
    parser.add_argument("--quantized", required=True, type=Path, help="the Quark export to validate")
    parser.add_argument("--plan", type=Path, default=None,
                        help="quant_plan.json (exclusions, overrides); default: the output's quantization_config")
    parser.add_argument("--max-samples", type=int, default=None,
                        help="byte-compare at most this many of the tensors that must not change, drawn with --seed "
                             "(default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --max-samples draw (default 0)")
    parser.add_argument("--workers", type=int, default=None, help="parallel byte readers (default: up to 4 cores)")
    parser.add_argument("--no-load-check", action="store_true",
                        help="skip loading the export and running a probe through it (for models too large for "
                             "this host); the report says it was skipped")
    parser.add_argument("--load-check-minutes", type=float, default=None, metavar="MINUTES",
                        help=LOAD_MINUTES_HELP)
    parser.add_argument("--vllm-python", type=Path, default=None, metavar="PYTHON",
                        help="the serving check: start this vLLM environment's server on the export (e.g. "
                             ".venv-vllm/bin/python from `make vllm-env`; default $QUARK_PTQ_EVAL_VLLM_PYTHON, "
                             "else this checkout's .venv-vllm)")


def cmd_validate(args: argparse.Namespace, approver: Approver) -> int:
    """Validate, write the reports into ``args.workdir``, offer fixes; exit 0 or raise per exit codes."""
    plan = _load_plan(args.plan)
    workdir = Path(getattr(args, "workdir", None) or ".")
    options = {"max_samples": args.max_samples, "seed": args.seed, "workers": args.workers,
               "load_check": not getattr(args, "no_load_check", False),
               "load_budget_s": load_budget_s(getattr(args, "load_check_minutes", None)),
               "vllm_python": getattr(args, "vllm_python", None)}
    log = workdir / "logs" / "validate.log"

    def revalidate() -> ValidationReport:
        with noise_to_log(log):  # Quark's and transformers' chatter: the log
            return validate_model(args.source, args.quantized, plan, **options)

    def announce(_fixes: str) -> None:  # the failing report stays readable while the fix gate waits
        report.write(workdir)
        _print_failures(report)

    report = revalidate()
    if not report.structural_failure:  # a re-copy cannot cure wrong weights: no fix is offered for them
        gates = Gatekeeper(approver, continue_with=lambda _: "re-run with --approve fix (or answer yes).")
        report = fix_and_revalidate(report, gates, revalidate, announce)
    md_path, _ = report.write(workdir)
    if report.status == "failed":
        _print_failures(report)
        print(f"Report: {md_path}", file=sys.stderr)
        report.raise_for_status()
    print(report.one_line())
    for fix in report.applied_fixes:
        print(f"Applied fix: {fix}")
    print(f"Report: {md_path}")
    return 0


def _load_plan(path: Path | None) -> PlanJson | None:
    if path is None:
        return None
    plan = read_json(path, "quant plan")
    if not isinstance(plan, dict) or not isinstance(plan.get("exclude_layers", []), list):
        raise UsageError(f"The quant plan {path} is not a quant_plan.json object with an exclude_layers list.")
    return cast(PlanJson, plan)  # any of quant_plan.json's keys: each check reads what it needs


def _print_failures(report: ValidationReport) -> None:
    print(report.one_line(), file=sys.stderr)
    for name, finding in report.failures[:MAX_PRINTED]:
        print(f"  [{name}] {finding.line()}", file=sys.stderr)
    if len(report.failures) > MAX_PRINTED:
        print(f"  ... and {len(report.failures) - MAX_PRINTED} more", file=sys.stderr)
