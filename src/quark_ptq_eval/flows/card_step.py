"""The recipe's last step: the export's model card, written after validation and evaluation from
their artifacts, so it carries what the run proved (``publish/``). A ``Recipe`` method by assignment."""

from __future__ import annotations

from typing import Any


def step_card(recipe: Any, flow: Any) -> str | None:  # (pipeline.Recipe, pipeline.Flow): no import cycle
    """The card's path, or None with ``--card none`` (the export then carries no README.md)."""
    from quark_ptq_eval.publish import write_card

    if flow.opts.card == "none":
        recipe.state.record_step("card", "none")
        recipe.ui.info("No model card (--card none).")
        return None
    path = write_card(recipe.workdir, flow.output())
    recipe.state.record_step("card", "written", artifact=str(path))
    recipe.ui.info(f"Model card: {path}")
    return str(path)
