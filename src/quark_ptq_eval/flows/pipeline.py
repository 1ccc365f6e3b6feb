"""The recipe as one flow: intake -> plan -> manifest -> execute (Phase 1), validate (Phase 2),
evaluate (Phase 3), summary. Every step writes its artifact; every gate goes through
``_gate`` so approvals are bound to content and a resumed run continues where it stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import ModelAnalysis, QuantPlan, RunManifest
from quark_ptq_eval.base.catalog import load_catalog
from quark_ptq_eval.base.errors import CheckpointPending, UsageError
from quark_ptq_eval.base.fsio import write_json
from quark_ptq_eval.base.gates import GATES, Approver, Gatekeeper
from quark_ptq_eval.base.options import flag
from quark_ptq_eval.base.state import RunState, WorkdirLock, digest
from quark_ptq_eval.base.step_table import STEP_NAMES, STEPS, SUMMARY_FILE
from quark_ptq_eval.base.ui import Reporter, noise_to_log
from quark_ptq_eval.context import preflight
from quark_ptq_eval.evaluate.tier1_text import TIER1_NO_TEXT, ask_tier1_text, tier1_lacks_text
from quark_ptq_eval.evaluate.tiers import runs, scores_text, text_tier
from quark_ptq_eval.execute.runner import EngineRunner, run_command
from quark_ptq_eval.flows.card_step import step_card
from quark_ptq_eval.flows.plan_scan import with_sensitivity_scan
from quark_ptq_eval.plan import PlanRequest, make_plan
from quark_ptq_eval.publish import CARD_CHOICES

RUN_LOG = "run.log"  # in-process library output of a run (the engine's own is engine.log)
# (output dir, source as compared, plan) -> the evaluation report: Phase 3 given by the caller
Evaluator = Callable[[Path, Path | None, dict[str, Any]], Any]


@dataclass
class RunOptions:
    """Everything a run was asked to do; persisted in run_state.json so `resume` needs no flags."""

    model: str | None = None
    output_dir: str | None = None
    plan: dict[str, Any] = field(default_factory=dict)  # PlanRequest fields given explicitly
    overwrite: bool = False
    eval_tier: str | None = None
    eval: dict[str, Any] = field(default_factory=dict)  # EvalOptions fields given explicitly
    offline: bool | None = None
    execution_mode: str | None = None
    contexts: dict[str, str | None] = field(default_factory=dict)
    no_load_check: bool = field(default=False, metadata=flag(  # False: "not given", like the others
        "--no-load-check", action="store_true",
        help="validation skips loading the export and running a probe through it (models too large for this "
             "host); the report says it was skipped"))
    card: str | None = field(default=None, metadata=flag(
        "--card", choices=CARD_CHOICES, help="the export's model card (README.md) at the end of the run: write "
                                             "(default) or none (no card, and no README.md of the base model)"))

    def merged_over(self, stored: dict[str, Any]) -> RunOptions:
        """These options, with anything not given now taken from a stored earlier run."""
        merged = dict(stored)
        for k, v in dataclasses.asdict(self).items():
            if isinstance(v, dict):
                merged[k] = {**(stored.get(k) or {}), **{kk: vv for kk, vv in v.items() if vv is not None}}
            elif v not in (None, False):
                merged[k] = v
        names = {f.name for f in dataclasses.fields(RunOptions)}
        return RunOptions(**{k: v for k, v in merged.items() if k in names})


@dataclass
class Flow:
    """What the steps of one run share: its options, contexts and what each step produced."""

    opts: RunOptions
    ctx: preflight.Contexts
    catalog: dict
    model_path: Path | None
    output_dir: Path | None
    parts: dict[str, Any] = field(default_factory=dict)  # Step.part -> what the step produced

    def output(self) -> Path:
        """The output dir, which every step after intake has (only an intake-only run has none)."""
        if self.output_dir is None:
            raise RuntimeError("a step after intake ran without an output dir")
        return self.output_dir


class Recipe:
    def __init__(self, workdir: str | Path, approver: Approver, reporter: Reporter | None = None,
                 engine_runner: EngineRunner = run_command, evaluator: Evaluator | None = None):
        self.workdir = Path(workdir).resolve()
        self.approver = approver
        self.ui = reporter or Reporter()
        self.engine_runner = engine_runner  # a child process; the family matrix runs it in its own process
        self.flow: Flow | None = None  # the last run's: what each step produced, for a caller to read
        self.evaluator = evaluator  # Phase 3 in place of the tier choice (compare: against its cached baseline)
        self.state: RunState
        self.gates: Gatekeeper  # every approval of this run goes through it
        self.timings: dict[str, float] = {}
        self.plan_flags_given = False
        self.claims = contextlib.ExitStack()  # what the run holds until it ends (the output's claim)

    # -- the flow ---------------------------------------------------------------------------
    def run(self, options: RunOptions, stop_after: str | None = None) -> dict[str, Any]:
        if stop_after is not None and stop_after not in STEP_NAMES:
            raise UsageError(f"Unknown step {stop_after!r} to stop after.", f"Choose one of: {', '.join(STEP_NAMES)}.")
        with WorkdirLock(self.workdir), contextlib.ExitStack() as self.claims:  # claims: the output's lock
            self.state = RunState.load(self.workdir)
            resume = f"quark-ptq-eval resume --workdir {shlex.quote(str(self.workdir))}"
            self.gates = Gatekeeper(self.approver, self.state, lambda flags: f"{resume} {flags}")
            opts = options.merged_over(self.state.options)
            if not opts.model:
                raise UsageError("No model given and no earlier run in this work dir.",
                                 "Run `quark-ptq-eval run MODEL -o OUTPUT_DIR` first.")
            self.state.options = dataclasses.asdict(opts)
            self.state.save()
            self.plan_flags_given = any(v is not None for v in options.plan.values())
            with noise_to_log(self.workdir / "logs" / RUN_LOG):  # library chatter: the log, not the terminal
                return self._run_locked(opts, stop_after)

    def _run_locked(self, opts: RunOptions, stop_after: str | None) -> dict[str, Any]:
        from quark_ptq_eval.intake import resolve_model

        clock = time.monotonic()
        offline = bool(opts.offline)
        if offline:
            os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        assert opts.model, "run() refuses a run without a model"
        model_path, _ = resolve_model(opts.model, offline)
        output_dir = self._output_dir(opts, model_path) if opts.output_dir or stop_after != "intake" else None
        ctx = preflight.gather(self.workdir, opts.contexts,
                               preflight.SessionAsk(opts.plan.get("goal", ""), opts.offline, opts.execution_mode),
                               preflight.WorkspaceAsk(opts.model, model_path, output_dir or Path(""),
                                                      bool(opts.plan.get("trust_remote_code"))))
        if ctx.offline and not offline:
            return self._run_locked(dataclasses.replace(opts, offline=True), stop_after)
        if scores_text(opts.eval_tier) and tier1_lacks_text(opts.eval, ctx.offline) and not opts.plan.get("calib_data"):
            raise UsageError(TIER1_NO_TEXT)  # refused before any gate asks: no approval is wasted
        check_eval_window(opts.eval.get("seq_len"), model_path)  # a window beyond the context: refused now
        flow = self.flow = Flow(opts, ctx, load_catalog(), model_path, output_dir)
        for step in STEPS:
            self.ui.headline(step.title)
            produced = flow.parts[step.part] = getattr(self, step.run)(flow)
            if step.gate and step.gate_before_stop:
                self.gates.require(step.gate, content_digest(produced), step.part)
            if step.timing:
                now = time.monotonic()
                self.timings[step.timing], clock = now - clock, now
            if stop_after == step.name or (step.stops_plan_only and ctx.execution_mode == "plan_only"):
                return self._summary(opts, stopped_at=step.name, **flow.parts)
            if step.gate and not step.gate_before_stop:
                self.gates.require(step.gate, content_digest(produced), step.part)
        return self._summary(opts, stopped_at=None, **flow.parts)

    def _output_dir(self, opts: RunOptions, model_path: Path | None) -> Path:
        from quark_ptq_eval.base.safety import check_output_target

        if not opts.output_dir:
            raise UsageError("No output directory given.", "Pass -o/--output-dir for the quantized model.")
        return check_output_target(Path(opts.output_dir), model_path, self.workdir)

    # -- the steps (rows of steps.STEPS) ----------------------------------------------------
    def step_intake(self, flow: Flow) -> ModelAnalysis:
        from quark_ptq_eval.intake import analyze_model
        from quark_ptq_eval.intake.analyze import describe

        assert flow.opts.model, "run() refuses a run without a model"
        analysis = analyze_model(flow.opts.model, offline=flow.ctx.offline, catalog=flow.catalog,
                                 trust_remote_code=bool(flow.opts.plan.get("trust_remote_code")))
        previous = self._load_quietly(ModelAnalysis)
        if previous is not None and previous.digest == analysis.digest:
            analysis = previous  # unchanged: keep the file (and its approval) as it is
        else:
            analysis.write(self.workdir)
        self.ui.table("Model analysis", describe(analysis))
        for r in analysis.risks:
            self.ui.info(f"  risk [{r['severity']}]: {r['message']} → {r['recovery_hint']}")
        self.state.record_step("intake", "done", artifact=str(ModelAnalysis.path_in(self.workdir)),
                               digest=analysis.digest)
        return analysis

    def step_plan(self, flow: Flow) -> QuantPlan:
        analysis = flow.parts["analysis"]
        plan = self._hand_edited_plan(analysis, flow.catalog)
        if plan is None:
            fields = {f.name for f in dataclasses.fields(PlanRequest)}
            req = PlanRequest(**{k: v for k, v in flow.opts.plan.items() if k in fields}, offline=flow.ctx.offline,
                              hold_out_eval=self._hold_out(flow))
            plan = make_plan(analysis, flow.ctx.env, req, flow.catalog, ModelAnalysis.path_in(self.workdir),
                             flow.output())
            plan = with_sensitivity_scan(plan, req, self.workdir)  # --sensitivity: the flow runs the scan
        plan.requires_confirmation = not self.state.is_approved("plan", plan.digest)
        plan.write(self.workdir)
        self.ui.table("Quantization plan", [(d["decision"], _short(d["value"]), d["reason"]) for d in plan.decisions],
                      ("decision", "value", "reason"))
        self.state.record_step("plan", "done", artifact=str(QuantPlan.path_in(self.workdir)), digest=plan.digest)
        # A plan this host cannot hold stops here, before anything runs. Too little disk for the
        # output is bad input, not a decision: no approval makes it fit (exit 2, as at execution).
        from quark_ptq_eval.base.safety import check_free_space
        from quark_ptq_eval.execute.step import estimated_output_bytes
        from quark_ptq_eval.plan.fit_gate import hold_message

        if flow.ctx.execution_mode != "plan_only" and flow.output_dir is not None:
            check_free_space(Path(flow.output_dir), estimated_output_bytes(analysis))

        hold = hold_message(plan, flow.ctx.execution_mode, self.approver, self.state.is_approved("plan", plan.digest))
        if hold:
            self.gates.stop("plan", hold, "--approve plan")
        return plan

    def _hold_out(self, flow: Flow) -> bool:
        """Split off a held-out part of the calibration text? Decided once, when the plan is first
        made for this text: a resume (e.g. `--eval-tier skip`) must not change what was approved."""
        previous = self._load_quietly(QuantPlan)
        calib = previous.calibration if previous is not None else {}
        if calib.get("source_path", calib.get("path")) == flow.opts.plan.get("calib_data"):
            return bool(calib.get("split"))
        return _one_text_only(flow.opts, flow.ctx.offline)

    def _hand_edited_plan(self, analysis: ModelAnalysis, catalog: dict) -> QuantPlan | None:
        """A quant_plan.json the user corrected by hand is honoured (validated first), unless
        plan flags given now ask for a new recommendation."""
        path = QuantPlan.path_in(self.workdir)
        written = self.state.steps.get("plan", {}).get("digest")
        if self.plan_flags_given or not path.exists() or written is None:
            return None
        plan = QuantPlan.load(self.workdir)  # schema errors name the field
        if plan.digest == written:
            return None
        from quark_ptq_eval.plan.recommend import check_plan

        check_plan(plan, analysis, catalog)
        self.ui.info(f"Using your edited {path.name} (it differs from the one generated); it needs approval.")
        return plan

    def step_manifest(self, flow: Flow) -> RunManifest:
        from quark_ptq_eval.manifest import build_manifest

        plan, output_dir = flow.parts["plan"], flow.output()
        plan.requires_confirmation = False  # checkpoint 2 approved it
        plan.write(self.workdir)
        manifest = build_manifest(plan, self.workdir, output_dir, offline=flow.ctx.offline)
        previous = self._load_quietly(RunManifest)
        if previous is not None and previous.command.get("digest") != previous.command_digest:
            # Edited by hand after it was generated: keep the user's file; the execution gate is
            # bound to the command on disk, so the edited command needs its own approval.
            self.ui.info(f"warning: {RunManifest.path_in(self.workdir)} was edited after it was generated; "
                         "its command is kept and needs a new approval at checkpoint 3.")
            return previous
        if previous is not None and previous.command_digest == manifest.command_digest:
            manifest.runs, manifest.observed = previous.runs, previous.observed
        manifest.write(self.workdir)
        self.ui.table("Engine", [("engine", f"{manifest.engine['name']} (Quark {manifest.engine['version']})"),
                                 ("why", manifest.engine["reason"]), ("output", str(output_dir))])
        self.ui.info(f"Command:\n  {manifest.command['shell']}")
        self.state.record_step("manifest", "done", artifact=str(RunManifest.path_in(self.workdir)),
                               command_digest=manifest.command_digest)
        return manifest

    def step_execute(self, flow: Flow) -> dict:
        from quark_ptq_eval.execute.step import execute_manifest

        return execute_manifest(self, flow.parts["manifest"], flow.parts["analysis"], flow.output(),
                                flow.opts.overwrite)

    def step_validate(self, flow: Flow):
        from quark_ptq_eval.plan.source_reading import effective_source

        plan = flow.parts["plan"].to_dict()  # an FP8 / .bin source is compared through its staged copy
        self.vllm_python = flow.opts.eval.get("vllm_python")  # the serving check's vLLM, as Tier 3's
        self.vllm_args = tuple(flow.opts.eval.get("vllm_args") or ())  # and the user's server arguments
        return self._validate(effective_source(plan, flow.model_path), flow.output(), plan,
                              load_check=not flow.opts.no_load_check)

    def step_eval(self, flow: Flow):
        from quark_ptq_eval.plan.source_reading import effective_source

        plan = flow.parts["plan"].to_dict()  # Tier 1's baseline: the staged BF16 copy of an FP8 release
        source = effective_source(plan, flow.model_path)
        if self.evaluator is not None:
            report = self.evaluator(flow.output(), source, plan)
            self.state.record_step("eval", "done", tier=report.tier, report=str(report.report_path))
            return report
        return self._evaluate(flow.opts, source, flow.output(), plan)

    step_card = step_card  # Publish: the model card from every phase's artifacts (flows/card_step.py)

    def _validate(self, source: Path | None, output_dir: Path, plan: dict, load_check: bool = True):
        from quark_ptq_eval.validate import apply_fixes, propose_fixes

        report = self._checked(source, output_dir, plan, load_check)
        # the fixes re-copy files from the source: none without a local one (a Hub id's run)
        fixes = propose_fixes(report, source, output_dir) if report.status == "failed" and source is not None else []
        if fixes and source is not None:
            report.write(self.workdir)  # the failing report stays readable while we wait for approval
            summary = "\n".join(f"- {f.describe()}" for f in fixes)
            self.ui.info(f"Validation found problems with a safe fix:\n{summary}")
            self.gates.require("fix", digest(summary), summary)
            applied = apply_fixes(fixes, source, output_dir)  # approval was just bound to these fixes
            report = self._checked(source, output_dir, plan, load_check)
            report.applied_fixes = [*report.applied_fixes, *applied]
        if plan.get("calibration"):
            from quark_ptq_eval.base.calibration_text import describe_used

            report.calibration = describe_used(plan["calibration"])
        report.write(self.workdir)
        self.ui.info(report.one_line())
        self.state.record_step("validate", report.status, report=str(self.workdir / "validation_report.md"))
        report.raise_for_status()
        return report

    def _checked(self, source: Path | None, output_dir: Path, plan: dict, load_check: bool):
        """One validation pass, its checks shown as progress."""
        from quark_ptq_eval.validate import validate_model
        from quark_ptq_eval.validate.checks import CHECKS

        def progress(check: str, done: int, total: int) -> None:  # checks done, or one check's bytes compared
            self.ui.progress("validation checks" if total == len(CHECKS) else f"{check}: bytes compared", done, total)

        try:
            return validate_model(source, output_dir, plan, load_check=load_check, progress=progress,
                                  vllm_python=getattr(self, "vllm_python", None),
                                  vllm_args=getattr(self, "vllm_args", ()))
        finally:
            self.ui.end_progress()

    def _evaluate(self, opts: RunOptions, source: Path | None, output_dir: Path, plan: dict):
        from quark_ptq_eval.evaluate import EvalOptions, Thresholds, evaluate

        self._heldout_default(opts, plan)
        tier = opts.eval_tier or self._ask_tier(opts)
        self.gates.chosen("eval", tier)
        if not runs(tier):
            self.state.record_step("eval", "skipped")
            self.ui.info("Evaluation skipped.")
            return "skipped"
        self._say_heldout(tier, opts, plan)
        if scores_text(tier) and tier1_lacks_text(opts.eval, opts.offline):
            raise UsageError(TIER1_NO_TEXT)  # a calibration text too small to hold a part out
        fields = {f.name for f in dataclasses.fields(EvalOptions)}
        given = {k: v for k, v in opts.eval.items() if k in fields} | {"tier": tier}
        if isinstance(given.get("thresholds"), dict):
            given["thresholds"] = Thresholds(**given["thresholds"])
        options = EvalOptions(**given)
        try:
            report = evaluate(output_dir, options, self.workdir, self.gates, source_model=source, plan=plan,
                              progress=self.ui.progress)
        finally:
            self.ui.end_progress()
        self.state.record_step("eval", "done", tier=tier, report=str(self.workdir / "eval_report.md"))
        return report

    def _heldout_default(self, opts: RunOptions, plan: dict) -> None:
        """One text given: Tier 1 scores the part of it the plan held out from calibration."""
        split = (plan.get("calibration") or {}).get("split")
        if split and not opts.eval.get("eval_data") and (opts.eval_tier is None or scores_text(opts.eval_tier)):
            opts.eval["eval_data"] = split["heldout_path"]

    def _say_heldout(self, tier: str, opts: RunOptions, plan: dict) -> None:
        split = (plan.get("calibration") or {}).get("split")
        if scores_text(tier) and split and opts.eval.get("eval_data") == split["heldout_path"]:
            self.ui.info(f"Tier 1 text: the held-out part of your calibration text ({split['heldout_documents']} of "
                         f"{split['documents']} documents, {split['rule']}), which calibration never saw.")

    def _ask_tier(self, opts: RunOptions) -> str:
        """The evaluation checkpoint: pick a tier (or stop until one is given), then opt in to
        the baseline or not."""
        from quark_ptq_eval.evaluate import BASELINE_FROM_SOURCE, TIERS
        from quark_ptq_eval.evaluate.tiers import tier_checkpoint

        if self.gates.can_choose:
            for name, entry in TIERS.items():
                self.ui.info(f"  {name:<8} {entry.method} ({entry.cost})")
        message, flag = tier_checkpoint()
        tier = self.gates.choose("eval", "Which evaluation tier?", tuple(TIERS), message, flag)
        if scores_text(tier) and tier1_lacks_text(opts.eval, opts.offline):
            opts.eval["eval_data"] = self._tier1_text(opts)  # ask now, before the baseline question
        wanted = runs(tier) and "baseline" not in opts.eval
        if wanted and self.gates.opt_in("baseline", {"tier": tier, "model": opts.model}, GATES["baseline"].reason):
            opts.eval["baseline"] = BASELINE_FROM_SOURCE
        return tier

    def _tier1_text(self, opts: RunOptions) -> str:
        answer = ask_tier1_text(self.gates, opts.plan.get("calib_data"))
        if answer is None:
            self.gates.stop("eval", f"Stopped at the evaluation checkpoint: {TIER1_NO_TEXT}",
                            f"--eval-tier {text_tier().name} --eval-data FILE")
        return answer

    # -- helpers ----------------------------------------------------------------------------
    def _load_quietly(self, cls):
        try:
            return cls.load(self.workdir) if cls.path_in(self.workdir).exists() else None
        except UsageError:
            return None  # a damaged or hand-broken artifact is regenerated

    def _summary(self, opts: RunOptions, stopped_at: str | None, **parts: Any) -> dict[str, Any]:
        from quark_ptq_eval.flows.summary import build_summary

        summary = build_summary(self.workdir, opts.model, opts.output_dir, self.timings, stopped_at, parts)
        write_json(self.workdir / SUMMARY_FILE, summary)
        return summary


def _one_text_only(opts: RunOptions, offline: bool) -> bool:
    """Calibration text given and Tier 1 would have no other text: hold a part of it out."""
    return bool(opts.plan.get("calib_data")) and (opts.eval_tier is None or scores_text(opts.eval_tier)) and \
        tier1_lacks_text(opts.eval, offline)


def check_eval_window(seq_len: int | None, model_path: Path | None) -> None:
    """An explicit Tier 1 --seq-len beyond the model's context is refused before anything runs."""
    from quark_ptq_eval.base.context_window import fit_window, read_model_config

    if seq_len is not None and model_path is not None:
        fit_window(seq_len, seq_len, read_model_config(model_path), "--seq-len")


def content_digest(produced: Any) -> str:
    """What a step's gate is bound to: an artifact's own digest, or the verified output's facts."""
    if hasattr(produced, "digest"):
        return produced.digest
    return digest(_stable_facts(produced))


def _stable_facts(facts: dict) -> dict:
    return {k: v for k, v in facts.items() if k in ("files", "shards", "tensor_count", "quant_method", "size_bytes")}


def _short(value: Any, limit: int = 60) -> str:
    text = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


__all__ = ["CheckpointPending", "Recipe", "RunOptions"]
