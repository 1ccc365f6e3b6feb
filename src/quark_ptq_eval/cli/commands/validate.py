"""`quark-ptq-eval validate --source SRC --quantized OUT`: Phase 2, the export's structural validation."""

from __future__ import annotations

import argparse

from quark_ptq_eval.cli.args import add_run_control, approver


def add_arguments(p: argparse.ArgumentParser) -> None:
    from quark_ptq_eval.validate import add_validate_arguments

    add_validate_arguments(p)
    add_run_control(p)


def run(args: argparse.Namespace) -> int:
    from quark_ptq_eval.validate import cmd_validate

    return cmd_validate(args, approver(args))
