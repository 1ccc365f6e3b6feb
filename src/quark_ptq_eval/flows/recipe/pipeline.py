"""The recipe as one flow: intake -> plan -> manifest -> execute (Phase 1), validate (Phase 2),
evaluate (Phase 3), the model card, then the summary.

``Recipe.run`` calls the steps in order in ``Recipe._steps``: each a plain function (in
``quantize_steps``, ``check_steps``, ``card_step``) taking what the steps before it produced and
returning its own artifact. ``Recipe._step`` does what every step shares, from its row in
``base/step_table.py``: the headline, the step's gate (bound to the artifact's content, so a resumed
run continues where it stopped), the phase's clock and ``--stop-after``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from quark_ptq_eval.base.catalog import load_catalog
from quark_ptq_eval.base.errors import CheckpointPending, UsageError
from quark_ptq_eval.base.fsio import write_json
from quark_ptq_eval.base.gates import Approver, Gatekeeper
from quark_ptq_eval.base.options import apply_offline
from quark_ptq_eval.base.quark_import import import_seconds
from quark_ptq_eval.base.state import RunState, WorkdirLock
from quark_ptq_eval.base.step_table import STEP_NAMES, STEPS, SUMMARY_FILE, Step
from quark_ptq_eval.base.ui import Reporter, noise_to_log
from quark_ptq_eval.context import preflight
from quark_ptq_eval.execute.runner import EngineRunner, run_command
from quark_ptq_eval.flows.recipe.card_step import card_step
from quark_ptq_eval.flows.recipe.check_steps import eval_step, validate_step
from quark_ptq_eval.flows.recipe.quantize_steps import (
    execute_step,
    intake_step,
    manifest_step,
    plan_step,
    refuse_early,
)
from quark_ptq_eval.flows.recipe.recipe_flow import IMPORT_SUFFIX, AfterEval, Evaluator, Flow, RunServices
from quark_ptq_eval.flows.recipe.run_options import RunOptions
from quark_ptq_eval.flows.recipe.summary import RunSummary

RUN_LOG = "run.log"  # in-process library output of a run (the engine's own is engine.log)
ProducedT = TypeVar("ProducedT")
STEP_ROWS: dict[str, Step] = {s.name: s for s in STEPS}


class _Stopped(Exception):
    """The run stops after this step (``--stop-after``, or plan_only after the manifest)."""

    def __init__(self, step: str):
        super().__init__(step)
        self.step = step


class Recipe:
    def __init__(self, workdir: str | Path, approver: Approver, reporter: Reporter | None = None,
                 engine_runner: EngineRunner = run_command, evaluator: Evaluator | None = None,
                 after_eval: AfterEval | None = None):
        self.workdir = Path(workdir).resolve()
        self.approver = approver
        self.ui = reporter or Reporter()
        self.engine_runner = engine_runner  # a child process; the family matrix runs it in its own process
        self.flow: Flow | None = None  # the last run's: what each step produced, for a caller to read
        self.evaluator = evaluator  # Phase 3 in place of the tier choice (compare: against its cached baseline)
        self.after_eval = after_eval  # after the run's own Tier 1 (the budget search's side by side)
        self.timings: dict[str, float] = {}
        self._clock = 0.0

    # -- the flow ---------------------------------------------------------------------------
    def run(self, options: RunOptions, stop_after: str | None = None) -> RunSummary:
        """The recipe (to ``stop_after``) with ``options`` over those stored by an earlier run in the
        work dir; returns run_summary.json's content. Raises CheckpointPending at a refused gate."""
        if stop_after is not None and stop_after not in STEP_NAMES:
            raise UsageError(f"Unknown step {stop_after!r} to stop after.", f"Choose one of: {', '.join(STEP_NAMES)}.")
        with WorkdirLock(self.workdir), contextlib.ExitStack() as claims:  # claims: the output's lock
            state = RunState.load(self.workdir)
            opts = options.merged_over(state.options)
            if not opts.model:
                raise UsageError("No model given and no earlier run in this work dir.",
                                 "Run `quark-ptq-eval run MODEL -o OUTPUT_DIR` first.")
            state.options = opts.to_state()
            state.save()
            resume = f"quark-ptq-eval resume --workdir {shlex.quote(str(self.workdir))}"
            gates = Gatekeeper(self.approver, state, lambda flags: f"{resume} {flags}")
            services = RunServices(self.workdir, self.ui, state, gates, self.approver, self.engine_runner, claims,
                                   self.evaluator, self.after_eval, timings=self.timings)
            with noise_to_log(self.workdir / "logs" / RUN_LOG):  # library chatter: the log, not the terminal
                return self._run_locked(opts, services, bool(options.request_given), stop_after)

    def _run_locked(self, opts: RunOptions, services: RunServices, plan_flags_given: bool,
                    stop_after: str | None) -> RunSummary:
        from quark_ptq_eval.intake import resolve_model

        self._clock, self._imported = time.monotonic(), import_seconds()
        offline = preflight.asked_offline(opts.contexts, opts.offline)  # once, before a model id could resolve
        if offline and not opts.offline:
            opts = dataclasses.replace(opts, offline=True)
        apply_offline(offline)  # this process and every child; a forked command's Hub libraries too
        assert opts.model, "run() refuses a run without a model"
        model_path, _ = resolve_model(opts.model, offline)
        output_dir = self._output_dir(opts, model_path) if opts.output_dir or stop_after != "intake" else None
        ctx = preflight.gather(self.workdir, opts.contexts,
                               preflight.SessionAsk(opts.request.goal, opts.offline, opts.execution_mode),
                               preflight.WorkspaceAsk(opts.model, model_path, output_dir or Path(""),
                                                      opts.request.trust_remote_code))
        refuse_early(opts, ctx.offline, model_path)
        flow = self.flow = Flow(opts, ctx, load_catalog(), model_path, output_dir, services, plan_flags_given)
        try:
            self._steps(flow, stop_after)
        except _Stopped as stopped:
            return self._summary(flow, stopped_at=stopped.step)
        return self._summary(flow, stopped_at=None)

    def _steps(self, flow: Flow, stop_after: str | None) -> None:
        """The recipe, in order: each step a plain call on what the steps before it produced."""
        analysis = self._step("intake", flow, stop_after, lambda: intake_step(flow))
        plan = self._step("plan", flow, stop_after, lambda: plan_step(flow, analysis))
        self._step("manifest", flow, stop_after, lambda: manifest_step(flow, plan))
        self._step("execute", flow, stop_after, lambda: execute_step(flow, analysis))  # the manifest on disk
        self._step("validate", flow, stop_after, lambda: validate_step(flow, plan))
        self._step("eval", flow, stop_after, lambda: eval_step(flow, plan))
        self._step("card", flow, stop_after, lambda: card_step(flow))

    def _step(self, name: str, flow: Flow, stop_after: str | None, perform: Callable[[], ProducedT]) -> ProducedT:
        """One step as its row in the step table says: headline, the step itself, its gate (asked before
        a stop when the row says so), the phase's clock; raises _Stopped where the run stops."""
        step = STEP_ROWS[name]
        self.ui.headline(step.title)
        produced = perform()
        flow.parts[step.part] = produced
        if step.gate and step.gate_before_stop:
            flow.run.gates.require(step.gate, content_digest(produced), step.part)
        if step.timing:
            now, imported = time.monotonic(), import_seconds()
            self.timings[step.timing], self._clock = now - self._clock, now
            if imported > self._imported:  # this phase paid the cold start a warm process does not (remedies_side)
                self.timings[step.timing + IMPORT_SUFFIX], self._imported = imported - self._imported, imported
        if stop_after == step.name or (step.stops_plan_only and flow.ctx.execution_mode == "plan_only"):
            raise _Stopped(step.name)
        if step.gate and not step.gate_before_stop:
            flow.run.gates.require(step.gate, content_digest(produced), step.part)
        return produced

    def _output_dir(self, opts: RunOptions, model_path: Path | None) -> Path:
        from quark_ptq_eval.base.safety import check_output_target

        if not opts.output_dir:
            raise UsageError("No output directory given.", "Pass -o/--output-dir for the quantized model.")
        return check_output_target(Path(opts.output_dir), model_path, self.workdir)

    def _summary(self, flow: Flow, stopped_at: str | None) -> RunSummary:
        from quark_ptq_eval.flows.recipe.summary import build_summary

        summary = build_summary(self.workdir, flow.opts.model, flow.opts.output_dir, self.timings, stopped_at,
                                flow.parts)
        write_json(self.workdir / SUMMARY_FILE, summary)
        return summary


def content_digest(produced: object) -> str:
    """What a step's gate is bound to: its artifact's own digest (an analysis, a plan, the verified output)."""
    bound = getattr(produced, "digest", None)
    if not isinstance(bound, str):
        raise TypeError(f"a gated step produced {type(produced).__name__}, which has no content digest")
    return bound


def run_recipe(options: RunOptions, workdir: str | Path, approver: Approver, reporter: Reporter,
               stop_after: str | None = None, after_eval: AfterEval | None = None) -> RunSummary:
    """The one entry point of `run`, `resume` and the step commands, and of the Python API's ``run``."""
    return Recipe(workdir, approver, reporter, after_eval=after_eval).run(options, stop_after=stop_after)


__all__ = ["CheckpointPending", "Flow", "Recipe", "RunOptions", "run_recipe"]
