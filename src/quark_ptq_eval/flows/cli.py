"""The `quark-ptq-eval` command line: a thin layer over the Python API.

Exit codes: 0 done, 1 failed, 2 usage/bad input, 3 stopped at a checkpoint, 4 validation
failed, 5 work dir locked, 130 interrupted. Expected failures print one sentence (and a hint),
never a traceback. No torch or Quark import happens before a command needs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import sys
from pathlib import Path

from quark_ptq_eval import __version__
from quark_ptq_eval.base.errors import CheckpointPending, ExitCode, QpeError
from quark_ptq_eval.context.preflight import CONTEXT_KINDS


def _common(p: argparse.ArgumentParser) -> None:
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


def _plan_args(p: argparse.ArgumentParser) -> None:
    from quark_ptq_eval.base.options import add_flags
    from quark_ptq_eval.plan.request import PlanRequest

    add_flags(p.add_argument_group("quantization plan"), PlanRequest)


def _run_args(p: argparse.ArgumentParser, model_required: bool) -> None:
    p.add_argument("model", nargs=None if model_required else "?", help="local model directory or Hub repo id")
    p.add_argument("-o", "--output-dir", help="directory for the quantized model")
    p.add_argument("--overwrite", action="store_true", default=None,
                   help="allow a non-empty output dir (its contents are moved aside, never deleted)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quark-ptq-eval", description=__doc__.split("\n")[0],
                                     epilog="Exit codes: 0 done, 1 failed, 2 usage, 3 checkpoint, "
                                            "4 validation failed, 5 locked, 130 interrupted.")
    parser.add_argument("--version", action="version", version=f"quark-ptq-eval {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(command=name)
        return p

    _add_recipe_commands(add)
    _add_tool_commands(add)
    return parser


def _add_recipe_commands(add) -> None:
    """The recipe's steps, one command each, then `run` / `resume` over all of them."""
    from quark_ptq_eval.base.options import add_flags
    from quark_ptq_eval.evaluate import add_eval_arguments
    from quark_ptq_eval.flows.import_command import add_hidden_aliases
    from quark_ptq_eval.flows.run_options import RunOptions
    from quark_ptq_eval.validate import add_validate_arguments

    p = add("preflight", "Detect the environment and write the context files.")
    p.add_argument("--deep", action="store_true",
                   help="also start quark-cli and build the capability catalog (pays the one-time costs now)")
    _common(p)
    p.add_argument("model", nargs="?")
    p.add_argument("-o", "--output-dir")
    p = add("intake", "Phase 1 step 1: analyse the model (config and headers only) -> model_analysis.json.")
    _run_args(p, model_required=True)
    _common(p)
    for name, text in (("plan", "Phase 1 step 2: recommend a plan -> quant_plan.json (needs checkpoint 1)."),
                       ("manifest", "Phase 1 step 3: the exact command -> run_manifest.yaml (needs checkpoint 2)."),
                       ("execute", "Phase 1 step 4: run the approved command and verify the output.")):
        p = add(name, text)
        _run_args(p, model_required=False)
        _plan_args(p)
        add_hidden_aliases(p, with_eval=False)  # quark-cli spellings (--num_calib_data, ...), not in --help
        _common(p)
    p = add("validate", "Phase 2: structural validation of a quantized model against its source.")
    add_validate_arguments(p)
    _common(p)
    p = add("eval", "Phase 3: evaluate a model (perplexity, lm-eval tasks, or vLLM on ROCm).")
    add_eval_arguments(p, standalone=True)
    _common(p)
    for name, text in (("run", "The whole recipe: quantize -> validate -> evaluate, stopping at each gate."),
                       ("resume", "Continue the run in --workdir from where it stopped.")):
        p = add(name, text)
        _run_args(p, model_required=name == "run")
        add_flags(p, RunOptions, only=["no_load_check", "card", "base_model"])
        _plan_args(p)
        add_eval_arguments(p, standalone=False)
        add_hidden_aliases(p, with_eval=True)
        _common(p)


def _add_tool_commands(add) -> None:
    """Commands around the recipe: import a quark-cli line, compare schemes, scan sensitivity, the card, status."""
    from quark_ptq_eval.flows.compare.command import add_compare_arguments
    from quark_ptq_eval.flows.sensitivity_command import add_sensitivity_arguments
    from quark_ptq_eval.flows.sweep_command import add_sweep_arguments

    p = add("import-command", "Translate a pasted `quark-cli torch-llm-ptq ...` line into our plan and show "
                              "it for approval (a plan_only run).")
    p.add_argument("quark_command", nargs="+", metavar="QUARK_CLI_COMMAND",
                   help='the quark-cli line, in quotes: "quark-cli torch-llm-ptq --model_dir ... --quant_scheme ..."')
    p.add_argument("-o", "--output-dir", help="output directory (default: the command's --output_dir)")
    p.add_argument("--calib-data", help="local calibration text instead of quark-cli's Hub dataset")
    _common(p)
    p = add("compare", "Compare schemes in one run: one intake, the plans approved together, one report.")
    add_compare_arguments(p)
    p = add("sweep", "Compare schemes on several models (models x schemes x goals from a YAML/JSON grid): one "
                     "comparison each, one summary table.")
    add_sweep_arguments(p)
    p = add("sensitivity", "Measure how much quantizing each layer alone hurts; propose layers to keep unquantized.")
    add_sensitivity_arguments(p)
    from quark_ptq_eval.publish.cli import add_card_arguments

    add_card_arguments(add("card", "Write the export's model card (README.md) again from its run's artifacts."))
    p = add("status", "Show where the run in --workdir stands.")
    p.add_argument("--workdir", type=Path, default=Path("."))
    p.add_argument("--json", action="store_true")
    p = add("engine-host", "Keep torch, transformers and Quark imported and fork each engine of the runs that name "
                           "this host in $QUARK_PTQ_EVAL_ENGINE_HOST (many runs in a row on one CPU host).")
    p.add_argument("--socket", required=True, type=Path, help="the path the runs name in $QUARK_PTQ_EVAL_ENGINE_HOST")


def _approver(args: argparse.Namespace):
    from quark_ptq_eval.base.gates import FlagApprover, TerminalApprover

    gates = [g.strip() for g in (getattr(args, "approve", "") or "").split(",") if g.strip()]
    if getattr(args, "overwrite", None):
        gates.append("overwrite")
    mode = getattr(args, "execution_mode", None)
    interactive = sys.stdin.isatty() and mode != "batch_execute" and not getattr(args, "json", False)
    cls = TerminalApprover if interactive or mode == "interactive_execute" else FlagApprover
    return cls(gates, all_gates=bool(getattr(args, "yes", False)))


def _run_options(args: argparse.Namespace):
    """RunOptions from the command line, built as the Python API builds them (``run_options``): the
    keywords are the flags given, paths made absolute (run_state.json serves a `resume` from anywhere)."""
    from quark_ptq_eval.base.options import given
    from quark_ptq_eval.evaluate import eval_options_from_args
    from quark_ptq_eval.evaluate.options import BASELINE_FROM_SOURCE
    from quark_ptq_eval.flows.run_options import RunOptions, run_options
    from quark_ptq_eval.plan.request import PlanRequest

    plan = given(PlanRequest, args)
    if "calib_data" in plan:
        plan["calib_data"] = _absolute(plan["calib_data"])
    eval_opts = eval_options_from_args(args, explicit_only=True) if hasattr(args, "eval_tier") else {}
    eval_opts = {k: _absolute(v) if isinstance(v, Path) and v != BASELINE_FROM_SOURCE else v
                 for k, v in eval_opts.items()}
    model = getattr(args, "model", None)
    own = {"overwrite": bool(getattr(args, "overwrite", None)), "eval_tier": getattr(args, "eval_tier", None),
           "offline": getattr(args, "offline", None), "execution_mode": getattr(args, "execution_mode", None),
           "contexts": {k: str(getattr(args, k)) if getattr(args, k, None) else None for k in CONTEXT_KINDS},
           **given(RunOptions, args)}
    return run_options(_absolute(model) if model and Path(model).exists() else model,
                       _absolute(getattr(args, "output_dir", None)), {**plan, **own, "eval_options": eval_opts})


def _absolute(path: str | Path | None) -> str | None:
    return None if path is None else os.path.abspath(os.path.expanduser(str(path)))


def _cmd_pipeline(args: argparse.Namespace) -> int:
    from quark_ptq_eval.base.step_table import STOP_AFTER
    from quark_ptq_eval.base.ui import Reporter
    from quark_ptq_eval.flows.budget_side import measure_side_by_side
    from quark_ptq_eval.flows.pipeline import run_recipe
    from quark_ptq_eval.flows.summary import summary_rows

    ui = Reporter(quiet=args.quiet or args.json)
    summary = run_recipe(_run_options(args), args.workdir, _approver(args), ui, STOP_AFTER[args.command],
                         measure_side_by_side)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        ui.table("Summary", summary_rows(summary))
        if summary["stopped_after"]:
            ui.info(f"Done: {summary['stopped_after']} step finished; artifacts in {summary['workdir']}.")
        if summary.get("upload"):
            ui.info(f"To publish it on the Hugging Face Hub (not run): {summary['upload']}")
    return ExitCode.OK


def _cmd_status(args: argparse.Namespace) -> int:
    from quark_ptq_eval.flows.status import describe_status

    report = describe_status(args.workdir)
    print(json.dumps(report, indent=2) if args.json else report["text"])
    return ExitCode.OK


def _cmd_preflight(args: argparse.Namespace) -> int:
    from quark_ptq_eval.context import preflight

    args.workdir.mkdir(parents=True, exist_ok=True)
    ctx = preflight.gather(args.workdir.resolve(), {k: getattr(args, k) for k in preflight.CONTEXT_KINDS},
                           preflight.SessionAsk("", args.offline, args.execution_mode),
                           preflight.WorkspaceAsk(args.model or "", Path(args.model).resolve() if args.model else None,
                                                  Path(args.output_dir or "").resolve()))
    checks = preflight.host_checks(ctx, args.workdir.resolve(), deep=args.deep)
    data = {"env_context": ctx.env, "pytorch_install_result": ctx.pytorch, "quark_install_result": ctx.quark,
            "checks": [dataclasses.asdict(c) for c in checks]}
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(preflight.render_checks(checks, args.workdir.resolve()))
    return ExitCode.OK


def _cmd_import_command(args: argparse.Namespace) -> int:
    """A pasted quark-cli line -> the equivalent `run --execution-mode plan_only`, through the plan gates."""
    from quark_ptq_eval.base.ui import Reporter
    from quark_ptq_eval.flows.import_command import translate, with_common_options

    ours, rows = translate(args.quark_command)
    argv = ["run", *ours, *with_common_options(args, CONTEXT_KINDS)]
    ui = Reporter(quiet=args.quiet or args.json)
    ui.table("quark-cli flags -> quark-ptq-eval", rows, ("quark-cli", "quark-ptq-eval", "value"))
    ui.info("Equivalent: quark-ptq-eval " + " ".join(shlex.quote(a) for a in argv))
    code = _cmd_pipeline(build_parser().parse_args(argv))
    if not args.execution_mode:
        ui.info(f"To quantize with this plan: quark-ptq-eval resume --workdir {shlex.quote(str(args.workdir))} "
                "--execution-mode interactive_execute (it asks before running anything)")
    return code


def _cmd_validate(args: argparse.Namespace) -> int:
    from quark_ptq_eval.validate import cmd_validate

    return cmd_validate(args, _approver(args))


def _cmd_eval(args: argparse.Namespace) -> int:
    from quark_ptq_eval.evaluate import cmd_eval

    return cmd_eval(args, _approver(args))


def _cmd_compare(args: argparse.Namespace) -> int:
    from quark_ptq_eval.flows.compare.command import cmd_compare

    return cmd_compare(args, _approver(args))


def _cmd_card(args: argparse.Namespace) -> int:
    from quark_ptq_eval.publish.cli import cmd_card

    return cmd_card(args)


def _cmd_sensitivity(args: argparse.Namespace) -> int:
    from quark_ptq_eval.flows.sensitivity_command import cmd_sensitivity

    return cmd_sensitivity(args)


HANDLERS = {"sensitivity": _cmd_sensitivity, "status": _cmd_status, "preflight": _cmd_preflight, "validate": _cmd_validate, "eval": _cmd_eval,
            "compare": _cmd_compare, "card": _cmd_card}
HANDLERS["import-command"] = _cmd_import_command


def _cmd_sweep(args: argparse.Namespace) -> int:
    from quark_ptq_eval.flows.sweep_command import cmd_sweep

    return cmd_sweep(args, _approver(args))


HANDLERS["sweep"] = _cmd_sweep


def _cmd_engine_host(args: argparse.Namespace) -> int:
    from quark_ptq_eval.execute.engine_host import main as host_main

    return host_main(["--socket", str(args.socket)])


HANDLERS["engine-host"] = _cmd_engine_host


def _terminate(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    from quark_ptq_eval.flows.import_command import rewrite_model_dir

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(rewrite_model_dir(argv) if argv[:1] != ["import-command"] else argv)
    handler = HANDLERS.get(args.command, _cmd_pipeline)
    from quark_ptq_eval.base.options import apply_offline

    apply_offline(getattr(args, "offline", None))  # every command, before anything could reach the Hub
    signal.signal(signal.SIGTERM, _terminate)  # SIGTERM stops as cleanly as Ctrl-C (exit 130)
    try:
        return handler(args)
    except CheckpointPending as exc:
        print(f"⏸  {exc.message}\n   {exc.hint}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"status": "waiting", "message": exc.message, "continue": exc.hint}))
        return exc.exit_code
    except QpeError as exc:
        print(f"error: {exc.message}" + (f"\n  hint: {exc.hint}" if exc.hint else ""), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED


def entry() -> None:
    """The `quark-ptq-eval` console script: main(), then out without the interpreter's teardown
    (base/process_exit.py)."""
    from quark_ptq_eval.base.process_exit import exit_now

    exit_now(main())


if __name__ == "__main__":
    entry()
