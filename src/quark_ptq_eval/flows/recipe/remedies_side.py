"""`run ... --eval-tier ppl --baseline --remedies N`: the verdict's advice measured, not listed.

After the run's own Tier 1 finds the model not healthy, the N most promising remedies for this plan and what
validation found (evaluate/remedy_variants.py: the plan's scaling algorithm removed, the damaged block kept
unquantized, an algorithm added, more calibration, a wider format) become plan variants, each quantized,
validated and scored by a comparison (flows/compare, through budget_side.compare_cells) in
``<workdir>/remedies``: the run's calibration documents and Tier 1 windows, one baseline cached once, as the
budget search's side by side. Each variant is then set beside the run's own export (its Tier 1 on the same
windows), and the table, the cause and the recommendation (the best variant that helped beyond noise; never one
measured worse) go into eval_report.md and eval_results.json (``details.remedies``).

Giving --remedies N is the user's yes to those N quantizations, as --budget-bits is to its side by side.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import QuantPlan
from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.base.fsio import atomic_write_text, read_json, write_json
from quark_ptq_eval.base.process_exit import ready_after_s
from quark_ptq_eval.evaluate.context import format_duration
from quark_ptq_eval.evaluate.remedies import algorithm_names
from quark_ptq_eval.evaluate.remedy_variants import (
    Evidence,
    Judged,
    RemedyRow,
    Scored,
    Variant,
    fmt,
    judge,
    propose,
    shortfall,
    table_markdown,
)
from quark_ptq_eval.flows.compare.options import MixCell
from quark_ptq_eval.flows.recipe.budget_side import compare_cells, measure_side_by_side
from quark_ptq_eval.flows.recipe.recipe_flow import Flow
from quark_ptq_eval.flows.recipe.remedy_cost import (
    ENGINE_LOG,
    VALIDATE,
    Pilot,
    Runtime,
    estimate_s,
    run_cost,
)

REMEDIES_DIR = "remedies"  # under the run's work dir: a comparison's own root
OFFERED = 3  # remedies offered when none were asked for
PROBE_MAX_S = 120.0  # a validation this short is measured again warm for the estimate (_warm_check_s)
SECTION = re.compile(r"\n## Remedies, measured\n.*", re.S)


def after_own_eval(flow: Flow, plan: QuantPlan) -> None:
    """What follows the run's own Tier 1: the budget search's side by side, then the remedies asked for."""
    measure_side_by_side(flow, plan)
    measure_remedies(flow, plan)


def measure_remedies(flow: Flow, plan: QuantPlan) -> Judged | None:
    """The remedies measured and reported (None: none asked for or accepted, the verdict is healthy, or no
    baseline). Not asked for, a verdict that is not healthy gets the offer, with its estimate."""
    count, wd, ui = flow.opts.eval.remedies, flow.run.workdir, flow.run.ui
    results_path = wd / "eval_results.json"
    if flow.model_path is None or not results_path.is_file():
        return None
    results = read_json(results_path, "evaluation results")
    verdict = results.get("verdict")
    if verdict == "healthy" or not (results.get("details") or {}).get("paired"):
        if count:
            ui.info("Remedies: not measured: the verdict is healthy." if verdict == "healthy" else
                    "Remedies: not measured: they are judged against the baseline (Tier 1 with --baseline).")
        return None
    validation_path = wd / "validation_report.json"
    validation = read_json(validation_path, "validation report") if validation_path.is_file() else None
    variants = propose(plan.as_json(), Evidence.of(validation), count or OFFERED, calibration_room(plan),
                       _offered(plan))
    if not variants:
        ui.info("Remedies: none left to measure: the plan already does what they would change.")
        return None
    ran, samples = algorithm_names(plan.algorithm), plan.calibration.num_samples
    cost = run_cost(flow.run.timings, wd, ran, samples, ready_after_s(wd / ENGINE_LOG))
    estimate = estimate_s(flow.run.timings, results, variants, cost, ran, samples, _warm_check_s(flow, plan, validation))
    if not count and not _accepted(flow, len(variants), estimate):
        return None
    ui.info(f"Remedies: measuring {len(variants)} variant(s) of the plan on the same windows, one quantization each "
            f"({', '.join(v.label for v in variants)}){_about(estimate)}")
    cells = {v.label: MixCell(v.scheme, dict(plan.layer_quant_config), v.request) for v in variants}
    root = wd / REMEDIES_DIR
    pilot = Pilot(variants, ran, samples, root, ui.info, cost)
    doc = compare_cells(flow, plan, cells, root, "Remedies", progress=pilot)
    runtime = Runtime(estimate, time.monotonic() - pilot.began, pilot.result())
    measured = {r["scheme"]: Scored.of({**r, "on_target": _served(root / "work" / r["scheme"])})
                for r in (doc or {}).get("schemes") or []}
    from quark_ptq_eval.flows.compare.results import export_row

    original = Scored.of({**export_row(results, flow.output(), flow.model_path),
                          "validation": (validation or {}).get("status"), "on_target": on_target(plan.as_json())})
    judged = judge(original, variants, measured, verdict)
    best = None if judged.recommendation is None else judged.recommendation.variant
    command = None if best is None else reproduce(flow, plan, best)
    card = None if judged.recommendation is None else _card(flow, root, judged, judged.recommendation, verdict)
    details = _details(original, judged, command, root, runtime, card)
    _write(wd, results, details, table_markdown(original, judged, command))
    for row in judged.rows:
        ui.info(f"  {row.variant.label}: {row.variant.changed}: {row.outcome} ({row.outcome_detail})")
    if judged.cause:
        ui.info(f"Remedies: {judged.cause}.")
    ui.info(f"Remedies: recommended {best.label} ({best.changed}): {command}" if best else
            "Remedies: none helped beyond noise; none is recommended.")
    if short := shortfall(judged):
        ui.info(f"Remedies: {short}.")
    ui.info(f"Remedies: {runtime.said()}")
    return judged


def _offered(plan: QuantPlan) -> tuple[str, ...]:
    """The algorithms Quark's template for the plan's model offers (the capability catalog, cached per install)."""
    from quark_ptq_eval.base.catalog import load_catalog

    template = load_catalog()["templates"].get(str(plan.model.get("model_type")))
    return tuple(template.get("algorithms") or ()) if template else ()


def calibration_room(plan: QuantPlan) -> int | None:
    """Samples of the plan's length the engine's calibration text holds, counted as far as a variant could ask
    (None: not a local text, or no tokenizer)."""
    from quark_ptq_eval.base.calibration_text import count_tokens
    from quark_ptq_eval.base.textdata import load_texts
    from quark_ptq_eval.evaluate.remedies import MIN_CALIBRATION

    calibration = plan.calibration
    seq, path = calibration.seq_len, calibration.path
    if calibration.source != "local_file" or seq <= 0 or not path:
        return None
    tokens = count_tokens(load_texts(path), Path(plan.model["model_path"]), MIN_CALIBRATION * seq)
    return None if tokens is None else tokens // seq


def on_target(plan: Mapping[str, Any] | None) -> str | None:
    """How the plan's deployment target serves its global scheme, by the rule the planner warns by
    (plan/targets.py ``runs_natively``, which ``native_warning`` uses: weight-only and the target's native formats run
    natively, any other format is emulated or upcast there), from the target quant_plan.json records; None without a plan."""
    from quark_ptq_eval.plan.targets import runs_natively

    target = (plan or {}).get("target") or {}
    scheme = str((plan or {}).get("global_scheme") or "")
    if not scheme or not target:
        return None
    native = runs_natively(scheme, target.get("native_formats") or [])
    return f"{'native' if native else 'emulated'} on {target.get('label') or 'the target'}"


def _served(workdir: Path) -> str | None:
    """How the deployment target serves a cell's export, by the rule of its own plan (None: no plan written)."""
    try:
        return on_target(read_json(workdir / "quant_plan.json", "plan"))
    except QpeError:
        return None


def _warm_check_s(flow: Flow, plan: QuantPlan, validation: dict[str, Any] | None) -> float | None:
    """A variant's validation, measured: this run's export validated again here, warm (check_steps.warm_validation_s,
    with the run's own serving check: a fresh vLLM each time). Only where the run's validation was short
    (PROBE_MAX_S): there start-up is most of it and the cold figure misleads; a longer one is mostly the work
    itself, which the cold figure holds, and a second pass would cost the user as long again."""
    validate = flow.run.timings.get(VALIDATE)
    if validate is None or validate > PROBE_MAX_S or not validation:
        return None
    from quark_ptq_eval.flows.recipe.check_steps import warm_validation_s

    try:
        return warm_validation_s(flow, plan, validation.get("checks") or {})
    except QpeError:
        return None


def _about(estimate: float | None) -> str:
    return "" if estimate is None else f": about {format_duration(estimate)}"


def _accepted(flow: Flow, count: int, estimate: float | None) -> bool:
    """The offer at the evaluation's end: asked where a person answers, said (with the flag) where none does."""
    offer = (f"measure the {count} most promising remedies{_about(estimate)}, one quantization each, on the same "
             "windows against the same baseline")
    approver = flow.run.approver
    if getattr(approver, "interactive", False) and hasattr(approver, "choose"):
        return bool(approver.choose(f"The verdict is not healthy: {offer}?", ("yes", "no")) == "yes")
    flow.run.ui.info(f"Remedies: the verdict is not healthy: to {offer}, run the same command with --remedies {count}.")
    return False


def reproduce(flow: Flow, plan: QuantPlan, v: Variant) -> str:
    """The `run` command that makes the variant's export: the run's model and calibration, the variant's plan."""
    change = v.request
    algorithm = plan.algorithm if change.algorithm is None else change.algorithm
    excluded = list(plan.exclude_layers if change.exclude_layers is None else change.exclude_layers)
    calib = plan.calibration
    parts = ["quark-ptq-eval", "run", str(flow.model_path), "-o", f"{flow.output()}-{v.label}", "--scheme", v.scheme]
    request = flow.opts.request  # the target and KV cache the variant was measured with (a goal naming a GPU sets them)
    if request.goal:
        parts += ["--goal", request.goal]
    if request.target:
        parts += ["--target", request.target]
    if plan.kv_cache_scheme:
        parts += ["--kv-cache-scheme", plan.kv_cache_scheme]
    if algorithm is not None and (algorithm or plan.algorithm):
        parts += ["--algorithm", algorithm]
    if excluded:
        parts += ["--exclude", *excluded]
    for pattern, scheme in (plan.layer_quant_config or {}).items():
        parts += ["--layer-quant-scheme", pattern, scheme]
    if flow.opts.request.calib_data:
        parts += ["--calib-data", str(flow.opts.request.calib_data)]
    samples = calib.num_samples if change.num_calib_samples is None else change.num_calib_samples
    parts += ["--num-calib-samples", str(samples),
              "--calib-seq-len", str(calib.seq_len)]
    return " ".join(shlex.quote(p) for p in parts)


def _card(flow: Flow, root: Path, judged: Judged, best: RemedyRow, verdict: str | None) -> Path | None:
    """The recommended variant's model card, saying it was chosen by measuring the remedies (the comparison's own
    card, if it wrote one there, chose by its budget: replaced)."""
    from quark_ptq_eval.flows.compare.options import scheme_label
    from quark_ptq_eval.publish import ComparisonChoice, write_card

    label = scheme_label(best.variant.label)
    reason = (f"Recommended by `run --remedies` for {flow.model_path}: the run's own plan measured {verdict}; this "
              f"variant ({best.variant.changed}) measured {best.scored.verdict} (KL {fmt(best.scored.kl_mean)}) and helped "
              "beyond noise on the same windows against the same baseline" + (f". {judged.cause}." if judged.cause
                                                                                else "."))
    choice = ComparisonChoice(reason, tuple(f"{r.variant.label} ({r.outcome})" for r in judged.rows),
                              str(flow.run.workdir / "eval_report.md"))
    try:
        return write_card(root / "work" / label, root / "models" / label, comparison=choice)
    except QpeError as exc:  # the measurements stand; the card is their hand-off
        flow.run.ui.info(f"Remedies: no model card for {best.variant.label}: {exc.message}")
        return None


def _details(original: Scored, judged: Judged, command: str | None, root: Path, runtime: Runtime,
             card: Path | None) -> dict[str, Any]:
    """eval_results.json's details.remedies."""
    rec = judged.recommendation
    return {"original": original.as_json(), "variants": [r.as_json() for r in judged.rows], "cause": judged.cause,
            "shortfall": shortfall(judged),
            "comparison": str(root), "runtime": runtime.as_json(), "recommendation": None if rec is None else {
                "label": rec.variant.label, "changed": rec.variant.changed, "verdict": rec.scored.verdict,
                "kl_mean": rec.scored.kl_mean, "model_dir": rec.scored.model_dir, "command": command,
                "model_card": None if card is None else str(card)}}


def _write(wd: Path, results: dict[str, Any], details: dict[str, Any], markdown: str) -> None:
    """details.remedies in eval_results.json; the remedies section of eval_report.md (replacing an earlier one)."""
    from quark_ptq_eval.evaluate.report import json_safe

    results.setdefault("details", {})["remedies"] = details
    write_json(wd / "eval_results.json", json_safe(results))
    report = wd / "eval_report.md"
    text = report.read_text(encoding="utf-8") if report.is_file() else ""
    atomic_write_text(report, SECTION.sub("", text).rstrip("\n") + "\n\n" + markdown)
