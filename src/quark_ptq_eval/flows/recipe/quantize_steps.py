"""Phase 1 of the recipe: intake -> plan -> manifest -> execute. Each step is a function taking the
run (``Flow``) and what the steps before it produced, and returning its own artifact, written in the
work dir; ``pipeline.Recipe`` calls them in order and asks their gates.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TypeVar

from quark_ptq_eval.base.artifacts import Artifact, ModelAnalysis, QuantPlan, RunManifest
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.evaluate.ppl.text import refuse_without_tier1_text
from quark_ptq_eval.execute.step import VerifiedOutput, estimated_output_bytes, execute_manifest
from quark_ptq_eval.flows.recipe.plan_scan import plan_from_request
from quark_ptq_eval.flows.recipe.recipe_flow import Flow
from quark_ptq_eval.flows.recipe.run_options import RunOptions
from quark_ptq_eval.plan import PlanRequest, make_plan

ArtifactT = TypeVar("ArtifactT", bound=Artifact)


def intake_step(flow: Flow) -> ModelAnalysis:
    """model_analysis.json: the model's config and headers, read without loading its weights."""
    from quark_ptq_eval.intake import analyze_model
    from quark_ptq_eval.intake.analyze import describe

    assert flow.opts.model, "run() refuses a run without a model"
    run = flow.run
    analysis = analyze_model(flow.opts.model, offline=flow.ctx.offline, catalog=flow.catalog,
                             trust_remote_code=flow.opts.request.trust_remote_code)
    previous = load_quietly(ModelAnalysis, run.workdir)
    if previous is not None and previous.digest == analysis.digest:
        analysis = previous  # unchanged: keep the file (and its approval) as it is
    else:
        analysis.write(run.workdir)
    run.ui.table("Model analysis", describe(analysis))
    for r in analysis.risks:
        run.ui.info(f"  risk [{r['severity']}]: {r['message']} → {r['recovery_hint']}")
    run.state.record_step("intake", "done", artifact=str(ModelAnalysis.path_in(run.workdir)), digest=analysis.digest)
    return analysis


def plan_step(flow: Flow, analysis: ModelAnalysis) -> QuantPlan:
    """quant_plan.json: the recommended plan (or the user's hand-edited one); a plan this host
    cannot hold stops here, before anything runs."""
    run = flow.run
    plan = _hand_edited_plan(flow, analysis)
    if plan is None:
        req = dataclasses.replace(flow.opts.request, offline=flow.ctx.offline, hold_out_eval=_hold_out(flow))

        def replan(r: PlanRequest) -> QuantPlan:
            return make_plan(analysis, flow.ctx.env, r, flow.catalog, ModelAnalysis.path_in(run.workdir), flow.output())

        plan = plan_from_request(req, replan, run.workdir)  # --sensitivity or a budget: the scans run here
    approved = run.state.is_approved("plan", plan.digest)
    plan.requires_confirmation = not approved
    plan.write_if_changed(run.workdir)  # on disk before checkpoint 2: the file is what the user reads and edits
    run.ui.table("Quantization plan", [(d["decision"], _short(d["value"]), d["reason"]) for d in plan.decisions],
                 ("decision", "value", "reason"))
    run.state.record_step("plan", "done", artifact=str(QuantPlan.path_in(run.workdir)), digest=plan.digest)
    # Too little disk for the output is bad input, not a decision: no approval makes it fit (exit 2,
    # as at execution).
    from quark_ptq_eval.base.safety import check_free_space
    from quark_ptq_eval.plan.fit_gate import hold_message

    if flow.ctx.execution_mode != "plan_only" and flow.output_dir is not None:
        check_free_space(Path(flow.output_dir), output_bytes_needed(plan, analysis))
    hold = hold_message(plan, flow.ctx.execution_mode, run.approver, approved)
    if hold:
        run.gates.stop("plan", hold, "--approve plan")
    return plan


def output_bytes_needed(plan: QuantPlan, analysis: ModelAnalysis) -> int:
    """The export's size on disk: the plan's own size model (plan/resources.py) when it has one, else
    execute's rule of thumb from the source's size (a hand-edited plan without resources)."""
    modelled = plan.resources.get("output_bytes")
    return int(modelled) + (1 << 20) if modelled else estimated_output_bytes(analysis)


def _hold_out(flow: Flow) -> bool:
    """Split off a held-out part of the calibration text? Decided once, when the plan is first
    made for this text: a resume (e.g. `--eval-tier skip`) must not change what was approved."""
    previous = load_quietly(QuantPlan, flow.run.workdir)
    calib = previous.calibration if previous is not None else None
    if calib is not None and calib.source_file == flow.opts.request.calib_data:
        return calib.split is not None
    # calibration text given and Tier 1 would have no other text: hold a part of it out
    return bool(flow.opts.request.calib_data) and flow.tier1_lacks_text(flow.opts.eval_tier)


def _hand_edited_plan(flow: Flow, analysis: ModelAnalysis) -> QuantPlan | None:
    """A quant_plan.json the user corrected by hand is honoured (validated first), unless
    plan flags given now ask for a new recommendation."""
    workdir = flow.run.workdir
    path = QuantPlan.path_in(workdir)
    written = flow.run.state.steps.get("plan", {}).get("digest")
    if flow.plan_flags_given or not path.exists() or written is None:
        return None
    plan = QuantPlan.load(workdir)  # schema errors name the field
    if plan.digest == written:
        return None
    from quark_ptq_eval.plan.recommend import check_plan

    check_plan(plan, analysis, flow.catalog)
    flow.run.ui.info(f"Using your edited {path.name} (it differs from the one generated); it needs approval.")
    return plan


def manifest_step(flow: Flow, plan: QuantPlan) -> RunManifest:
    """run_manifest.yaml: the exact command of the approved plan (a hand-edited command is kept)."""
    from quark_ptq_eval.manifest import build_manifest

    run, output_dir = flow.run, flow.output()
    _record_plan_approval(flow, plan)
    manifest = build_manifest(plan, run.workdir, output_dir, offline=flow.ctx.offline)
    previous = load_quietly(RunManifest, run.workdir)
    if previous is not None and previous.command.get("digest") != previous.command_digest:
        # Edited by hand after it was generated: keep the user's file; the execution gate is
        # bound to the command on disk, so the edited command needs its own approval.
        run.ui.info(f"warning: {RunManifest.path_in(run.workdir)} was edited after it was generated; "
                    "its command is kept and needs a new approval at checkpoint 3.")
        return previous
    if previous is not None and previous.command_digest == manifest.command_digest:
        manifest.runs, manifest.observed = previous.runs, previous.observed
    manifest.write(run.workdir)
    run.ui.table("Engine", [("engine", f"{manifest.engine['name']} (Quark {manifest.engine['version']})"),
                            ("why", manifest.engine["reason"]), ("output", str(output_dir))])
    run.ui.info(f"Command:\n  {manifest.command['shell']}")
    run.state.record_step("manifest", "done", artifact=str(RunManifest.path_in(run.workdir)),
                          command_digest=manifest.command_digest)
    return manifest


def _record_plan_approval(flow: Flow, plan: QuantPlan) -> None:
    """The plan's second and last write, only when checkpoint 2 approved it after the plan step wrote
    it (a resumed run whose plan was approved before wrote it once, final). Two writes because its
    content changes: the file must be on disk while checkpoint 2 waits (the user reads and may edit
    it there), and once approved its ``requires_confirmation`` says so before the manifest cites it."""
    if plan.requires_confirmation:
        plan.requires_confirmation = False
        plan.write(flow.run.workdir)


def execute_step(flow: Flow, analysis: ModelAnalysis) -> VerifiedOutput:
    """The approved run_manifest.yaml, run as it is on disk; its output verified."""
    run = flow.run
    return execute_manifest(run, RunManifest.path_in(run.workdir), analysis, flow.output(), flow.opts.overwrite,
                            run.claims)


def refuse_early(opts: RunOptions, offline: bool, model_path: Path | None) -> None:
    """What no approval can fix is refused before any gate asks: no approval is wasted. A Tier 1
    without text (a calibration text given is held out for it instead) and an explicit --seq-len
    beyond the model's context."""
    if not opts.request.calib_data:
        refuse_without_tier1_text(opts.eval_tier, opts.eval.eval_data, offline)
    seq_len = opts.eval.seq_len
    if seq_len is not None and model_path is not None:
        from quark_ptq_eval.base.context_window import fit_window, read_model_config

        fit_window(seq_len, seq_len, read_model_config(model_path), "--seq-len")


def load_quietly(cls: type[ArtifactT], workdir: Path) -> ArtifactT | None:
    """The artifact in ``workdir``, or None when it is missing, damaged or hand-broken (regenerated)."""
    try:
        return cls.load(workdir) if cls.path_in(workdir).exists() else None
    except UsageError:
        return None


def _short(value: object, limit: int = 60) -> str:
    text = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
