"""What the recipe's steps share: ``RunServices`` (where a run writes, how it talks, its gates) and
``Flow`` (one run's options, contexts and what each step produced). The steps are plain functions
over these (``quantize_steps``, ``check_steps``, ``card_step``), called in order by ``pipeline.Recipe``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import PlanJson, QuantPlan
from quark_ptq_eval.base.catalog import QuarkCatalog
from quark_ptq_eval.base.gates import Approver, Gatekeeper
from quark_ptq_eval.base.state import RunState
from quark_ptq_eval.base.ui import Reporter
from quark_ptq_eval.context import preflight
from quark_ptq_eval.evaluate.ppl.text import refuse_without_tier1_text, tier1_lacks_text
from quark_ptq_eval.execute.runner import EngineRunner
from quark_ptq_eval.flows.recipe.run_options import RunOptions

IMPORT_SUFFIX = "_imports"  # a timed phase's share spent importing torch, transformers and quark.torch

# (output dir, source as compared, the plan as quant_plan.json holds it) -> the evaluation report:
# Phase 3 given by the caller (compare: Tier 1 against its cached baseline)
Evaluator = Callable[[Path, Path | None, PlanJson], Any]
AfterEval = Callable[["Flow", QuantPlan], object]


@dataclass
class RunServices:
    """What every step uses of the running recipe."""

    workdir: Path  # the artifacts, run_state.json and the approved run_manifest.yaml
    ui: Reporter
    state: RunState
    gates: Gatekeeper  # every approval of the run goes through it
    approver: Approver  # what the gatekeeper asks (the plan's hold asks it whether it may ask)
    engine_runner: EngineRunner  # a child process; the family matrix runs it in its own process
    claims: contextlib.ExitStack  # what the run holds until it ends (the output's claim)
    evaluator: Evaluator | None = None  # Phase 3 in place of the tier choice
    # after a Tier 1 evaluation of the run's own (`run` and `resume`: a budget search's plans measured side by
    # side, flows/recipe/budget_side.py; given by the entry points, so the recipe's modules need not import compare's)
    after_eval: AfterEval | None = None
    # each timed phase's seconds in this process (the step table's ``timing`` names): what the remedies' estimate
    # scales from
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class Flow:
    """One run: its options, contexts and what each step produced (``parts``, by ``Step.part``)."""

    opts: RunOptions
    ctx: preflight.Contexts
    catalog: QuarkCatalog
    model_path: Path | None
    output_dir: Path | None
    run: RunServices
    plan_flags_given: bool = False  # plan flags given now ask for a new recommendation
    parts: dict[str, object] = field(default_factory=dict)  # Step.part -> what the step produced
    _plan_json: PlanJson | None = None

    def output(self) -> Path:
        """The output dir, which every step after intake has (only an intake-only run has none)."""
        if self.output_dir is None:
            raise RuntimeError("a step after intake ran without an output dir")
        return self.output_dir

    def plan_json(self, plan: QuantPlan) -> PlanJson:
        """The approved plan as quant_plan.json holds it, serialised once for the checks after execute."""
        if self._plan_json is None:
            self._plan_json = plan.as_json()
        return self._plan_json

    def tier1_lacks_text(self, tier: str | None) -> bool:
        """Would ``tier`` (None: not chosen yet) score text and have none? Every question about Tier 1's
        text in the run asks this, with the evaluation options as they stand now (``--offline`` is
        in the contexts once the run starts: ``Recipe`` runs again offline when they say so)."""
        return tier1_lacks_text(tier, self.opts.eval.eval_data, self.ctx.offline)

    def refuse_without_tier1_text(self, tier: str | None) -> None:
        refuse_without_tier1_text(tier, self.opts.eval.eval_data, self.ctx.offline)
