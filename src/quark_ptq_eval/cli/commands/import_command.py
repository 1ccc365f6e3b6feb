"""`quark-ptq-eval import-command "quark-cli torch-llm-ptq ..."`: a pasted quark-cli line -> the equivalent
`run --execution-mode plan_only`, through the plan gates (the translation: cli/quark_cli_flags.py)."""

from __future__ import annotations

import argparse
import shlex

from quark_ptq_eval.cli.args import add_run_control
from quark_ptq_eval.context.preflight import CONTEXT_KINDS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("quark_command", nargs="+", metavar="QUARK_CLI_COMMAND",
                   help='the quark-cli line, in quotes: "quark-cli torch-llm-ptq --model_dir ... --quant_scheme ..."')
    p.add_argument("-o", "--output-dir", help="output directory (default: the command's --output_dir)")
    p.add_argument("--calib-data", help="local calibration text instead of quark-cli's Hub dataset")
    add_run_control(p)


def run(args: argparse.Namespace) -> int:
    from quark_ptq_eval.base.ui import Reporter
    from quark_ptq_eval.cli.commands import run as run_command
    from quark_ptq_eval.cli.quark_cli_flags import translate, with_common_options
    from quark_ptq_eval.cli.recipe import recipe_command

    ours, rows = translate(args.quark_command)
    argv = ["run", *ours, *with_common_options(args, CONTEXT_KINDS)]
    ui = Reporter(quiet=args.quiet or args.json)
    ui.table("quark-cli flags -> quark-ptq-eval", rows, ("quark-cli", "quark-ptq-eval", "value"))
    ui.info("Equivalent: quark-ptq-eval " + " ".join(shlex.quote(a) for a in argv))
    code = recipe_command(run_command.parse(argv[1:]))
    if not args.execution_mode:
        ui.info(f"To quantize with this plan: quark-ptq-eval resume --workdir {shlex.quote(str(args.workdir))} "
                "--execution-mode interactive_execute (it asks before running anything)")
    return code
