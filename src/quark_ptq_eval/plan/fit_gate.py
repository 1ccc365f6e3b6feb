"""The plan checkpoint's rule for a plan this host cannot hold: it stops the run unless the plan is
approved by name, by a person who saw the table, or nothing runs (plan_only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quark_ptq_eval.base.artifacts import QuantPlan
    from quark_ptq_eval.base.gates import Approver


def unfit_message(plan: QuantPlan) -> str | None:
    """One sentence for the plan checkpoint when this host cannot hold the plan (None when it can)."""
    res = getattr(plan, "resources", None) or {}
    blocking = [p["message"] for p in res.get("problems", []) if p.get("blocking")]
    if not blocking:
        return None
    return "This host cannot hold this plan: " + "; ".join(blocking) + "."


def hold_message(plan: QuantPlan, execution_mode: str, approver: Approver, already_approved: bool) -> str | None:
    """Why a run must stop at the plan checkpoint before anything runs, or None.

    A plan this host cannot hold is not approved by --yes: only by name (``--approve plan``), by a
    person at the terminal who saw the table, or in plan_only mode (nothing runs there)."""
    from quark_ptq_eval.base.calibration_text import short_message

    unfit = unfit_message(plan) or short_message(plan.calibration)  # less calibration text than planned, too
    if unfit is None or execution_mode == "plan_only" or already_approved:
        return None
    if approver.weighs("plan"):  # named, or someone who sees the table answers
        return None
    return (f"{unfit} Change the plan as its table proposes, or approve it by name (--approve plan) "
            "to run it anyway")

