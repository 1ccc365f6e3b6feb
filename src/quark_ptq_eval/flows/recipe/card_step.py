"""The recipe's last step: the export's model card, written after validation and evaluation from
their artifacts, so it carries what the run proved (``publish/``)."""

from __future__ import annotations

from quark_ptq_eval.flows.recipe.recipe_flow import Flow


def card_step(flow: Flow) -> str | None:
    """The card's path, or None with ``--card none`` (the export then carries no README.md)."""
    from quark_ptq_eval.publish import write_card

    run = flow.run
    if flow.opts.card == "none":
        run.state.record_step("card", "none")
        run.ui.info("No model card (--card none).")
        return None
    path = write_card(run.workdir, flow.output(), base_model=flow.opts.base_model)
    run.state.record_step("card", "written", artifact=str(path))
    run.ui.info(f"Model card: {path}")
    return str(path)
