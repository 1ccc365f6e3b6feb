"""Phase 1, step 2 — plan: ``quant_plan.json``, a recommendation with a reason for every decision."""

from quark_ptq_eval.plan.recommend import make_plan
from quark_ptq_eval.plan.request import PlanRequest

__all__ = ["PlanRequest", "make_plan"]
