"""`evaluate()`: pilot -> estimate -> (ask again when long) -> run the tier -> compare -> report."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import PlanJson
from quark_ptq_eval.base.calibration_text import OPTIMISTIC, CalibrationOverlap
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.gates import Approver, Gatekeeper, as_gatekeeper
from quark_ptq_eval.evaluate import report as report_files
from quark_ptq_eval.evaluate.context import (
    RuntimeEstimate,
    TierInputs,
    TierOutcome,
    format_duration,
    log,
    tier_runner,
)
from quark_ptq_eval.evaluate.eval_report import EvalReport
from quark_ptq_eval.evaluate.options import BASELINE_FROM_SOURCE, EvalOptions
from quark_ptq_eval.evaluate.reference import align_scale, merge_references, model_card_reference
from quark_ptq_eval.evaluate.remedies import block_remedies, suggest_remedies, validation_evidence
from quark_ptq_eval.evaluate.scan_followup import sensitivity_followup
from quark_ptq_eval.evaluate.tiers import TIERS, get_tier
from quark_ptq_eval.evaluate.verdict import TierEvidence, compare_all, overall_verdict


def evaluate(
    model_dir: Path,
    options: EvalOptions,
    workdir: Path,
    approver: Approver | Gatekeeper,
    *,
    source_model: Path | None = None,
    plan: PlanJson | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> EvalReport:
    """Run ``options.tier`` on ``model_dir``; write eval_report.md, eval_results.json and a chart to ``workdir``."""
    started = time.perf_counter()  # the tier's approval: the span the estimate and the actual time cover
    model_dir, workdir = Path(model_dir), Path(workdir)
    options = _resolve_baseline(options, source_model)
    tier = get_tier(options.tier)
    if tier.runner is not None and not (model_dir / "config.json").is_file():
        raise UsageError(f"{model_dir} has no config.json: give the quantized model's output directory.")
    workdir.mkdir(parents=True, exist_ok=True)
    plan_read = PlanJson(**plan) if plan is not None else None  # a copy: the tiers only read it
    ctx = TierInputs(model_dir, options, workdir, approver, source_model, plan_read, progress=progress,
                      started=started)
    estimate, outcome, timed_from = None, TierOutcome(quantized={}, notes=["Evaluation skipped."]), None
    overlap = None
    if tier.runner is not None:
        runner = tier_runner(tier)
        prepared = runner.prepare(ctx)
        estimate = prepared.estimate
        estimate.elapsed_s = time.perf_counter() - started  # loading and the pilot are part of the span
        ctx.log(estimate.summary())
        overlap = calibration_overlap(ctx)  # said at the checkpoint, before the tier runs
        asked = time.perf_counter()
        _confirm_if_long(estimate, tier.name, approver)
        timed_from = started + (time.perf_counter() - asked)  # a person's answer is not the evaluation's time
        outcome = runner.score(prepared)
    report = build_report(ctx, outcome, estimate, None)
    if overlap is not None:
        report.details["calibration_overlap"] = overlap.to_dict()
        report.verdict_qualifier = OPTIMISTIC
        report.notes.append(f"Scored on calibration text: {overlap.text}; perplexity and KL measured on the "
                            "text the scales were fitted to are optimistic. Evaluate on held-out text.")
    report_files.write_all(report, timed_from=timed_from)
    ctx.log(f"{report.one_line()}; report: {report.report_path}")
    return report


def estimate_runtime(
    model_dir: Path, options: EvalOptions, *, source_model: Path | None = None
) -> RuntimeEstimate:
    """Load the model(s) and time a pilot on the real data: the estimate shown at the eval checkpoint."""
    import tempfile

    options = _resolve_baseline(options, source_model)
    tier = get_tier(options.tier)
    if tier.runner is None:
        return RuntimeEstimate(tier.name, 0.0, "-", 0, "none", "skipped: nothing runs")
    with tempfile.TemporaryDirectory(prefix="qpe-estimate-") as scratch:
        ctx = TierInputs(Path(model_dir), options, Path(scratch), None, source_model, None)
        estimate: RuntimeEstimate = tier_runner(tier).prepare(ctx).estimate
        estimate.elapsed_s = time.perf_counter() - ctx.started  # the same span evaluate() announces
        return estimate


def calibration_overlap(ctx: TierInputs) -> CalibrationOverlap | None:
    """Tier 1 text that overlaps the plan's calibration text (calibration_text.OVERLAP_RULE), said now."""
    from quark_ptq_eval.base.calibration_text import overlap
    from quark_ptq_eval.base.plan_records import PlannedCalibration
    from quark_ptq_eval.base.textdata import split_plain_text
    from quark_ptq_eval.evaluate.context import text_scorer

    options = ctx.options
    if not get_tier(options.tier).scores_text or options.eval_data is None or not ctx.plan:
        return None
    docs = text_scorer().eval_texts(options.eval_data, options.eval_text_limit)
    if Path(options.eval_data).suffix == ".txt":
        docs = split_plain_text("\n".join(docs))
    found = overlap(PlannedCalibration.from_dict(ctx.plan.get("calibration") or {}), Path(options.eval_data), docs)
    if found is not None:
        ctx.log(f"warning: {found.text}: the verdict will be {OPTIMISTIC}; give held-out --eval-data for an "
                "unbiased one")
    return found


def _resolve_baseline(options: EvalOptions, source_model: Path | None) -> EvalOptions:
    if options.baseline != BASELINE_FROM_SOURCE:
        return options
    if source_model is None:
        raise UsageError("--baseline without a path needs the source model; give --baseline SRC.")
    return dataclasses.replace(options, baseline=Path(source_model))


def _confirm_if_long(estimate: RuntimeEstimate, tier: str, approver: Approver | Gatekeeper) -> None:
    if not estimate.long:
        return
    t = get_tier(tier)
    hours = f" Tier {t.number} {t.cost}." if "hours" in t.cost else ""  # warn where the registry says so
    summary = f"{estimate.summary()}\nThis run is long (over {format_duration(estimate.threshold_s)}).{hours}"
    log(summary)
    advice = (f"(or --yes) to accept about {format_duration(estimate.seconds or 0)}, "
              "or lower --limit / use --eval-data with less text.")
    as_gatekeeper(approver).require("eval", estimate.as_dict(), summary, advice)


def build_report(ctx: TierInputs, outcome: TierOutcome, estimate: RuntimeEstimate | None,
                 actual: float | None) -> EvalReport:
    """A tier's outcome as the evaluation's report: reference merged, verdicts, remedies. Public for
    callers that score a model themselves (compare scores against a cached baseline) and want the
    same verdicts and files as `evaluate`."""
    options = ctx.options
    card_dir = ctx.source_model or options.baseline or ctx.model_dir
    reference = merge_references(model_card_reference(card_dir), options.reference)
    notes = list(outcome.notes) + align_scale(reference, outcome.quantized)
    comparisons = compare_all(
        outcome.quantized,
        outcome.baseline,
        reference,
        outcome.directions,
        options.thresholds,
        TierEvidence(outcome.informational, outcome.details.noise_evidence(), outcome.details.required_evidence()),
    )
    verdict = overall_verdict(comparisons)
    details = outcome.details.as_dict()  # the report holds them as eval_results.json writes them
    remedies = []
    if verdict in ("hurt", "watch"):  # what validation measured per module first: the evidence behind the verdict
        remedies = (validation_evidence(ctx.workdir)[1:] + block_remedies(details.get("per_block"))
                    + suggest_remedies(ctx.plan, _num_layers(ctx.model_dir)))
    return EvalReport(
        tier=options.tier,
        model_dir=ctx.model_dir,
        workdir=ctx.workdir,
        source_model=ctx.source_model,
        settings=_settings(options),
        thresholds=options.thresholds,
        quantized=outcome.quantized,
        baseline=outcome.baseline,
        reference=reference,
        comparisons=comparisons,
        verdict=verdict,
        remedies=remedies,
        estimate=estimate,
        actual_s=actual,
        details=details,
        deferred_commands=outcome.deferred_commands,
        notes=notes,
        artifacts=outcome.artifacts,
        sensitivity=sensitivity_followup(ctx.workdir, ctx.model_dir, details, ctx.plan),
    )


def _settings(options: EvalOptions) -> dict[str, Any]:
    keep = (
        "tier",
        "eval_data",
        "seq_len",
        "batch_size",
        "device",
        "baseline",
        "tasks",
        "num_fewshot",
        "limit",
        "include_path",
        "max_gen_toks",
        "max_windows",
        "eval_text_limit",
    )
    values = {k: getattr(options, k) for k in keep}
    values["eval_data"] = str(options.eval_data) if options.eval_data else "wikitext-2-raw-v1 test"
    values["healthy_pct"], values["hurt_pct"] = options.thresholds.healthy_pct, options.thresholds.hurt_pct
    values.update(options.tier_options)  # a tier's own options, as given (none: nothing added)
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in values.items() if v not in (None, [], "")}


def _num_layers(model_dir: Path) -> int | None:
    from quark_ptq_eval.runtime.loading import read_config_or_raise

    try:
        return read_config_or_raise(model_dir).get("num_hidden_layers")
    except UsageError:
        return None


__all__ = ["EvalOptions", "EvalReport", "TIERS", "build_report", "evaluate", "estimate_runtime"]
