"""Argument groups several commands share (run control, the plan's flags, MODEL and -o, the gates by
name, --ray) and what they turn into: the approver, absolute paths. Cheap to import: no torch here."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from quark_ptq_eval.base.gates import Approver
from quark_ptq_eval.context.preflight import CONTEXT_KINDS


def add_run_control(p: argparse.ArgumentParser) -> None:
    """The "run control" group of the recipe's commands: --workdir, the gates, output, offline, the contexts."""
    from quark_ptq_eval.base.options import add_offline_flag

    g = p.add_argument_group("run control")
    g.add_argument("--workdir", type=Path, default=Path("."), help="where artifacts, state and logs go (default: .)")
    g.add_argument("--approve", default="", metavar="GATES",
                   help="comma-separated approvals: intake,plan,execute,result,eval,overwrite,fix,baseline")
    g.add_argument("--yes", "-y", action="store_true", help="approve every gate except overwrite and baseline")
    g.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")
    g.add_argument("--quiet", "-q", action="store_true", help="only errors and the final line")
    add_offline_flag(g)
    g.add_argument("--execution-mode", choices=("plan_only", "interactive_execute", "batch_execute"))
    for kind in CONTEXT_KINDS:
        g.add_argument(f"--{kind.replace('_', '-')}", dest=kind, type=Path, metavar="FILE",
                       help=f"use this {kind}.json instead of producing one")


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """The "quantization plan" group: PlanRequest's flags."""
    from quark_ptq_eval.base.options import add_flags
    from quark_ptq_eval.plan.request import PlanRequest

    add_flags(p.add_argument_group("quantization plan"), PlanRequest)


def add_model_and_output(p: argparse.ArgumentParser, model_required: bool) -> None:
    """MODEL (optional where the work dir's run names it), -o/--output-dir and --overwrite."""
    p.add_argument("model", nargs=None if model_required else "?", help="local model directory or Hub repo id")
    p.add_argument("-o", "--output-dir", help="directory for the quantized model")
    p.add_argument("--overwrite", action="store_true", default=None,
                   help="allow a non-empty output dir (its contents are moved aside, never deleted)")


def add_gate_flags(g: argparse._ActionsContainer) -> None:
    """--approve and --yes: the gates answered by name (compare, sweep)."""
    g.add_argument("--approve", default="", metavar="GATES", help="comma-separated approvals: intake,plan,execute,result,...")
    g.add_argument("--yes", "-y", action="store_true", help="approve every gate except overwrite and baseline")


def add_ray_flag(g: argparse._ActionsContainer, what: str) -> None:
    from quark_ptq_eval.flows.compare.options import RAY_HELP

    g.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS", help=RAY_HELP.format(what=what))


def approver(args: argparse.Namespace) -> Approver:
    """Who answers the gates: the terminal when one is there (and no --json, no batch mode), else the flags."""
    from quark_ptq_eval.base.gates import FlagApprover, TerminalApprover

    gates = [g.strip() for g in (getattr(args, "approve", "") or "").split(",") if g.strip()]
    if getattr(args, "overwrite", None):
        gates.append("overwrite")
    mode = getattr(args, "execution_mode", None)
    interactive = sys.stdin.isatty() and mode != "batch_execute" and not getattr(args, "json", False)
    cls = TerminalApprover if interactive or mode == "interactive_execute" else FlagApprover
    return cls(gates, all_gates=bool(getattr(args, "yes", False)))


def absolute(path: str | Path | None) -> str | None:
    return None if path is None else os.path.abspath(os.path.expanduser(str(path)))
