"""The recipe as Python functions over typed artifacts (the CLI is a thin layer over these).

    from quark_ptq_eval import run, CallbackApprover
    summary = run("path/to/model", "out/", workdir="work/", scheme="int8", calib_data="calib.txt",
                  approver=CallbackApprover(lambda gate, summary: gate.name != "eval"))

Each step also works alone: ``analyze_model`` -> ``ModelAnalysis``, ``plan_quantization`` ->
``QuantPlan``, ``build_manifest`` -> ``RunManifest``, ``execute_plan``; ``validate_model`` and
``evaluate_model`` take model directories. (Names differ from the phase packages they call.)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.artifacts import ModelAnalysis, PlanJson, QuantPlan, RunManifest
from quark_ptq_eval.base.gates import Approver, FlagApprover
from quark_ptq_eval.flows.recipe.run_options import run_options

if TYPE_CHECKING:
    from quark_ptq_eval.context.preflight import HostEnv
    from quark_ptq_eval.flows.recipe.summary import RunSummary

__all__ = ["analyze_model", "build_manifest", "compare", "evaluate_model", "execute_plan", "plan_quantization", "run",
           "run_options", "validate_model"]


def analyze_model(model: str | Path, *, offline: bool = False, trust_remote_code: bool = False,
           workdir: str | Path | None = None) -> ModelAnalysis:
    from quark_ptq_eval.base.catalog import load_catalog
    from quark_ptq_eval.intake import analyze_model as _analyze

    analysis = _analyze(str(model), offline=offline, catalog=load_catalog(), trust_remote_code=trust_remote_code)
    if workdir is not None:
        analysis.write(workdir)
    return analysis


def plan_quantization(analysis: ModelAnalysis, output_dir: str | Path, *, env_context: HostEnv | None = None,
         workdir: str | Path | None = None, **request: Any) -> QuantPlan:
    """``request`` takes PlanRequest fields: goal, scheme, algorithm, calib_data, exclude_layers, ..."""
    from quark_ptq_eval.base.catalog import load_catalog
    from quark_ptq_eval.context.preflight import detect_env
    from quark_ptq_eval.flows.recipe.plan_scan import plan_from_request
    from quark_ptq_eval.plan import PlanRequest, make_plan

    wd = Path(workdir or ".")
    req = PlanRequest(**request)
    env = env_context or detect_env()

    def replan(r: PlanRequest) -> QuantPlan:
        return make_plan(analysis, env, r, load_catalog(), ModelAnalysis.path_in(wd).resolve(),
                         Path(output_dir).resolve())

    result = plan_from_request(req, replan, wd.resolve())  # --sensitivity or a budget: the scans run here
    if workdir is not None:
        result.write(workdir)
    return result


def build_manifest(quant_plan: QuantPlan, workdir: str | Path, *, offline: bool = False) -> RunManifest:
    from quark_ptq_eval.base.catalog import quark_version
    from quark_ptq_eval.manifest import build_manifest as _build

    wd = Path(workdir).resolve()
    result = _build(quant_plan, wd, Path(quant_plan.output_dir), offline=offline, engine_version=quark_version())
    result.write(wd)
    return result


def run(model: str | Path | None, output_dir: str | Path | None, *, workdir: str | Path = ".",
        approver: Approver | None = None, stop_after: str | None = None, quiet: bool = True,
        **options: Any) -> RunSummary:
    """The whole recipe (or up to ``stop_after``: intake, plan, manifest, execute). Raises
    ``CheckpointPending`` at a gate the approver refuses; call again to resume. ``options``: the
    RunOptions fields (eval_tier, offline, overwrite, no_load_check, base_model, ...), ``eval_options`` (a dict of
    EvalOptions fields) and, every other keyword, a PlanRequest field (scheme, calib_data, ...)."""
    from quark_ptq_eval.base.ui import Reporter
    from quark_ptq_eval.flows.recipe.pipeline import run_recipe
    from quark_ptq_eval.flows.recipe.remedies_side import after_own_eval

    return run_recipe(run_options(model, output_dir, options), workdir, approver or FlagApprover(),
                      Reporter(quiet=quiet), stop_after, after_own_eval)


def execute_plan(workdir: str | Path, *, approver: Approver | None = None, quiet: bool = True) -> RunSummary:
    """Run the approved manifest of an earlier ``run`` in ``workdir`` (Phase 1 step 4)."""
    return run(None, None, workdir=workdir, approver=approver, stop_after="execute", quiet=quiet)


def validate_model(source: str | Path, quantized: str | Path, quant_plan: QuantPlan | PlanJson | None = None,
                   **kwargs: Any):
    from quark_ptq_eval.validate import validate_model as _validate

    plan_json = quant_plan.as_json() if isinstance(quant_plan, QuantPlan) else quant_plan
    return _validate(Path(source), Path(quantized), plan_json, **kwargs)


def evaluate_model(model_dir: str | Path, workdir: str | Path = ".", *, approver: Approver | None = None,
             source_model: str | Path | None = None, **options: Any):
    """``options``: EvalOptions fields (tier, eval_data, seq_len, baseline, thresholds, ...); an unknown one is refused."""
    from quark_ptq_eval.base.options import build, check_names
    from quark_ptq_eval.evaluate import EvalOptions
    from quark_ptq_eval.evaluate import evaluate as _evaluate

    check_names(EvalOptions, options, "evaluation")
    return _evaluate(Path(model_dir), build(EvalOptions, options), Path(workdir), approver or FlagApprover(),
                     source_model=Path(source_model) if source_model else None)


def compare(model: str | Path | None, schemes: list[str] | str | None, out_root: str | Path, **kwargs: Any):
    """Compare schemes in one run (see ``quark_ptq_eval.flows.compare.compare``): one intake, the plans
    approved together, each scheme quantized, validated and evaluated against a baseline evaluated
    once; returns comparison.json's content."""
    from quark_ptq_eval.flows.compare import compare as _compare

    return _compare(model, schemes, out_root, **kwargs)
