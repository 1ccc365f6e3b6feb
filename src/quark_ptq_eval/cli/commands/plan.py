"""`quark-ptq-eval plan [MODEL]`: Phase 1 step 2, the plan (quant_plan.json)."""

from __future__ import annotations

from quark_ptq_eval.cli.recipe import add_step_arguments as add_arguments
from quark_ptq_eval.cli.recipe import recipe_command as run

__all__ = ["add_arguments", "run"]
