"""Tier 2: the lm-eval library on the model loaded in this process (the right loader, no server).

The estimate counts the requests the chosen tasks will make and times a forward pass of that
shape on the real model (evaluate/lmeval/estimate.py); lm-eval's tasks, runs and results are in
evaluate/lmeval/tasks.py, the paired per-document tests in paired_tests.py. Their names stay importable here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.evaluate.context import (
    RuntimeEstimate,
    TaskScorer,
    TierInputs,
    TierOutcome,
    hardware_description,
)
from quark_ptq_eval.evaluate.details import TaskDetails
from quark_ptq_eval.evaluate.lmeval.estimate import (  # noqa: F401 - re-exported
    DEFAULT_GEN_TOKS,
    SAMPLE_DOCS,
    LmEvalWorkload,
    _clock,
    count_workload,
    pilot,
    resolution_warning,
)
from quark_ptq_eval.evaluate.lmeval.tasks import (  # noqa: F401 - re-exported
    LOG_NAME,
    RESULTS_DIR,
    check_tasks,
    evaluate_tasks,
    lm_eval_chatter_to,
    load_task_objects,
    per_sample_scores,
    samples_path,
    scores_from,
    task_manager,
)
from quark_ptq_eval.evaluate.paired_tests import (  # noqa: F401 - re-exported
    ALPHA,
    BOOTSTRAP_ITERS,
    mcnemar,
    noise_from_stderr,
    paired_bootstrap,
    paired_tests,
)
from quark_ptq_eval.evaluate.ppl.kld_report import num as _num
from quark_ptq_eval.runtime.loading import LoadedModel, load_model, model_size_bytes

if TYPE_CHECKING:
    from quark_ptq_eval.evaluate.eval_report import EvalReport

__all__ = ["ALPHA", "BOOTSTRAP_ITERS", "DEFAULT_GEN_TOKS", "LOG_NAME", "RESULTS_DIR", "SAMPLE_DOCS", "LmEvalPrepared",
           "LmEvalWorkload", "check_tasks", "count_workload", "evaluate_tasks", "lm_eval_chatter_to", "load_task_objects",
           "mcnemar", "noise_from_stderr", "paired_bootstrap", "paired_tests", "per_sample_scores", "pilot", "prepare",
           "resolution_warning", "score", "samples_path", "scores_from", "section", "task_manager"]


@dataclass
class LmEvalPrepared:
    ctx: TierInputs
    quantized: LoadedModel
    task_names: list[str]
    workload: LmEvalWorkload
    estimate: RuntimeEstimate
    pilot_s: float


def prepare(ctx: TierInputs) -> LmEvalPrepared:
    options = ctx.options
    manager = task_manager(options.include_path)
    tasks = check_tasks(manager, options.tasks)
    started = time.perf_counter()
    task_objects = load_task_objects(manager, tasks)  # fails (offline, typos) before any model loads
    task_setup_s = time.perf_counter() - started  # lm-eval pays it again for every model it evaluates
    quantized = load_model(ctx.model_dir, options.device, options.trust_remote_code)
    ctx.log(f"loaded {ctx.model_dir} with the {quantized.loader} loader ({quantized.loader_reason})")
    workload = count_workload(task_objects, quantized.tokenizer, options)
    batch_size = options.batch_size or 1
    per_ctx, per_gen, pilot_s = pilot(quantized, workload, batch_size)
    models = 2 if options.baseline else 1
    seconds = models * (
        task_setup_s + workload.context_tokens * per_ctx + workload.generated_tokens * per_gen
    )
    seconds += quantized.load_s * (models - 1)  # the baseline loads after the quantized run
    estimate = RuntimeEstimate(
        tier="2 (lm_eval)",
        seconds=seconds,
        hardware=hardware_description(quantized.device),
        model_bytes=quantized.size_bytes + (model_size_bytes(options.baseline) if options.baseline else 0),
        data=(
            f"{sum(workload.per_task.values()):,} documents ({', '.join(f'{k}: {v}' for k, v in workload.per_task.items())}), "
            f"~{workload.requests:,} requests, ~{workload.context_tokens:,} context tokens"
            + (f", up to {workload.generated_tokens:,} generated tokens" if workload.generated_tokens else "")
        ),
        basis=(
            f"pilot forward of {batch_size} x {max(8, workload.context_tokens // max(1, workload.requests))} tokens: "
            f"{1 / per_ctx:,.0f} tokens/s"
            + (f"; decoding {1 / per_gen:,.1f} tokens/s" if per_gen else "")
            + (" (x2 for the baseline)" if models == 2 else "")
        ),
        warning=(
            "Full lm-eval benchmarks can take hours; use --limit N for a smoke run."
            if options.limit is None
            else resolution_warning(workload, options)
        ),
        threshold_s=options.confirm_above_s,
    )
    return LmEvalPrepared(ctx, quantized, tasks, workload, estimate, pilot_s)


def run_lm_eval(loaded: LoadedModel, prepared: LmEvalPrepared, label: str) -> dict[str, Any]:
    return evaluate_tasks(loaded, prepared.ctx, prepared.task_names, label)


def score(prepared: LmEvalPrepared) -> TierOutcome:
    ctx = prepared.ctx
    quantized_results = run_lm_eval(prepared.quantized, prepared, "quantized")
    quantized, q_stderr, directions = scores_from(quantized_results)
    stderr = {"quantized": q_stderr}
    details = TaskDetails(stderr, prepared.workload.__dict__,
                          f"{prepared.quantized.loader} ({prepared.quantized.loader_reason})",
                          quantized_results.get("lm_eval_version"))
    artifacts = {"lm_eval quantized results": str(ctx.workdir / RESULTS_DIR / "quantized.json")}
    baseline = None
    if ctx.options.baseline:
        _release(prepared)
        base_model = load_model(ctx.options.baseline, ctx.options.device, ctx.options.trust_remote_code)
        baseline_results = run_lm_eval(base_model, prepared, "baseline")
        baseline, stderr["baseline"], _ = scores_from(baseline_results)
        details.paired_tests = paired_tests(baseline_results["per_sample"], quantized_results["per_sample"],
                                            directions)
        artifacts["lm_eval baseline results"] = str(ctx.workdir / RESULTS_DIR / "baseline.json")
    notes = list(prepared.workload.notes)
    for task, metrics in quantized.items():
        for metric, value in metrics.items():
            if not math.isfinite(value):
                notes.append(f"{task}:{metric} is not finite ({value}).")
    details.noise = noise_from_stderr(q_stderr, stderr.get("baseline"))
    # A task asked for that produced no score at all must not vanish from the verdict.
    details.required = {t: ["results"] for t in prepared.task_names if t not in quantized}
    return TierOutcome(
        quantized=quantized,
        baseline=baseline,
        directions=directions,
        details=details,
        notes=notes,
        artifacts=artifacts,
    )


def _release(prepared: LmEvalPrepared) -> None:
    """Free the quantized model before the baseline loads: only one model in memory at a time."""
    import gc

    prepared.quantized.model = None
    gc.collect()


def section(report: EvalReport) -> list[str]:
    """The report's Tier 2 section: lm-eval's standard errors and, with a baseline, the paired
    per-document tests."""
    details = report.details
    lines = []
    if "stderr" in details:
        lines += ["## Standard errors (lm-eval)", ""]
        for label, per_task in details["stderr"].items():
            for task, metrics in per_task.items():
                joined = ", ".join(f"{m} ± {_num(v)}" for m, v in metrics.items())
                lines.append(f"- {label} {task}: {joined}")
        lines.append("")
    return lines + _paired_lines(details.get("paired_tests"))


def _paired_lines(paired: dict[str, Any] | None) -> list[str]:
    """Tiers 2 and 3 with a baseline: the paired per-document test of each metric."""
    if not paired:
        return []
    lines = ["## Paired per-document tests (quantized vs baseline)", ""]
    for task, metrics in paired.items():
        for metric, t in metrics.items():
            lines.append(f"- {task} {metric}: {_num(t['mean'])} vs {_num(t['baseline_mean'])} over {t['documents']} "
                         f"documents, {t['test']} p = {t['p_value']:.3g}"
                         + (" (significant)" if t["significant"] else " (not significant)"))
    return [*lines, ""]


class LmEvalTier(TaskScorer):
    """Tier 2 as its registry row names it: the functions above, and what compare scores tasks through."""

    prepare = staticmethod(prepare)
    score = staticmethod(score)
    section = staticmethod(section)
    task_manager = staticmethod(task_manager)
    check_tasks = staticmethod(check_tasks)
    evaluate_tasks = staticmethod(evaluate_tasks)
    samples_path = staticmethod(samples_path)
    scores_from = staticmethod(scores_from)
    paired_tests = staticmethod(paired_tests)
