"""`quark-ptq-eval resume`: continue the run in --workdir from where it stopped."""

from __future__ import annotations

import argparse

from quark_ptq_eval.cli.recipe import add_recipe_arguments
from quark_ptq_eval.cli.recipe import recipe_command as run


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_arguments(p, model_required=False)


__all__ = ["add_arguments", "run"]
