"""`quark-ptq-eval run MODEL`: the whole recipe (quantize -> validate -> evaluate), stopping at each gate."""

from __future__ import annotations

import argparse

from quark_ptq_eval.cli.recipe import add_recipe_arguments
from quark_ptq_eval.cli.recipe import recipe_command as run


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_arguments(p, model_required=True)


def parse(argv: list[str]) -> argparse.Namespace:
    """``argv`` as `quark-ptq-eval run ARGV` parses it (import-command's translated line)."""
    p = argparse.ArgumentParser(prog="quark-ptq-eval run")
    add_arguments(p)
    p.set_defaults(command="run")
    return p.parse_args(argv)


__all__ = ["add_arguments", "parse", "run"]
