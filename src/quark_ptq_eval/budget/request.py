"""What a budget search is asked to mix, and what it refuses before anything is measured (exit 2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from quark_ptq_eval.base.artifacts import QuantPlan
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.budget.ask import budget_ask, default_formats
from quark_ptq_eval.plan.groups import ROUTED
from quark_ptq_eval.plan.request import PlanRequest


def budget_request(req: PlanRequest) -> PlanRequest:
    """The request the first plan is made from: a budget without --scheme plans the first format given, or the
    recommendation (the search then replaces it with its mix)."""
    if req.scheme or budget_ask(req) is None or not req.formats:
        return req
    return dataclasses.replace(req, scheme=parse_formats(req.formats)[0])


def check_request(req: PlanRequest, plan: QuantPlan) -> list[str]:
    """The formats to mix, after refusing what the search cannot do (before anything loads)."""
    from quark_ptq_eval.base.catalog import load_catalog

    if req.layer_quant_config or req.sensitivity:
        raise UsageError("The budget search chooses every layer's format itself; it cannot be combined with "
                         "--layer-quant-scheme or --sensitivity.", "Drop those, or plan without a budget.")
    if not (Path(plan.model["model_path"]) / "config.json").exists():
        raise UsageError(f"The budget search needs a local model directory; {plan.model['model_path']} is not one.",
                         "Download the model first, or plan without a budget.")
    known = list(load_catalog()["schemes"])
    if req.formats:
        formats = parse_formats(req.formats)
    elif len(formats := default_formats(plan.target.get("arch"), known)) < 2:
        raise UsageError(f"{plan.target.get('label') or 'This target'} has no native formats to mix by default.",
                         "Name them with --formats, e.g. --formats int4_wo_128,fp8.")
    if unknown := [f for f in formats if f not in known]:
        raise UsageError(f"This Quark does not support the format(s) {', '.join(unknown)}.",
                         f"Supported: {', '.join(known)}.")
    return formats


def parse_formats(text: str) -> list[str]:
    formats = list(dict.fromkeys(f.strip() for f in text.split(",") if f.strip()))
    if len(formats) < 2:
        raise UsageError(f"--formats needs at least two formats to mix; got {formats}.",
                         "Pass them comma-separated, e.g. --formats int4_wo_32,int8.")
    return formats


def experts_refused(plan: QuantPlan, formats: list[str], shapes: dict[str, tuple[int, int]]) -> dict[str, str]:
    """The formats the search may not give an MoE layer's routed experts, each with why: those the target's vLLM
    does not load for experts (plan/targets.py ``expert_refusal``, the one rule). A model without routed experts,
    or an unknown target: none. Refused (exit 2) when no format given is left for the experts."""
    from quark_ptq_eval.plan.targets import FAMILIES, expert_refusal, keep_experts_unquantized

    if not any(ROUTED.match(n) for n in shapes):
        return {}
    family = FAMILIES.get(plan.target.get("arch") or "")
    refused = {f: why for f in formats if (why := expert_refusal(f, family))}
    if len(refused) == len(formats):
        where = plan.target.get("label") or "this target"
        fix = (f"Add a format its MoE kernels serve to --formats (e.g. {family.moe[0]}), keep the experts "
               "unquantized" if family and family.moe else "Keep the experts unquantized")
        keep = keep_experts_unquantized(list(plan.exclude_layers))
        raise UsageError(f"None of {', '.join(formats)} is served for this MoE's routed experts on {where}: "
                         f"{refused[formats[0]]}.", f"{fix} ({keep}: the search then mixes the other linears), "
                         "or name another --target.")
    return refused


def experts_line(refused: dict[str, str]) -> str:
    """The one line the plan and the report give a format the experts may not take ('' when none)."""
    return "; ".join(f"routed experts never in {f}: {why}" for f, why in refused.items())
