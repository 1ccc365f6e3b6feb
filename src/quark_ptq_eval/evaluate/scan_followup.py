"""The evaluation's follow-up on a sensitivity scan: the remedy that names the scan's command, and,
after execution, the scan's predicted KL for the chosen exclusions next to Tier 1's measured KL.

When quant_plan.json (in the evaluation's work dir, planned for the model evaluated) carries a
``sensitivity`` decision, the evaluation report shows what the scan predicted for the layers kept
unquantized and what Tier 1 measured on the quantized export. The two use the same measure
(mean per-token KL of the next-token distribution against the unquantized model) on different
tokens: the scan on its calibration slice, Tier 1 on the evaluation text; the report says so.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import Decision, QuantPlan


def scan_command(model: str | Path, scheme: str, calib_data: str | Path | None, out_dir: str | Path | None = None) -> str:
    """The command a user runs for a scan (shown by the remedies and the plan)."""
    argv = ["quark-ptq-eval", "sensitivity", str(model), "--scheme", scheme]
    if calib_data:
        argv += ["--calib-data", str(calib_data)]
    if out_dir:
        argv += ["--out", str(out_dir)]
    return shlex.join(argv)


def sensitivity_remedy(plan: Mapping[str, Any]) -> list[str]:
    """The remedy line for a hurt verdict: measure which layers the scheme hurts, with the command."""
    model = (plan.get("model") or {}).get("model_path")
    scheme = plan.get("global_scheme") or plan.get("scheme")
    if not model or not scheme:
        return []
    calib = (plan.get("calibration") or {}).get("path")
    return [f"Find the layers {scheme} hurts most and the exclusions that buy the accuracy back: "
            f"{scan_command(model, scheme, calib)} (or re-plan with --sensitivity)."]


def sensitivity_followup(workdir: Path, model_dir: Path, details: dict[str, Any],
                         plan: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The predicted-vs-measured record, or None when the plan made no sensitivity decision.
    ``plan``: the run's plan when the caller has it; else the work dir's quant_plan.json."""
    plan = _for_model(plan if plan is not None else _read_plan(Path(workdir)), Path(model_dir))
    row = next((d for d in (plan or {}).get("decisions", []) if Decision.of(d).id == "sensitivity"), None)
    if row is None:
        return None
    kl = details.get("kl") if isinstance(details.get("kl"), dict) else None
    measured = kl.get("kl_divergence") if kl else None
    predicted = row.get("measured_kl") if row.get("measured_kl") is not None else row.get("predicted_kl")
    if not row.get("value"):
        predicted = row.get("whole_model_kl")  # nothing excluded: the scan's whole-model figure is the prediction
    wider = row.get("layer_quant_config") or {}
    out = {
        "kept_unquantized": [n for n in row.get("value") or [] if n not in wider],
        "layer_quant_config": wider,
        "max_kl": row.get("max_kl"),
        "scan_whole_model_kl": row.get("whole_model_kl"),
        "scan_predicted_kl": row.get("predicted_kl"),
        "scan_remeasured_kl": row.get("measured_kl"),
        "tier1_kl": measured,
        "tier1_kl_p99": kl.get("kl_p99") if kl else None,
        "ratio_measured_to_predicted": _ratio(measured, predicted),
        "budget_met": None if measured is None or row.get("max_kl") is None else measured <= row["max_kl"],
        "scan_report": row.get("report"),
    }
    if measured is None:
        out["note"] = "Tier 1 measured no KL here (no baseline): run the evaluation with --baseline to compare."
    return out


def followup_markdown(follow: dict[str, Any] | None) -> list[str]:
    """The eval_report.md section (empty when there is nothing to follow up)."""
    if not follow:
        return []
    kept = ", ".join(f"`{n}`" for n in follow["kept_unquantized"]) or "none"
    rows = [("layers kept unquantized", kept)]
    rows += [(f"`{p}` at", f"`{s}`") for p, s in follow["layer_quant_config"].items()]
    rows += [("KL budget (--max-kl)", _fmt(follow["max_kl"])),
             ("scan: whole model quantized", _fmt(follow["scan_whole_model_kl"])),
             ("scan: predicted (additive, layers unquantized)", _fmt(follow["scan_predicted_kl"])),
             ("scan: re-measured with this proposal", _fmt(follow["scan_remeasured_kl"])),
             ("Tier 1: measured on the export (mean / p99)",
              f"{_fmt(follow['tier1_kl'])} / {_fmt(follow['tier1_kl_p99'])}"),
             ("measured / predicted", _fmt(follow["ratio_measured_to_predicted"], ".2f")),
             ("budget met (Tier 1)", {True: "yes", False: "no", None: "-"}[follow["budget_met"]])]
    lines = ["## Sensitivity proposal: predicted vs measured KL", "",
             "Same measure (mean per-token KL against the unquantized model); the scan measured its "
             "calibration slice with Quark fake-quant, Tier 1 the evaluation text on the exported model.", "",
             "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], ""]
    if follow.get("note"):
        lines += [f"- {follow['note']}", ""]
    if follow.get("scan_report"):
        lines += [f"- scan report: `{follow['scan_report']}`", ""]
    return lines


def _read_plan(workdir: Path) -> dict[str, Any] | None:
    try:
        plan: dict[str, Any] = json.loads((workdir / QuantPlan.FILENAME).read_text(encoding="utf-8"))
        return plan
    except (OSError, ValueError):
        return None


def _for_model(plan: Mapping[str, Any] | None, model_dir: Path) -> Mapping[str, Any] | None:
    """The plan when it was made for this export (a plan for another output is not ours)."""
    out = plan.get("output_dir") if isinstance(plan, Mapping) else None
    if not out or Path(out).resolve() != model_dir.resolve():
        return None
    return plan


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or not predicted or not math.isfinite(predicted):
        return None
    return measured / predicted


def _fmt(value: Any, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)
