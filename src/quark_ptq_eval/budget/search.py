"""`--budget-bits B --formats a,b`: the best per-group mix of formats within an effective-bits budget.

Like ``--sensitivity``, giving the flag is the user's yes to read the model and measure now. Per
format, the sensitivity scan (sensitivity/scan.py, its cache reused) measures every unit's KL with
that unit alone quantized: one calibration per format, then replay. The units and vLLM's fused
groups (plan/groups.py) are merged into search groups (groups.py), each group's KL per format is the sum of its
units' (the additivity assumption, checked in the report against each format's whole-model KL),
its bytes per format come from the linears' shapes and Quark's scheme table (knapsack.py), and
the exact program picks one format per group. The plan is then made again with the mix as its
global scheme (the format holding most weights) and ``layer_quant_config`` for the rest, so every
check the plan step makes holds for the mix as for a uniform plan. ``search_report.{json,md,png}`` in
the work dir has the chosen mix, the predicted front (bits against predicted KL) and the cost (report.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from quark_ptq_eval.base.artifacts import Decision, QuantPlan
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.budget.ask import BudgetAsk, budget_ask
from quark_ptq_eval.budget.cost import check_reachable, scale_bytes, size_bits
from quark_ptq_eval.budget.groups import mix_config, search_groups, side_plans
from quark_ptq_eval.budget.knapsack import GroupCost, Mix, bits_range, front, solve_floor, solve_with_bound
from quark_ptq_eval.budget.report import SearchFacts, quark_planner_note, write_search_report
from quark_ptq_eval.budget.request import check_request, experts_line, experts_refused
from quark_ptq_eval.plan.request import PlanRequest
from quark_ptq_eval.plan.scheme_fit import linear_shapes
from quark_ptq_eval.sensitivity.scan import ScanResult

# The plan's calibration text, the scans' input: (plan, work dir) -> a local text file (flows/recipe/plan_scan.py's)
CalibrationText = Callable[[QuantPlan, Path], str]


def with_budget_search(plan: QuantPlan, req: PlanRequest, workdir: Path, replan: Callable[[PlanRequest], QuantPlan],
                       calibration: CalibrationText) -> QuantPlan:
    """``plan`` remade with the searched mix when the request asks for a budget (ask.py), else as it is."""
    ask = budget_ask(req)
    if ask is None:
        return plan
    formats = check_request(req, plan)
    model_path = plan.model["model_path"]
    shapes = linear_shapes(model_path, list(plan.exclude_layers))
    refused = experts_refused(plan, formats, shapes)
    float_bytes = scale_bytes(model_path)
    bits = ask.bits if ask.size_bytes is None else size_bits(ask, model_path, shapes, float_bytes)
    if bits is not None:
        check_reachable(bits, ask, formats, shapes, float_bytes, refused)  # before any scan runs
    text = Path(calibration(plan, workdir))
    scans = {f: _scan(plan, f, text) for f in formats}
    groups, members = search_groups(shapes, scans, formats, float_bytes, refused)
    mix = _solve(ask, bits, groups, formats)
    scheme, overrides = mix_config(mix, groups, members, list(shapes))
    new = replan(dataclasses.replace(req, scheme=scheme, layer_quant_config=overrides, budget_bits=None,
                                     budget_size=None, max_kl=None, max_ppl_increase_pct=None))
    if (row := new.decision("global_scheme")) is not None:
        row.reason = "the budget search's format holding most of the weights (see the budget search row)"
    if (row := new.decision("layer_quant_config")) is not None:
        row.reason = f"the budget search's mix: {len(overrides)} pattern(s) in the other format(s)"
    sides = side_plans(mix, groups, members, list(shapes), formats)
    quark = quark_planner_note(str(plan.model.get("model_type")), formats, mix.bits)
    report = write_search_report(workdir, SearchFacts(formats, mix, front(groups, formats), scans, scheme, overrides,
                                                      sides, ask.given, quark, refused))
    new.decisions.append(Decision("budget_search", overrides, _reason(mix, formats, scheme, ask, refused), extra={
        "budget": ask.given, "budget_bits": bits, "max_kl": ask.max_kl, "budget_size_bytes": ask.size_bytes,
        "effective_bits": round(mix.bits, 4), "predicted_kl": mix.predicted_kl, "lp_bound": mix.lp_bound,
        "groups_per_format": mix.counts, "report": str(report), "experts_not_in": refused}))
    return new


def _solve(ask: BudgetAsk, bits: float | None, groups: list[GroupCost], formats: list[str]) -> Mix:
    """The exact optimum for the ask: least predicted KL within the bits, or fewest bits within the floor."""
    if bits is None:
        assert ask.max_kl is not None  # a floor
        mix = solve_floor(groups, formats, ask.max_kl)
        if mix.status != "optimal":
            best = sum(min(g.kl[f] for f in formats if g.allows(f)) for g in groups)
            raise UsageError(f"No mix of {', '.join(formats)} keeps the predicted KL within {ask.max_kl:.4g} "
                             f"({ask.given}): the most accurate mix predicts {best:.4g}.",
                             "Relax the floor, or add a wider format to --formats.")
        return mix
    mix = solve_with_bound(groups, formats, bits)
    if mix.status != "optimal":  # the groups' formats are tied together: their narrowest may exceed the bound
        lo, _ = bits_range(groups, formats)
        raise UsageError(f"No mix of {', '.join(formats)} fits {bits:g} effective bits ({ask.given}): the narrowest "
                         f"takes {lo:.3f}.", "Raise the budget, or add a narrower format to --formats.")
    return mix


def _scan(plan: QuantPlan, scheme: str, text: Path) -> ScanResult:
    """The scan of the plan's model under ``scheme`` on the calibration ``text`` (cached when it was measured before)."""
    from quark_ptq_eval.sensitivity.emulation import check_scheme_runs
    from quark_ptq_eval.sensitivity.scan import ScanOptions, scan_result

    opts = ScanOptions(model_dir=Path(plan.model["model_path"]), scheme=scheme, calib_data=text,
                       exclude=list(plan.exclude_layers), device=plan.device_strategy.device,
                       trust_remote_code=plan.trust_remote_code)
    check_scheme_runs(opts.model_dir, scheme, opts.exclude, None)  # before anything loads
    return scan_result(opts, lambda line: print(f"[{scheme}] {line}", flush=True))


def _reason(mix: Mix, formats: list[str], scheme: str, ask: BudgetAsk, refused: dict[str, str]) -> str:
    counts = ", ".join(f"{n} group(s) {f}" for f, n in mix.counts.items() if n)
    aim = "the fewest bits within the floor" if ask.is_floor else f"the least predicted KL within {mix.budget_bits:.3f} bits"
    bound = f", LP bound {mix.lp_bound:.4g}" if mix.lp_bound is not None else ""
    return (f"{ask.given} over {', '.join(formats)}: the exact optimum ({aim}; MILP{bound}) predicts KL "
            f"{mix.predicted_kl:.4g} at {mix.bits:.3f} effective bits: {counts}; {scheme} globally, the rest in "
            "layer_quant_config (predicted as the sum of each group's KL alone)"
            + (f"; {experts_line(refused)}" if refused else ""))
