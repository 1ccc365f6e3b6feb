"""``validate_model``: the registry's checks, cheapest first, over a source and its quantized output."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, Unpack

from quark_ptq_eval.base.artifacts import PlanJson
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.validate.load_sample import DEFAULT_BUDGET_S
from quark_ptq_eval.validate.registry import CheckInputs, Progress, read_config_or_empty
from quark_ptq_eval.validate.report import CheckResult, ValidationReport

DEFAULT_EXCLUDE = ["lm_head"]


@dataclass(frozen=True)
class ValidateOptions:
    """How to validate. ``max_samples`` / ``seed``: the tensors compared byte for byte (None: all),
    on ``workers`` threads; ``progress(check, done, total)`` is called as checks finish and as tensor
    bytes are compared. ``load_check`` adds the load-and-run check (imports torch and transformers;
    seconds on a small model; without it the report says it was skipped). ``vllm_python`` names the
    serving check's vLLM interpreter (servecheck.py), ``vllm_args`` the user's server arguments over
    the sized ones (runtime/vllm_sizing.py)."""

    max_samples: int | None = None
    seed: int = 0
    workers: int | None = None
    progress: Progress | None = None
    load_check: bool = False
    load_budget_s: float | None = DEFAULT_BUDGET_S  # the streamed load check's blocks (load_sample.py; 0: all)
    vllm_python: Path | None = None
    vllm_args: tuple[str, ...] = ()


class ValidateKeywords(TypedDict, total=False):
    """ValidateOptions' fields, given to validate_model by keyword (a test holds the two alike)."""

    max_samples: int | None
    seed: int
    workers: int | None
    progress: Progress | None
    load_check: bool
    load_budget_s: float | None
    vllm_python: Path | None
    vllm_args: tuple[str, ...]


def validate_model(source: Path | None, quantized: Path, plan: PlanJson | None = None,
                   options: ValidateOptions | None = None, **given: Unpack[ValidateKeywords]) -> ValidationReport:
    """Validate ``quantized`` against ``source`` (and ``plan`` when given); never raises on a mismatch.

    ``given``: ValidateOptions fields by keyword (``load_check=True``, ``max_samples=8``, ...), over
    ``options``. Raises :class:`UsageError` only for unusable arguments (a directory that does not exist).
    """
    from quark_ptq_eval.validate.checks import CHECKS

    t0 = time.perf_counter()
    opts = dataclasses.replace(options or ValidateOptions(), **given)
    source, quantized = _existing_dir(source, "source model"), _existing_dir(quantized, "quantized model")
    if opts.max_samples is not None and opts.max_samples < 1:
        raise UsageError(f"--max-samples must be at least 1, not {opts.max_samples}.")
    progress = opts.progress
    plan_read: dict[str, Any] | None = dict(plan) if plan is not None else None  # the checks read it as JSON
    ctx = CheckInputs(source, quantized, plan_read, max_samples=opts.max_samples, seed=opts.seed,
                            workers=opts.workers, load_check=opts.load_check,
                            load_budget_s=opts.load_budget_s, vllm_python=opts.vllm_python,
                            vllm_args=tuple(opts.vllm_args), progress=progress)
    ctx.src_config, ctx.out_config = read_config_or_empty(source), read_config_or_empty(quantized)
    ctx.exclude, ctx.exclusions_from = _exclusions(plan_read, ctx.qconfig)
    ctx.read_headers()
    notify = progress or (lambda check, done, total: None)
    results = []
    for i, check in enumerate(CHECKS.values(), 1):
        started = time.perf_counter()
        result = check.execute(ctx)
        result.seconds, result.title, result.advisory = time.perf_counter() - started, check.title, check.advisory
        result.structural, result.next_action, result.fixable = check.structural, check.next_action, check.fixable
        results.append(result)
        if check.structural and result.status == "fail":
            ctx.shared.structural_failed = True
            ctx.shared.unloadable |= check.unloadable_when_failed and not _only_truncation(ctx, result)
        notify(check.name, i, len(CHECKS))
    return ValidationReport(source, quantized, results, exclude_patterns=ctx.exclude, exclusions_from=ctx.exclusions_from,
                            seconds=time.perf_counter() - t0,
                            structural=tuple(c.name for c in CHECKS.values() if c.structural))


def _only_truncation(ctx: CheckInputs, result: CheckResult) -> bool:
    """Every failure is a truncated shard: the load check still runs on the blocks whose bytes are all there."""
    cut = {path.name for path in ctx.truncated}
    return bool(cut) and all(f.subject in cut for f in result.findings if not f.benign)


def _existing_dir(path: Path | str | None, what: str) -> Path:
    if path is None:
        raise UsageError(f"Validation needs the {what} as a local directory.",
                         "Pass --source with the directory of the model that was quantized.")
    path = Path(path).expanduser()
    if not path.is_dir():
        raise UsageError(f"The {what} directory {path} does not exist.", "Pass the directory that holds config.json.")
    return path.resolve()


def _exclusions(plan: dict[str, Any] | None, qconfig: dict[str, Any] | None) -> tuple[list[str], str]:
    """The plan's exclusions when given; else what Quark wrote; else the recipe's default."""
    if plan is not None and isinstance(plan.get("exclude_layers"), list):
        return [str(p) for p in plan["exclude_layers"]], "plan"
    if qconfig is not None and isinstance(qconfig.get("exclude"), list):
        return [str(p) for p in qconfig["exclude"]], "quantization_config"
    return list(DEFAULT_EXCLUDE), "default"
