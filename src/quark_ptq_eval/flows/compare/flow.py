"""A comparison: one intake, one plan per scheme approved together, one execution gate, then per
scheme quantize -> validate -> Tier 1 against a baseline evaluated once.

Layout under the output root (the compare work dir)::

    run_state.json, model_analysis.json        the comparison's own state and the shared intake
    work/<scheme>/                             a normal `run` work dir per scheme (its own state)
    models/<scheme>/                           the scheme's quantized model
    baseline_cache/<key>/                      the unquantized model's cached Tier 1 outputs
    comparison_report.md, comparison.json, comparison_pareto.png

Each scheme is driven by the recipe itself (``pipeline.Recipe``), whose gates are answered from
the comparison's approvals: intake, the plans and the commands are approved once here, for the
exact digests shown; every other gate (result, overwrite, fix) goes to the user's approver.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from quark_ptq_eval.base.artifacts import ModelAnalysis, QuantPlan, RunManifest
from quark_ptq_eval.base.errors import CheckpointPending, QpeError, UsageError
from quark_ptq_eval.base.gates import Approver, Gate, Gatekeeper
from quark_ptq_eval.base.state import RunState, WorkdirLock
from quark_ptq_eval.base.ui import Reporter, noise_to_log
from quark_ptq_eval.execute.runner import EngineRunner, run_command
from quark_ptq_eval.flows.compare.budget import searched_cells
from quark_ptq_eval.flows.compare.options import CompareOptions, budget_asked, scheme_label
from quark_ptq_eval.runtime.vllm_server import ServerHandover, handing_over

if TYPE_CHECKING:
    from quark_ptq_eval.flows.compare.speed_handover import CellSpeed

Progress = Callable[[str, str], None]  # (event, scheme): "started" / "done" / "failed" / "skipped"


class _Delegate:
    """The approver of one scheme's recipe: gates the comparison approved already pass, the rest
    are the user's to answer."""

    def __init__(self, user: Approver, granted: set[str]):
        self.user, self.granted = user, set(granted)
        self.interactive = bool(getattr(user, "interactive", False))

    def __call__(self, gate: Gate, summary: str) -> bool:
        return gate.name in self.granted or self.user(gate, summary)

    def weighs(self, gate: str) -> bool:
        return gate in self.granted or self.user.weighs(gate)


class Comparison:
    def __init__(self, root: str | Path, approver: Approver, reporter: Reporter | None = None,
                 progress: Progress | None = None):
        self.root = Path(root).resolve()
        self.approver = approver
        self.ui = reporter or Reporter()
        self.progress = progress or (lambda event, scheme: None)
        self.state: RunState
        self.gates: Gatekeeper
        self.engine_runner: EngineRunner = run_command  # the budget side by side runs its engines in process
        self.handed_over: dict[str, CellSpeed] = {}  # --speed: each cell's measurement on its serving check's server

    def run(self, options: CompareOptions) -> dict[str, Any]:
        self.root.mkdir(parents=True, exist_ok=True)
        with WorkdirLock(self.root):
            self.state = RunState.load(self.root)
            merged = options.merged_over(self.state.options)
            opts = searched_cells(self.root, merged)  # a budget: the search's plans
            if budget_asked(merged) and not merged.cells and self.engine_runner is run_command:
                from quark_ptq_eval.execute.in_process import InProcessRunner

                # the search's scans imported Quark here: its plans' engines run here too (one import, not one a
                # cell), as the run's side by side does (flows/recipe/budget_side.py)
                self.engine_runner = InProcessRunner()
            opts.check()
            self.state.options = opts.to_state()
            self.state.save()
            command = f"quark-ptq-eval compare -o {shlex.quote(str(self.root))}"
            self.gates = Gatekeeper(self.approver, self.state, lambda flags: f"{command} {flags}")
            with noise_to_log(self.root / "logs" / "compare.log"):
                return self._run_locked(opts)

    def _run_locked(self, opts: CompareOptions) -> dict[str, Any]:
        from quark_ptq_eval.flows.compare.evaluation import BaselineSource
        from quark_ptq_eval.flows.compare.plans import combined_plan_table, estimate_totals

        analysis = self._intake(opts)
        if opts.eval.tasks:
            self._check_tasks(opts)
        planned = self._each(opts, "plan", {"intake"})
        plans = {s: QuantPlan.load(self.workdir(s)) for s in planned}
        totals = estimate_totals(analysis, plans, opts)
        self.ui.table("Plans", combined_plan_table(plans, totals), ("scheme", "bits/weight", "output", "time",
                                                                    "algorithm", "calibration"))
        self.ui.info(totals["text"])
        self.gates.require("plan", {s: p.digest for s, p in plans.items()}, totals["text"])
        manifested = self._each(opts, "manifest", {"intake", "plan"}, only=list(plans))
        manifests = {s: RunManifest.load(self.workdir(s)) for s in manifested}
        shown = "\n".join(f"[{s}] {m.command['shell']}" for s, m in manifests.items())
        self.ui.info(f"Commands, one per scheme:\n{shown}\nthen validate and Tier 1 against the baseline, "
                     "evaluated once and cached")
        self.gates.require("execute", {s: m.command_digest for s, m in manifests.items()}, shown)
        baseline = BaselineSource(self, opts)
        self._run_schemes(opts, [s for s in opts.schemes if s in manifests], baseline)
        if opts.speed:  # after every cell's accuracy: no quantization competes with a server being measured
            self._measure_speed(opts, baseline)
        from quark_ptq_eval.flows.compare.card import card_for_chosen
        from quark_ptq_eval.flows.compare.results import write_comparison

        doc = write_comparison(self, opts, baseline)
        if budget_asked(opts):
            from quark_ptq_eval.base.fsio import write_json
            from quark_ptq_eval.evaluate.report import json_safe
            from quark_ptq_eval.flows.compare.budget import report_measured
            from quark_ptq_eval.flows.compare.results import JSON_NAME

            report_measured(self.root, opts, doc)
            write_json(self.root / JSON_NAME, json_safe(doc))
        card_for_chosen(self, doc, opts.base_model)  # the chosen scheme's card, after every scheme's evaluation
        return doc

    # -- the steps --------------------------------------------------------------------------
    def _intake(self, opts: CompareOptions) -> ModelAnalysis:
        from quark_ptq_eval.base.catalog import load_catalog
        from quark_ptq_eval.intake import analyze_model
        from quark_ptq_eval.intake.analyze import describe

        self.ui.headline("Compare · intake (once for every scheme)")
        assert opts.model, "compare() refuses a comparison without a model"
        analysis = analyze_model(opts.model, offline=bool(opts.offline), catalog=load_catalog(),
                                 trust_remote_code=bool(opts.plan.get("trust_remote_code")))
        analysis.write(self.root)
        self.ui.table("Model analysis", describe(analysis))
        self.state.record_step("intake", "done", digest=analysis.digest)
        self.gates.require("intake", analysis.digest, "analysis")
        return analysis

    def _check_tasks(self, opts: CompareOptions) -> None:
        """An unknown task fails before any scheme runs (once per task list: lm-eval's index is slow)."""
        from quark_ptq_eval.flows.compare.tasks import check

        include = opts.eval.include_path
        asked = {"tasks": list(opts.eval.tasks), "include_path": str(include) if include else None}
        if self.state.steps.get("tasks", {}).get("checked") != asked:
            check(opts)
            self.state.record_step("tasks", "done", checked=asked)

    def _each(self, opts: CompareOptions, stop_after: str, granted: set[str],
              only: list[str] | None = None) -> list[str]:
        """Take every scheme's recipe up to ``stop_after``; a scheme that fails there is recorded
        and left out of what follows."""
        self.ui.headline(f"Compare · {stop_after} (every scheme)")
        ok = []
        for scheme in only if only is not None else opts.schemes:
            try:
                self._recipe(opts, scheme, granted, quiet=True).run(self._run_options(opts, scheme), stop_after)
                ok.append(scheme)
            except CheckpointPending as exc:
                self._relay(scheme, exc)
            except QpeError as exc:
                self._failed(scheme, stop_after, exc)
        if not ok:
            raise UsageError(f"No scheme could be taken to its {stop_after}; see comparison state in {self.root}.",
                             "Fix the schemes named above and re-run.")
        return ok

    def _run_schemes(self, opts: CompareOptions, schemes: list[str], baseline) -> None:
        """Each scheme's recipe to its end, one after another (on_ray.py: as Ray tasks)."""
        for scheme in schemes:
            self._scheme(opts, scheme, baseline)

    def _measure_speed(self, opts: CompareOptions, baseline) -> None:
        """compare --speed (speed.py): the baseline and each usable cell served once, one at a time, and
        measured (on_ray.py: as Ray tasks holding the GPUs their servers need)."""
        from quark_ptq_eval.flows.compare.speed import is_current, measure_cell, measured_line, speed_cells

        self.ui.headline("Compare · serving speed (each model once, vLLM's own serving benchmark)")
        for cell in speed_cells(self, opts, baseline.source):
            handed = self.handed_over.get(cell.label)
            if handed is not None and handed.record is not None:  # measured on its serving check's server
                self.ui.info(measured_line(cell, handed.record))
                continue
            if is_current(cell, opts):
                self.ui.info(f"{cell.label}: serving speed measured before with the same workload; kept.")
                continue
            try:
                record = measure_cell(cell, opts, self.approver, self.ui.info)
            except CheckpointPending as exc:
                self._speed_gate(cell.label, exc)
            self.ui.info(measured_line(cell, record))

    def _speed_gate(self, label: str, exc: CheckpointPending) -> NoReturn:
        """The servers and benchmarks wait for the user's ``eval`` approval: stop there, saying how to go on."""
        command = self.gates.continue_command("--approve eval")
        self.state.wait_for("eval", None, f"[speed {label}] {exc.message}", command)
        raise CheckpointPending(f"Serving speed of {label}: {exc.message}", f"To continue: {command}") from None

    def _is_current(self, scheme: str, baseline) -> bool:
        """Evaluated before against this baseline (and task list): skipped, and said so."""
        record = self.state.steps.get(f"scheme:{scheme}", {})
        if record.get("status") == "evaluated" and record.get("cache_key") == baseline.key.id \
                and record.get("tasks_key") == baseline.tasks_key \
                and (self.workdir(scheme) / "eval_results.json").is_file():
            self.ui.info(f"{scheme}: already quantized, validated and evaluated; skipped.")
            self.progress("skipped", scheme)
            return True
        return False

    def _scheme(self, opts: CompareOptions, scheme: str, baseline) -> None:
        from quark_ptq_eval.flows.compare.evaluation import evaluate_scheme

        if self._is_current(scheme, baseline):
            return
        self.ui.headline(f"Compare · {scheme}: quantize → validate → evaluate")
        self.progress("started", scheme)  # what a cell costs is timed from here (run --remedies' pilot)
        runs_before = len(self._engine_runs(scheme))
        # the recipe's own steps to the end; its Phase 3 is Tier 1 against the baseline cached once
        recipe = self._recipe(opts, scheme, {"intake", "plan", "execute"}, quiet=self.ui.quiet)
        recipe.evaluator = lambda output_dir, source, plan: evaluate_scheme(self, opts, scheme, baseline, plan)
        try:
            with handing_over(self._speed_handover(opts, scheme)):  # --speed: its serving check's server measured
                recipe.run(self._run_options(opts, scheme))
        except CheckpointPending as exc:
            self._relay(scheme, exc)
        except QpeError as exc:
            self._failed(scheme, self._failed_step(scheme), exc)
            return
        finally:
            self._record_timing(scheme, runs_before)
        assert recipe.flow is not None  # the run went through every step
        report = recipe.flow.parts["evaluation"]
        self.state.record_step(f"scheme:{scheme}", "evaluated", cache_key=baseline.key.id,
                               tasks_key=baseline.tasks_key, verdict=report.verdict, report=str(report.report_path))
        self.ui.info(f"{scheme}: {report.one_line()}")
        self.progress("done", scheme)

    # -- helpers ----------------------------------------------------------------------------
    def _speed_handover(self, opts: CompareOptions, scheme: str) -> ServerHandover | None:
        """compare --speed: the cell's speed measurement, handed the server its serving check starts
        (speed_handover.py); what it measured is kept for the speed step."""
        if not opts.speed:
            return None
        from quark_ptq_eval.flows.compare.speed import SPEED_DIR, SpeedCell
        from quark_ptq_eval.flows.compare.speed_handover import CellSpeed

        wd = self.workdir(scheme)
        cell = SpeedCell(scheme, self.output_dir(scheme), wd / SPEED_DIR, QuantPlan.load(wd).as_json())
        self.handed_over[scheme] = CellSpeed(cell, opts, self.approver, self.ui.info)
        return self.handed_over[scheme]

    def _engine_runs(self, scheme: str) -> list[dict]:
        if not RunManifest.path_in(self.workdir(scheme)).exists():
            return []
        try:
            return RunManifest.load(self.workdir(scheme)).runs
        except QpeError:
            return []

    def _record_timing(self, scheme: str, runs_before: int) -> None:
        """A successful engine run of this call feeds the next comparison's time estimate."""
        from quark_ptq_eval.flows.compare.plans import record_engine_run

        runs = self._engine_runs(scheme)
        if len(runs) > runs_before and runs[-1].get("status") == "succeeded" and runs[-1].get("seconds"):
            wd = self.workdir(scheme)
            with contextlib.suppress(QpeError):  # a record helps the next estimate, never stops this one
                record_engine_run(ModelAnalysis.load(wd), QuantPlan.load(wd), runs[-1]["seconds"])

    def workdir(self, scheme: str) -> Path:
        return self.root / "work" / scheme_label(scheme)

    def output_dir(self, scheme: str) -> Path:
        return self.root / "models" / scheme_label(scheme)

    def _recipe(self, opts: CompareOptions, scheme: str, granted: set[str], quiet: bool):
        from quark_ptq_eval.flows.recipe.pipeline import Recipe

        return Recipe(self.workdir(scheme), _Delegate(self.approver, granted), Reporter(quiet=quiet),
                      engine_runner=self.engine_runner)

    def _run_options(self, opts: CompareOptions, scheme: str):
        from quark_ptq_eval.flows.compare.options import cell_request
        from quark_ptq_eval.flows.recipe.pipeline import RunOptions

        return RunOptions.from_given(model=opts.model, output_dir=str(self.output_dir(scheme)),
                          eval=_cell_eval_fields(opts),
                          request=cell_request(opts, scheme), overwrite=opts.overwrite, offline=opts.offline,
                          card="none",  # the comparison writes the card of the scheme it chooses
                          base_model=opts.base_model)  # in each scheme's run state: its card, written later, names it

    def _failed_step(self, scheme: str) -> str:
        steps = RunState.load(self.workdir(scheme)).steps
        for name in ("eval", "validate", "execute", "manifest", "plan"):
            if steps.get(name, {}).get("status") in ("failed", "interrupted"):
                return name
        return "quantize"

    def _failed(self, scheme: str, step: str, exc: QpeError) -> None:
        self.ui.info(f"{scheme}: failed at {step}: {exc.message}" + (f" ({exc.hint})" if exc.hint else ""))
        self.state.record_step(f"scheme:{scheme}", "failed", failed_step=step, error=exc.message, hint=exc.hint)
        self.progress("failed", scheme)

    def _relay(self, scheme: str, exc: CheckpointPending) -> None:
        """A scheme's recipe stopped at a gate the comparison does not answer: stop the comparison
        there, with the command that continues it."""
        gate = RunState.load(self.workdir(scheme)).waiting_for or "result"
        command = self.gates.continue_command(f"--approve {gate}")
        self.state.wait_for(gate, None, f"[{scheme}] {exc.message}", command)
        raise CheckpointPending(f"Scheme {scheme}: {exc.message}", f"To continue: {command}") from None


def _cell_eval_fields(opts: CompareOptions) -> dict[str, object]:
    """What a cell's own run takes of compare's evaluation options (its Tier 1 is compare's, against the
    cached baseline): the vLLM named with --vllm-python serves each cell in its validation's serving check,
    as in `run`; mixes measured beside a budget search keep all of their calibration text (Tier 1's is given)."""
    held: dict[str, object] = {}
    if opts.cells and opts.eval.eval_data:
        held["eval_data"] = str(opts.eval.eval_data)
    if opts.eval.vllm_python:
        held["vllm_python"] = str(opts.eval.vllm_python)
    if opts.eval.vllm_args:
        held["vllm_args"] = list(opts.eval.vllm_args)
    return held
