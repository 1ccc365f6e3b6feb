"""`quark-ptq-eval eval --quantized OUT --tier T`: Phase 3, one evaluation tier on its own."""

from __future__ import annotations

import argparse

from quark_ptq_eval.cli.args import add_run_control, approver


def add_arguments(p: argparse.ArgumentParser) -> None:
    from quark_ptq_eval.evaluate import add_eval_arguments

    add_eval_arguments(p, standalone=True)
    add_run_control(p)


def run(args: argparse.Namespace) -> int:
    from quark_ptq_eval.evaluate import cmd_eval

    return cmd_eval(args, approver(args))
