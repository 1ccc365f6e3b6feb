"""What the recipe's commands (intake, plan, manifest, execute, run, resume, import-command) share: their
arguments, RunOptions from the flags given, and the run up to the command's step with its summary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from quark_ptq_eval.base.errors import ExitCode
from quark_ptq_eval.cli.args import absolute, add_model_and_output, add_plan_flags, add_run_control, approver
from quark_ptq_eval.context.preflight import CONTEXT_KINDS

if TYPE_CHECKING:
    from quark_ptq_eval.flows.recipe.run_options import RunOptions


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    """plan, manifest, execute: MODEL (optional: the work dir's run names it), the plan's flags, run control."""
    from quark_ptq_eval.cli.quark_cli_flags import add_hidden_aliases

    add_model_and_output(p, model_required=False)
    add_plan_flags(p)
    add_hidden_aliases(p, with_eval=False)  # quark-cli spellings (--num_calib_data, ...), not in --help
    add_run_control(p)


def add_recipe_arguments(p: argparse.ArgumentParser, model_required: bool) -> None:
    """run, resume: the steps' arguments, the run's own options and the evaluation's."""
    from quark_ptq_eval.base.options import add_flags
    from quark_ptq_eval.cli.quark_cli_flags import add_hidden_aliases
    from quark_ptq_eval.evaluate import add_eval_arguments
    from quark_ptq_eval.flows.recipe.run_options import RunOptions

    add_model_and_output(p, model_required=model_required)
    add_flags(p, RunOptions, only=["no_load_check", "load_check_minutes", "card", "base_model"])
    add_plan_flags(p)
    add_eval_arguments(p, standalone=False)
    add_hidden_aliases(p, with_eval=True)
    add_run_control(p)


def options_from_args(args: argparse.Namespace) -> RunOptions:
    """RunOptions from the command line, built as the Python API builds them (``run_options``): the
    keywords are the flags given, paths made absolute (run_state.json serves a `resume` from anywhere)."""
    from quark_ptq_eval.base.options import given
    from quark_ptq_eval.evaluate.options import BASELINE_FROM_SOURCE, EvalOptions
    from quark_ptq_eval.flows.recipe.run_options import RunOptions, run_options
    from quark_ptq_eval.plan.request import PlanRequest

    plan = dict(given(PlanRequest, args).values)
    if "calib_data" in plan:
        plan["calib_data"] = absolute(str(plan["calib_data"]))
    eval_opts = dict(given(EvalOptions, args).values) if hasattr(args, "eval_tier") else {}
    eval_opts = {k: absolute(v) if isinstance(v, Path) and v != BASELINE_FROM_SOURCE else v
                 for k, v in eval_opts.items()}
    model = getattr(args, "model", None)
    own = {"overwrite": bool(getattr(args, "overwrite", None)), "eval_tier": getattr(args, "eval_tier", None),
           "offline": getattr(args, "offline", None), "execution_mode": getattr(args, "execution_mode", None),
           "contexts": {k: str(getattr(args, k)) if getattr(args, k, None) else None for k in CONTEXT_KINDS},
           **given(RunOptions, args).values}
    return run_options(absolute(model) if model and Path(model).exists() else model,
                       absolute(getattr(args, "output_dir", None)), {**plan, **own, "eval_options": eval_opts})


def recipe_command(args: argparse.Namespace) -> int:
    """The recipe up to the step ``args.command`` stops after, then its summary (a table, or JSON)."""
    from quark_ptq_eval.base.step_table import STOP_AFTER
    from quark_ptq_eval.base.ui import Reporter
    from quark_ptq_eval.flows.recipe.pipeline import run_recipe as run_steps
    from quark_ptq_eval.flows.recipe.remedies_side import after_own_eval
    from quark_ptq_eval.flows.recipe.summary import summary_rows

    ui = Reporter(quiet=args.quiet or args.json)
    summary = run_steps(options_from_args(args), args.workdir, approver(args), ui, STOP_AFTER[args.command],
                        after_own_eval)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        ui.table("Summary", summary_rows(summary))
        if summary["stopped_after"]:
            ui.info(f"Done: {summary['stopped_after']} step finished; artifacts in {summary['workdir']}.")
        if summary.get("upload"):
            ui.info(f"To publish it on the Hugging Face Hub (not run): {summary['upload']}")
    return ExitCode.OK
