"""`quark-ptq-eval execute [MODEL]`: Phase 1 step 4, the approved command run and its output verified."""

from __future__ import annotations

from quark_ptq_eval.cli.recipe import add_step_arguments as add_arguments
from quark_ptq_eval.cli.recipe import recipe_command as run

__all__ = ["add_arguments", "run"]
