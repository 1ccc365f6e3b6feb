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
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import QuantPlan
from quark_ptq_eval.base.fsio import atomic_write_text, read_json, write_json
from quark_ptq_eval.evaluate.remedy_variants import Judged, Variant, judge, propose, table_markdown
from quark_ptq_eval.flows.compare.options import MixCell
from quark_ptq_eval.flows.recipe.budget_side import compare_cells, measure_side_by_side
from quark_ptq_eval.flows.recipe.recipe_flow import Flow

REMEDIES_DIR = "remedies"  # under the run's work dir: a comparison's own root
SECTION = re.compile(r"\n## Remedies, measured\n.*", re.S)


def after_own_eval(flow: Flow, plan: QuantPlan) -> None:
    """What follows the run's own Tier 1: the budget search's side by side, then the remedies asked for."""
    measure_side_by_side(flow, plan)
    measure_remedies(flow, plan)


def measure_remedies(flow: Flow, plan: QuantPlan) -> Judged | None:
    """The remedies measured and reported (None: none asked for, the verdict is healthy, or no baseline)."""
    count, wd, ui = flow.opts.eval.remedies, flow.run.workdir, flow.run.ui
    results_path = wd / "eval_results.json"
    if not count or flow.model_path is None or not results_path.is_file():
        return None
    results = read_json(results_path, "evaluation results")
    verdict = results.get("verdict")
    if not (results.get("details") or {}).get("paired"):
        ui.info("Remedies: not measured: they are judged against the baseline (Tier 1 with --baseline).")
        return None
    if verdict == "healthy":
        ui.info("Remedies: not measured: the verdict is healthy.")
        return None
    validation_path = wd / "validation_report.json"
    validation = read_json(validation_path, "validation report") if validation_path.is_file() else None
    variants = propose(dict(plan.as_json()), validation, count)
    if not variants:
        ui.info("Remedies: none left to measure: the plan already does what they would change.")
        return None
    ui.info(f"Remedies: measuring {len(variants)} variant(s) of the plan on the same windows, one quantization each "
            f"({', '.join(v.label for v in variants)})")
    cells = {v.label: MixCell(v.scheme, dict(plan.layer_quant_config), dict(v.request)) for v in variants}
    root = wd / REMEDIES_DIR
    doc = compare_cells(flow, plan, cells, root, "Remedies")
    measured = {r["scheme"]: r for r in (doc or {}).get("schemes") or []}
    from quark_ptq_eval.flows.compare.results import export_row

    original = {**export_row(results, flow.output(), flow.model_path), "validation": (validation or {}).get("status")}
    judged = judge(original, variants, measured, verdict)
    best = next((v for v in variants if judged.recommendation and v.label == judged.recommendation["label"]), None)
    command = None if best is None else reproduce(flow, plan, best)
    _write(wd, results, original, judged, command, root)
    for row in judged.rows:
        ui.info(f"  {row['label']}: {row['changed']}: {row['outcome']} ({row['outcome_detail']})")
    if judged.cause:
        ui.info(f"Remedies: {judged.cause}.")
    ui.info(f"Remedies: recommended {best.label} ({best.changed}): {command}" if best else
            "Remedies: none helped beyond noise; none is recommended.")
    return judged


def reproduce(flow: Flow, plan: QuantPlan, v: Variant) -> str:
    """The `run` command that makes the variant's export: the run's model and calibration, the variant's plan."""
    algorithm = v.request.get("algorithm", plan.algorithm)
    excluded = v.request.get("exclude_layers", list(plan.exclude_layers))
    calib = plan.calibration
    parts = ["quark-ptq-eval", "run", str(flow.model_path), "-o", f"{flow.output()}-{v.label}", "--scheme", v.scheme]
    if algorithm is not None and (algorithm or plan.algorithm):
        parts += ["--algorithm", algorithm]
    if excluded:
        parts += ["--exclude", *excluded]
    for pattern, scheme in (plan.layer_quant_config or {}).items():
        parts += ["--layer-quant-scheme", pattern, scheme]
    if flow.opts.request.calib_data:
        parts += ["--calib-data", str(flow.opts.request.calib_data)]
    parts += ["--num-calib-samples", str(v.request.get("num_calib_samples", calib.get("num_samples"))),
              "--calib-seq-len", str(calib.get("seq_len"))]
    return " ".join(shlex.quote(p) for p in parts)


def _write(wd: Path, results: dict[str, Any], original: dict[str, Any], judged: Judged, command: str | None,
           root: Path) -> None:
    """details.remedies in eval_results.json; the remedies section of eval_report.md (replacing an earlier one)."""
    from quark_ptq_eval.evaluate.report import json_safe

    results.setdefault("details", {})["remedies"] = {
        "original": original, "variants": judged.rows, "cause": judged.cause, "comparison": str(root),
        "recommendation": None if judged.recommendation is None else {**judged.recommendation, "command": command}}
    write_json(wd / "eval_results.json", json_safe(results))
    report = wd / "eval_report.md"
    text = report.read_text(encoding="utf-8") if report.is_file() else ""
    atomic_write_text(report, SECTION.sub("", text).rstrip("\n") + "\n\n" + table_markdown(original, judged, command))
