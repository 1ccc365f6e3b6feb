"""CLI pieces for `quark-ptq-eval eval` and for the eval options of `run` / `resume`.

`run` already owns --batch-size, --device and --trust-remote-code (calibration), so the eval
versions are --eval-batch-size / --eval-device everywhere; `eval` also accepts the short names.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.errors import ExitCode, UsageError
from quark_ptq_eval.base.gates import Gatekeeper
from quark_ptq_eval.base.options import add_flags, given
from quark_ptq_eval.base.ui import noise_to_log
from quark_ptq_eval.evaluate.tiers import tier_checkpoint

if TYPE_CHECKING:
    from quark_ptq_eval.base.gates import Approver
    from quark_ptq_eval.evaluate.options import EvalOptions


def add_eval_arguments(parser: argparse.ArgumentParser, standalone: bool = True) -> None:
    """Eval options (declared on EvalOptions' fields); ``standalone`` (the `eval` command) adds --quantized
    (as `validate` names it; --model still works), --source and the short names."""
    from quark_ptq_eval.evaluate.options import EvalOptions

    g = parser.add_argument_group("evaluation (Phase 3)")
    add_flags(g, EvalOptions, standalone=standalone, only=["tier"])
    if standalone:
        g.add_argument("--quantized", "--model", dest="quantized", type=Path, required=True, action=_DeprecatedAlias,
                       help="the quantized model directory to evaluate (--model: deprecated)")
        g.add_argument(
            "--source", type=Path, help="its unquantized source (model card reference; --baseline default)"
        )
    add_flags(g, EvalOptions, standalone=standalone, skip=["tier"])


class _DeprecatedAlias(argparse.Action):
    """Stores the value; given as ``--model`` (eval's name for it before it took validate's), also says so on stderr."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string == "--model":
            print("--model is deprecated: use --quantized", file=sys.stderr)
        setattr(namespace, self.dest, values)


def eval_options_from_args(args: argparse.Namespace) -> EvalOptions:
    """EvalOptions from parsed args (the fields not given at their defaults)."""
    from quark_ptq_eval.evaluate.options import EvalOptions

    return given(EvalOptions, args).build()


def cmd_eval(args: argparse.Namespace, approver: Approver) -> int:
    """`quark-ptq-eval eval --quantized OUT --tier ...`: one tier on its own."""
    from quark_ptq_eval.evaluate.api import evaluate

    if not getattr(args, "eval_tier", None):
        message, flag = tier_checkpoint()
        flag = flag.replace("--eval-tier", "--tier")
        Gatekeeper(approver, continue_with=lambda f: f"quark-ptq-eval eval --quantized {args.quantized} {f}").stop(
            "eval", message, flag)
    if not Path(args.quantized).is_dir():
        raise UsageError(f"The model directory {args.quantized} does not exist.")
    options = eval_options_from_args(args)
    if options.remedies:
        raise UsageError("--remedies quantizes variants of the plan that made this export: `eval` on its own has no "
                         "plan.", "Give it to the run: quark-ptq-eval run MODEL -o OUT ... --eval-tier ppl --baseline "
                                  f"--remedies {options.remedies}.")
    workdir = Path(getattr(args, "workdir", None) or ".")
    with noise_to_log(workdir / "logs" / "eval.log"):  # library chatter: the log, not the terminal
        report = evaluate(
            Path(args.quantized), options, workdir, approver, source_model=getattr(args, "source", None)
        )
    print(report.one_line())
    print(f"report: {report.report_path}")
    return ExitCode.OK
