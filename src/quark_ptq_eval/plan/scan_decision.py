"""The plan takes a sensitivity scan's result as a decision; it never runs a scan.

The flow runs the scan on the plan's own choices (flows/recipe/plan_scan.py) and hands the outcome here.
The proposed layers are added to ``exclude_layers``, or to ``layer_quant_config`` when the scan
chose a wider scheme for them (the user can edit both in quant_plan.json like any decision), and a
``sensitivity`` decision row carries the reason: measured KL before/after and the size.
"""

from __future__ import annotations

from dataclasses import dataclass

from quark_ptq_eval.base.artifacts import Decision, QuantPlan


@dataclass(frozen=True)
class ScanResult:
    """What the plan needs of a finished scan's proposal."""

    kept_unquantized: list[str]  # layers the proposal keeps at the source precision
    layer_quant_config: dict[str, str]  # layers it keeps at a wider scheme instead (when that was chosen)
    reason: str
    report: str  # sensitivity_report.md
    predicted_kl: float
    measured_kl: float | None  # the re-measured KL of what the proposal holds
    whole_model_kl: float
    max_kl: float
    extra_bytes: int  # keeping the layers unquantized costs this over the scheme
    wider_extra_bytes: int | None  # keeping them at the wider scheme costs this (None: none measured)


def take_scan_result(plan: QuantPlan, scan: ScanResult) -> QuantPlan:
    """Add the scan's proposed exclusions (or wider-scheme layers) to ``plan`` as its decisions."""
    added = [n for n in scan.kept_unquantized if n not in plan.exclude_layers]
    wider = {n: s for n, s in scan.layer_quant_config.items() if n not in plan.layer_quant_config}
    plan.exclude_layers = [*plan.exclude_layers, *added]
    plan.layer_quant_config = {**plan.layer_quant_config, **wider}
    if (row := plan.decision("exclude_layers")) is not None:
        row.value = plan.exclude_layers
        if added:
            row.reason += f"; + {len(added)} layer(s) from the sensitivity scan"
    if (row := plan.decision("layer_quant_config")) is not None and wider:
        row.value = plan.layer_quant_config
        row.reason = f"{len(wider)} layer(s) at a wider scheme, from the sensitivity scan"
    plan.decisions.append(Decision("sensitivity", added or list(wider), scan.reason, extra={
        "layer_quant_config": wider, "report": scan.report, "predicted_kl": scan.predicted_kl,
        "measured_kl": scan.measured_kl, "whole_model_kl": scan.whole_model_kl, "max_kl": scan.max_kl,
        "extra_bytes": scan.wider_extra_bytes if wider else scan.extra_bytes}))
    return plan
