"""Phases 2 and 3 of the recipe: validate the export against its source (with the safe fixes, on
approval), then evaluate it at the tier chosen at the evaluation checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import PlanJson, QuantPlan
from quark_ptq_eval.base.gates import GATES
from quark_ptq_eval.evaluate.api import evaluate
from quark_ptq_eval.evaluate.eval_report import EvalReport
from quark_ptq_eval.evaluate.options import BASELINE_FROM_SOURCE
from quark_ptq_eval.evaluate.ppl.text import TIER1_NO_TEXT, ask_tier1_text
from quark_ptq_eval.evaluate.remedies import validation_evidence
from quark_ptq_eval.evaluate.tiers import TIERS, runs, scores_text, text_tier, tier_checkpoint
from quark_ptq_eval.flows.recipe.recipe_flow import Flow
from quark_ptq_eval.plan.source_reading import effective_source
from quark_ptq_eval.validate import ValidationReport, fix_and_revalidate, validate_model
from quark_ptq_eval.validate.load_sample import load_budget_s

SKIPPED = "skipped"  # what the evaluation step produced when no tier runs


def validate_step(flow: Flow, plan: QuantPlan) -> ValidationReport:
    """validation_report.md/.json: the export against its source (an FP8 / .bin source through its
    staged copy); a failure with a safe fix asks the fix gate, fixes and checks again, once."""
    run = flow.run
    plan_json = flow.plan_json(plan)
    source = effective_source(plan, flow.model_path)

    def announce(fixes: str) -> None:  # the failing report stays readable while the fix gate waits
        report.write(run.workdir)
        run.ui.info(f"Validation found problems with a safe fix:\n{fixes}")

    if not flow.opts.no_load_check:  # it loads models: their libraries' import timed as the cold start it is
        from quark_ptq_eval.base.quark_import import import_torch_stack

        import_torch_stack()
    report = _checked(flow, source, plan_json)
    report = fix_and_revalidate(report, run.gates, lambda: _checked(flow, source, plan_json), announce)
    from quark_ptq_eval.base.calibration_text import describe_used

    report.calibration = describe_used(plan)
    report.write(run.workdir)
    run.ui.info(report.one_line())
    run.state.record_step("validate", report.status, report=str(run.workdir / "validation_report.md"))
    report.raise_for_status()
    return report


def _checked(flow: Flow, source: Path | None, plan_json: PlanJson) -> ValidationReport:
    """One validation pass, its checks shown as progress; the serving check uses the run's vLLM
    and server arguments, as Tier 3 does."""
    from quark_ptq_eval.validate.checks import CHECKS

    ui = flow.run.ui

    def progress(check: str, done: int, total: int) -> None:  # checks done, or one check's bytes compared
        ui.progress("validation checks" if total == len(CHECKS) else f"{check}: bytes compared", done, total)

    try:
        return validate_model(source, flow.output(), plan_json, load_check=not flow.opts.no_load_check,
                              load_budget_s=load_budget_s(flow.opts.load_check_minutes),
                              progress=progress, vllm_python=flow.opts.eval.vllm_python,
                              vllm_args=tuple(flow.opts.eval.vllm_args))
    finally:
        ui.end_progress()


def warm_validation_s(flow: Flow, plan: QuantPlan, run_checks: dict[str, Any]) -> float:
    """Seconds one more validation of this run's export takes in this process, now warm (its libraries imported and
    first used): what each remedy's validation costs beside it (flows/recipe/remedies_side.py). Nothing is written.
    No serving check: it starts a vLLM process of its own each time, so what it took in the run (``run_checks``,
    validation_report.json's checks) is added, as is any check this pass skips and the run did not."""
    import time

    started = time.monotonic()
    again = validate_model(effective_source(plan, flow.model_path), flow.output(), flow.plan_json(plan),
                           load_check=not flow.opts.no_load_check,
                           load_budget_s=load_budget_s(flow.opts.load_check_minutes))
    took = time.monotonic() - started
    skipped_now = {c.name for c in again.checks if c.skipped_reason}
    return took + sum(float((run_checks.get(name) or {}).get("seconds") or 0.0) for name in skipped_now)


def eval_step(flow: Flow, plan: QuantPlan) -> EvalReport | str:
    """eval_report.md / eval_results.json at the chosen tier, or ``SKIPPED``. Tier 1's baseline is
    the source as validation compared it (the staged BF16 copy of an FP8 release)."""
    run, plan_json = flow.run, flow.plan_json(plan)
    source = effective_source(plan, flow.model_path)
    if run.evaluator is not None:
        report = run.evaluator(flow.output(), source, PlanJson(**plan_json))
        run.state.record_step("eval", "done", tier=report.tier, report=str(report.report_path))
        return report
    _heldout_default(flow, plan)
    tier = flow.opts.eval_tier or _ask_tier(flow)
    run.gates.chosen("eval", tier)
    if not runs(tier):
        run.state.record_step("eval", SKIPPED)
        run.ui.info("Evaluation skipped.")
        return SKIPPED
    _say_heldout(flow, tier, plan)
    flow.refuse_without_tier1_text(tier)  # a calibration text too small to hold a part out
    options = dataclasses.replace(flow.opts.eval, tier=tier)
    try:
        report = evaluate(flow.output(), options, run.workdir, run.gates, source_model=source, plan=plan_json,
                          progress=run.ui.progress)
    finally:
        run.ui.end_progress()
    run.state.record_step("eval", "done", tier=tier, report=str(run.workdir / "eval_report.md"))
    if scores_text(tier) and run.after_eval is not None:  # a budget search's plans, measured on the same windows
        run.after_eval(flow, plan)
    return report


def _heldout_default(flow: Flow, plan: QuantPlan) -> None:
    """One text given: Tier 1 scores the part of it the plan held out from calibration."""
    split = plan.calibration.split
    tier = flow.opts.eval_tier
    if split and not flow.opts.eval.eval_data and (tier is None or scores_text(tier)):
        _set_eval(flow, eval_data=Path(split.heldout_path))


def _say_heldout(flow: Flow, tier: str, plan: QuantPlan) -> None:
    split = plan.calibration.split
    if scores_text(tier) and split and flow.opts.eval.eval_data == Path(split.heldout_path):
        flow.run.ui.info(f"Tier 1 text: the held-out part of your calibration text ({split.heldout_documents} of "
                         f"{split.documents} documents, {split.rule}), which calibration never saw.")


def _ask_tier(flow: Flow) -> str:
    """The evaluation checkpoint: pick a tier (or stop until one is given), then opt in to the
    baseline or not."""
    gates = flow.run.gates
    for line in validation_evidence(flow.run.workdir):  # the load check's per-module evidence for Phase 3
        flow.run.ui.info(line)
    if gates.can_choose:
        for name, entry in TIERS.items():
            flow.run.ui.info(f"  {name:<8} {entry.method} ({entry.cost})")
    message, flag = tier_checkpoint()
    tier = gates.choose("eval", "Which evaluation tier?", tuple(TIERS), message, flag)
    if flow.tier1_lacks_text(tier):
        _set_eval(flow, eval_data=Path(_tier1_text(flow)))  # ask now, before the baseline question
    wanted = runs(tier) and flow.opts.eval.baseline is None
    if wanted and gates.opt_in("baseline", {"tier": tier, "model": flow.opts.model}, GATES["baseline"].reason):
        _set_eval(flow, baseline=BASELINE_FROM_SOURCE)
    return tier


def _tier1_text(flow: Flow) -> str:
    answer = ask_tier1_text(flow.run.gates, flow.opts.request.calib_data)
    if answer is None:
        flow.run.gates.stop("eval", f"Stopped at the evaluation checkpoint: {TIER1_NO_TEXT}",
                            f"--eval-tier {text_tier().name} --eval-data FILE")
    assert answer is not None  # stop() raised
    return answer


def _set_eval(flow: Flow, **changes: Any) -> None:
    """This run's evaluation options, changed at the checkpoint (run_state.json keeps what was given)."""
    flow.opts = dataclasses.replace(flow.opts, eval=dataclasses.replace(flow.opts.eval, **changes))
