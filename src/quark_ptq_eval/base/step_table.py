"""The recipe's steps, in order, written once.

``run``, ``resume`` and ``--stop-after`` follow this table; ``status`` lists it; the summary
collects its artifacts; the run manifest's step list is derived from it. The steps themselves are
functions in ``flows/``, called in this order by ``flows/recipe/pipeline.Recipe._steps`` (one call per row,
checked by tests/test_recipe_structure.py). Adding a step is one row here plus its function and its
call there (see docs/extending.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    name: str  # in --stop-after, run_state.json's "steps" and `status`
    title: str  # the headline shown when the step starts
    part: str  # the name of what it produced in the summary ("analysis", "plan", ...)
    artifacts: tuple[str, ...] = ()  # files it writes in the work dir
    gate: str | None = None  # the checkpoint that approves its outcome (asked by the flow)
    gate_before_stop: bool = False  # ask ``gate`` even when the run stops after this step
    timing: str | None = None  # ends this phase's clock (run_summary.json "timings_s")
    stops_plan_only: bool = False  # execution_mode plan_only ends the run here
    manifest_step: str | None = None  # its name in run_manifest.yaml's step list (None: not listed)
    command: bool = False  # `quark-ptq-eval <name>` runs the recipe up to here and stops


STEPS: tuple[Step, ...] = (
    Step("intake", "Phase 1 · step 1 — intake", "analysis", ("model_analysis.json",),
         gate="intake", manifest_step="analyze", command=True),
    Step("plan", "Phase 1 · step 2 — plan", "plan", ("quant_plan.json",),
         gate="plan", manifest_step="plan", command=True),
    Step("manifest", "Phase 1 · step 3 — manifest", "manifest", ("run_manifest.yaml",),
         timing="phase1_prepare", stops_plan_only=True, manifest_step="generate", command=True),
    Step("execute", "Phase 1 · step 4 — execute", "result",
         gate="result", gate_before_stop=True, timing="phase1_execute", manifest_step="run", command=True),
    Step("validate", "Phase 2 — validate", "validation",
         ("validation_report.md", "validation_report.json"), timing="phase2_validate", manifest_step="validate"),
    Step("eval", "Phase 3 — evaluate", "evaluation", ("eval_report.md", "eval_results.json"),
         timing="phase3_eval"),
    Step("card", "Publish — model card", "card"),  # README.md in the export (publish/)
)
STEP_NAMES: tuple[str, ...] = tuple(s.name for s in STEPS)
SUMMARY_FILE = "run_summary.json"
# CLI command -> the step it stops after (None: the whole recipe)
STOP_AFTER: dict[str, str | None] = {**{s.name: s.name for s in STEPS if s.command}, "run": None, "resume": None}


def artifact_files() -> tuple[str, ...]:
    """Every file the steps write in the work dir, in the recipe's order."""
    return tuple(a for s in STEPS for a in s.artifacts)
