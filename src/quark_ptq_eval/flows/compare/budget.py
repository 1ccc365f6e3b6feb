"""`compare MODEL --budget-bits B` (or `--budget-size SIZE`, with `--formats`): a comparison of the budget search's
plans instead of named schemes.

The search runs once, in ``ROOT/search`` (budget/search.py: one scan per format, cached; the exact program);
the plans its report names side by side (the search's mix, each uniform format within the budget, the naive mix,
the search at the naive mix's bits) become the compared cells, each quantized, validated and scored by Tier 1
against the one cached baseline, as `run --budget-bits` measures them after its own run. search_report.{md,json} in
``ROOT/search`` then has predicted beside measured KL for each and the recommendation within the budget (the
measured best); comparison.json carries it as ``budget_search``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import ModelAnalysis, QuantPlan
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.budget.measured import CellRow, read_side_plans, record_measured
from quark_ptq_eval.flows.compare.options import CompareOptions, MixCell, budget_asked

SEARCH_DIR = "search"


def searched_cells(root: Path, opts: CompareOptions) -> CompareOptions:
    """``opts`` with the search's plans as its cells when it asks for a budget (searched once: a resumed comparison
    keeps its cells), else as they are."""
    if not budget_asked(opts):
        return opts
    if opts.schemes and not opts.cells:
        raise UsageError("compare takes --schemes or a budget (--budget-bits, --budget-size), not both.",
                         "Drop --schemes: the budget search chooses the plans to compare.")
    if opts.cells:
        return opts
    if not opts.model or not Path(opts.model).is_dir():
        raise UsageError("compare --budget-bits needs the model as a local directory.",
                         "Download it first and pass the local directory.")
    wd = root / SEARCH_DIR
    _search(wd, opts)
    sides = read_side_plans(wd)
    return dataclasses.replace(opts, schemes=[s.label for s in sides],
                               cells={s.label: MixCell(s.scheme, dict(s.overrides)) for s in sides})


def _search(wd: Path, opts: CompareOptions) -> QuantPlan:
    """The budget search's plan of the model, in ``wd`` (its scans and search_report)."""
    from quark_ptq_eval.base.catalog import load_catalog
    from quark_ptq_eval.context.preflight import detect_env
    from quark_ptq_eval.flows.recipe.plan_scan import plan_from_request
    from quark_ptq_eval.intake import analyze_model
    from quark_ptq_eval.plan import PlanRequest, make_plan

    assert opts.model is not None  # searched_cells checked it
    wd.mkdir(parents=True, exist_ok=True)
    catalog = load_catalog()
    analysis = analyze_model(opts.model, offline=bool(opts.offline), catalog=catalog,
                             trust_remote_code=bool(opts.plan.get("trust_remote_code")))
    analysis.write(wd)
    req = PlanRequest(**opts.plan, offline=bool(opts.offline))
    env = detect_env()

    def replan(r: PlanRequest) -> QuantPlan:
        return make_plan(analysis, env, r, catalog, ModelAnalysis.path_in(wd).resolve(), (wd / "plan-output").resolve())

    plan = plan_from_request(req, replan, wd.resolve())  # compare takes no --sensitivity: the search alone
    plan.write(wd)
    return plan


def report_measured(root: Path, opts: CompareOptions, doc: dict[str, Any]) -> None:
    """search_report gets the comparison's measurements; ``doc`` (comparison.json's content) its recommendation."""
    if not budget_asked(opts) or opts.model is None:
        return
    wd = root / SEARCH_DIR
    excluded = list(QuantPlan.load(wd).exclude_layers)
    cells = {r["scheme"]: CellRow.of(r) for r in doc.get("schemes") or []}
    best = record_measured(wd, cells, Path(opts.model), excluded).recommendation
    doc["budget_search"] = {"report": str(wd / "search_report.md"),
                            "recommendation": None if best is None else dataclasses.asdict(best)}
