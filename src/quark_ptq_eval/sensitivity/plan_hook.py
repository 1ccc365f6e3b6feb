"""`--sensitivity` at plan time: the scan's proposal becomes a plan decision, approved at checkpoint 2.

Giving ``--sensitivity`` is the user's explicit yes to read the model and run the scan now (it
writes only its cache and the sensitivity_report.* files in the work dir). The proposed layers
are added to ``exclude_layers``, or to ``layer_quant_config`` when the scan chose a wider scheme
for them (the user can edit both in quant_plan.json like any decision), and a ``sensitivity``
decision row carries the reason: measured KL before/after and the size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UsageError


def apply_sensitivity(plan: Any, req: Any, workdir: Path) -> Any:
    """Add the scan's proposed exclusions to ``plan`` (a QuantPlan) when ``req.sensitivity`` is set."""
    if not getattr(req, "sensitivity", False):
        return plan
    from quark_ptq_eval.sensitivity import ScanOptions, run_sensitivity

    model_dir = Path(plan.model["model_path"])
    if not (model_dir / "config.json").exists():
        raise UsageError(f"--sensitivity needs a local model directory; {model_dir} is not one.",
                         "Download the model first, or plan without --sensitivity.")
    calib = plan.calibration.get("path") or _demo_corpus(workdir)
    opts = ScanOptions(model_dir=model_dir, scheme=plan.global_scheme, calib_data=Path(calib),
                       exclude=list(plan.exclude_layers), device=plan.device_strategy.get("device", "cpu"),
                       trust_remote_code=plan.trust_remote_code)
    done = run_sensitivity(opts, workdir, getattr(req, "max_kl", None))
    proposal = done["proposal"]
    added = [n for n in proposal.kept_unquantized if n not in plan.exclude_layers]
    wider = {n: s for n, s in proposal.layer_quant_config.items() if n not in plan.layer_quant_config}
    plan.exclude_layers = [*plan.exclude_layers, *added]
    plan.layer_quant_config = {**plan.layer_quant_config, **wider}
    for row in plan.decisions:
        if row["decision"] == "exclude_layers":
            row["value"] = plan.exclude_layers
            if added:
                row["reason"] += f"; + {len(added)} layer(s) from the sensitivity scan"
        if row["decision"] == "layer_quant_config" and wider:
            row["value"] = plan.layer_quant_config
            row["reason"] = f"{len(wider)} layer(s) at a wider scheme, from the sensitivity scan"
    plan.decisions.append({"decision": "sensitivity", "value": added or list(wider), "reason": proposal.reason,
                           "layer_quant_config": wider, "report": str(done["reports"]["md"]),
                           "predicted_kl": proposal.predicted_kl, "measured_kl": _measured(proposal),
                           "whole_model_kl": proposal.whole_model_kl, "max_kl": proposal.max_kl,
                           "extra_bytes": proposal.wider["extra_bytes"] if wider else proposal.extra_bytes})
    return plan


def _measured(proposal: Any) -> float | None:
    """The re-measured KL of what the plan now holds (the wider-scheme combination when it was chosen)."""
    return proposal.wider["measured_kl"] if proposal.layer_quant_config else proposal.measured_kl


def _demo_corpus(workdir: Path) -> Path:
    from quark_ptq_eval.flows.demo import build_corpus

    path = workdir / "sensitivity_corpus.txt"
    return path if path.exists() else build_corpus(path)
