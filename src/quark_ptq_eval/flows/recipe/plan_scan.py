"""The scans at plan time, and ``plan_from_request``: the one way `run`, the Python API and `compare` make a plan
from a request (the budget's first format, the plan, then the sensitivity scan or the budget search it asks for).

`--sensitivity` at plan time: the flow runs the scan on the plan's choices, then the plan takes
its result (plan/scan_decision.py), approved at checkpoint 2 like any decision.

Giving ``--sensitivity`` is the user's explicit yes to read the model and run the scan now (it
writes only its cache and the sensitivity_report.* files in the work dir).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING

from quark_ptq_eval.base.artifacts import QuantPlan
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.budget.request import budget_request
from quark_ptq_eval.budget.search import with_budget_search
from quark_ptq_eval.plan.request import PlanRequest
from quark_ptq_eval.plan.scan_decision import ScanResult, take_scan_result

if TYPE_CHECKING:
    from quark_ptq_eval.plan.targets import ArchFamily
    from quark_ptq_eval.sensitivity.proposal import Proposal


def plan_from_request(req: PlanRequest, replan: Callable[[PlanRequest], QuantPlan], workdir: Path) -> QuantPlan:
    """The plan ``req`` asks for, made by ``replan`` (the caller's ``make_plan`` with its analysis, host and output):
    with a budget and no scheme the first format is planned first; then ``--sensitivity`` runs its scan, or a budget
    its search (budget/search.py: one scan per format, then the plan made again with the mix), in ``workdir``."""
    req = budget_request(req)
    plan = with_sensitivity_scan(replan(req), req, workdir)  # --sensitivity: the flow runs the scan
    return with_budget_search(plan, req, workdir, replan, calibration_text)  # a budget: the scans, then the mix


def with_sensitivity_scan(plan: QuantPlan, req: PlanRequest, workdir: Path) -> QuantPlan:
    """``plan`` with the scan's proposal as a decision when ``req.sensitivity`` is set, else as it is; a
    proposal that splits one of vLLM's fused groups is refused, or widened (``--widen-groups``)."""
    if not req.sensitivity:
        return plan
    from quark_ptq_eval.base.catalog import load_catalog
    from quark_ptq_eval.plan.recommend import regroup

    plan = take_scan_result(plan, run_plan_scan(plan, req.max_kl, workdir))
    # the proposal is held to vLLM's fused groups as the user's overrides are (refused, or widened when asked)
    return regroup(plan, req.widen_groups, load_catalog()["schemes"])


def run_plan_scan(plan: QuantPlan, max_kl: float | None, workdir: Path) -> ScanResult:
    """The scan of the plan's model under its scheme, exclusions and device, on its calibration text."""
    from quark_ptq_eval.sensitivity import ScanOptions, run_sensitivity

    model_dir = Path(plan.model["model_path"])
    if not (model_dir / "config.json").exists():
        raise UsageError(f"--sensitivity needs a local model directory; {model_dir} is not one.",
                         "Download the model first, or plan without --sensitivity.")
    opts = ScanOptions(model_dir=model_dir, scheme=plan.global_scheme, calib_data=Path(calibration_text(plan, workdir)),
                       exclude=list(plan.exclude_layers), device=plan.device_strategy.device,
                       trust_remote_code=plan.trust_remote_code)
    from quark_ptq_eval.plan.targets import FAMILIES

    family = FAMILIES.get(plan.target.get("arch") or "")
    done = run_sensitivity(opts, workdir, max_kl, served=target_rule(model_dir, family))
    assert done.proposal is not None  # the plan's scan runs to its end (it has no --estimate-only)
    return _scan_result(done.proposal, str(done.reports["md"]))


def target_rule(model_dir: Path, family: ArchFamily | None) -> Callable[[Proposal], Proposal]:
    """The sensitivity proposal held to what ``family``'s vLLM serves for ``model_dir``'s linears."""
    from quark_ptq_eval.plan.scheme_fit import linear_shapes

    return lambda proposal: served_on_target(proposal, list(linear_shapes(str(model_dir), [])), family)


def served_on_target(proposal: Proposal, names: list[str], family: ArchFamily | None) -> Proposal:
    """The proposal, its layers kept unquantized instead of at the wider scheme where that scheme would put routed
    experts in a format the target's vLLM does not load for experts (plan/targets.py ``expert_refusal``, the rule
    the budget search's candidates follow too). Unquantized experts are served everywhere; that combination was
    measured by the proposal itself."""
    from quark_ptq_eval.plan.groups import ROUTED
    from quark_ptq_eval.plan.targets import expert_refusal

    wider = proposal.layer_quant_config
    if not wider or not (why := expert_refusal(next(iter(wider.values())), family)):
        return proposal
    if not any(ROUTED.match(n) and any(n == p or fnmatchcase(n, p) for p in wider) for n in names):
        return proposal
    assert proposal.wider is not None  # layer_quant_config is empty without it
    return dataclasses.replace(proposal, wider={**proposal.wider, "chosen": False, "refused": why})


def calibration_text(plan: QuantPlan, workdir: Path) -> str:
    """The plan's local calibration text, else the demo corpus (built in the work dir)."""
    return plan.calibration.path or str(_demo_corpus(workdir))


def _scan_result(proposal: Proposal, report: str) -> ScanResult:
    """The proposal as the plan reads it."""
    wider = proposal.wider or {}  # the same layers at a wider scheme, measured
    return ScanResult(
        kept_unquantized=list(proposal.kept_unquantized), layer_quant_config=dict(proposal.layer_quant_config),
        reason=proposal.reason, report=report, predicted_kl=proposal.predicted_kl,
        # the re-measured KL of what the plan now holds (the wider-scheme combination when it was chosen)
        measured_kl=wider["measured_kl"] if proposal.layer_quant_config else proposal.measured_kl,
        whole_model_kl=proposal.whole_model_kl, max_kl=proposal.max_kl, extra_bytes=proposal.extra_bytes,
        wider_extra_bytes=wider.get("extra_bytes"))


def _demo_corpus(workdir: Path) -> Path:
    from quark_ptq_eval.flows.demo import build_corpus

    path = workdir / "sensitivity_corpus.txt"
    return path if path.exists() else build_corpus(path)
