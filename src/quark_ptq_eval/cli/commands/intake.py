"""`quark-ptq-eval intake MODEL`: Phase 1 step 1, the model's analysis (config and headers only)."""

from __future__ import annotations

import argparse

from quark_ptq_eval.cli.args import add_model_and_output, add_run_control
from quark_ptq_eval.cli.recipe import recipe_command as run


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_and_output(p, model_required=True)
    add_run_control(p)


__all__ = ["add_arguments", "run"]
