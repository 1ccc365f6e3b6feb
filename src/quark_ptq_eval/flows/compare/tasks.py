"""Tier 2 in a comparison: lm-eval task scores per scheme, with a paired test per task and metric
against the baseline's per-document results (evaluated once and cached, like Tier 1's baseline).

Per document lm-eval logs each metric's score (``log_samples``); for 0/1 metrics (acc, acc_norm,
exact_match) the test is McNemar's exact mid-p on the documents the two models disagree on, for
other per-document scores a paired bootstrap of the mean difference. Metrics lm-eval only
aggregates (a rolling perplexity's per-document likelihood/length pairs) are reported with their
scores and no test. The scheme's lm-eval output is kept in its work dir (lm_eval_results/quantized.json
and .samples.json) and its scores in ``TASKS_FILE``. All of it goes through the interface of the tier
that scores tasks in this process (``context.task_scorer()``), as Tier 1's through ``text_scorer()``.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.fsio import read_json, write_json
from quark_ptq_eval.base.options import Part
from quark_ptq_eval.base.state import digest
from quark_ptq_eval.evaluate.context import TierInputs, task_scorer
from quark_ptq_eval.evaluate.options import EvalOptions
from quark_ptq_eval.evaluate.tiers import task_tier
from quark_ptq_eval.flows.compare.options import CompareOptions

TASK_RUN = Part(EvalOptions, concerns=("compute", "tasks"))  # lm-eval's options: the tasks', on the Tier 1 device

TASKS_FILE = "compare_tasks.json"  # in each scheme's work dir
CACHE_PREFIX = "lm_eval-"


def eval_options(opts: CompareOptions) -> EvalOptions:
    return EvalOptions(tier=task_tier().name, trust_remote_code=bool(opts.plan.get("trust_remote_code")),
                       **TASK_RUN.values(opts.eval))


def _include_hash(include_path: str | Path | None) -> str | None:
    """Local task YAMLs and their data decide the documents: hash their bytes."""
    if not include_path:
        return None
    h = hashlib.sha256()
    for path in sorted(p for p in Path(include_path).rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(include_path)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_key(opts: CompareOptions, model_digest: str) -> str:
    return digest({"model": model_digest, "tasks": list(opts.eval.tasks), "include": _include_hash(opts.eval.include_path),
                   "limit": opts.eval.limit, "num_fewshot": opts.eval.num_fewshot, "lm_eval": _lm_eval_version()})


def _lm_eval_version() -> str | None:
    """From the installed metadata: importing lm_eval for its version costs seconds."""
    import importlib.metadata

    try:
        return importlib.metadata.version("lm_eval")
    except importlib.metadata.PackageNotFoundError:
        return None


def check(opts: CompareOptions) -> None:
    """Unknown tasks fail before any model runs."""
    scorer = task_scorer()
    scorer.check_tasks(scorer.task_manager(Path(opts.eval.include_path) if opts.eval.include_path else None),
                       list(opts.eval.tasks))


def baseline_tasks(cache_root: Path, opts: CompareOptions, source: Path, model_digest: str, log) -> dict:
    """The baseline's lm-eval results and per-document scores: read from the cache, or run once."""
    from quark_ptq_eval.runtime.loading import load_model

    scorer = task_scorer()
    where = cache_root / f"{CACHE_PREFIX}{cache_key(opts, model_digest)}"
    results_file = where / "lm_eval_results" / "baseline.json"
    if results_file.is_file() and scorer.samples_path(where, "baseline").is_file():
        log(f"baseline tasks: cache hit {where.name}")
        results = read_json(results_file, "baseline lm-eval results")
        results["per_sample"] = read_json(scorer.samples_path(where, "baseline"), "baseline per-sample scores")
        return results
    loaded = load_model(source, opts.eval.device, bool(opts.plan.get("trust_remote_code")))
    ctx = TierInputs(source, eval_options(opts), where, None, source, None, log)
    results = scorer.evaluate_tasks(loaded, ctx, list(opts.eval.tasks), "baseline")
    loaded.model = None  # free it before the scheme's model loads
    return results


def score_scheme(loaded, workdir: Path, model_dir: Path, opts: CompareOptions, base: dict, log) -> dict[str, Any]:
    """lm-eval on the scheme's loaded model, its scores against the baseline's and the paired tests;
    written to the scheme's work dir (TASKS_FILE) and returned."""
    scorer = task_scorer()
    ctx = TierInputs(model_dir, eval_options(opts), workdir, None, None, None, log)
    results = scorer.evaluate_tasks(loaded, ctx, list(opts.eval.tasks), "quantized")
    scores, _, directions = scorer.scores_from(results)
    base_scores, _, base_dirs = scorer.scores_from(base)
    directions = {t: {**base_dirs.get(t, {}), **m} for t, m in {**base_dirs, **directions}.items()}
    tests = scorer.paired_tests(base["per_sample"], results["per_sample"], directions)
    rows = []
    for task, metrics in scores.items():
        for metric, value in metrics.items():
            other = base_scores.get(task, {}).get(metric)
            test = tests.get(task, {}).get(metric, {})
            rows.append({"task": task, "metric": metric, "score": value, "baseline": other,
                         "higher_is_better": directions.get(task, {}).get(metric),
                         "drop_pct": drop_pct(value, other, directions.get(task, {}).get(metric)),
                         "test": test.get("test"), "p_value": test.get("p_value"),
                         "exact_p_value": test.get("exact_p_value"), "significant": test.get("significant"),
                         "documents": test.get("documents"), "baseline_only": test.get("baseline_only"),
                         "scheme_only": test.get("scheme_only")})
    doc = {"tasks": list(opts.eval.tasks), "limit": opts.eval.limit, "num_fewshot": opts.eval.num_fewshot, "rows": rows}
    write_json(workdir / TASKS_FILE, doc)
    return doc


def drop_pct(value: float | None, baseline: float | None, higher_is_better: bool | None) -> float | None:
    """How much worse than the baseline, in percent of it (negative: better); None without a direction."""
    from quark_ptq_eval.evaluate.verdict import degradation_pct

    if value is None or baseline is None or higher_is_better is None:
        return None
    pct = degradation_pct(value, baseline, higher_is_better)
    return pct if pct is not None and math.isfinite(pct) else None  # from zero there is no scale to measure by


def read_rows(workdir: Path) -> list[dict] | None:
    path = workdir / TASKS_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))["rows"]
    except (OSError, ValueError, KeyError):
        raise UsageError(f"{path} is damaged.", "Delete it and re-run compare to score the tasks again.") from None


def worst_drop(rows: list[dict] | None) -> float | None:
    """The largest drop over every task metric with a direction: what --max-task-drop-pct limits."""
    drops = [r["drop_pct"] for r in rows or [] if r.get("drop_pct") is not None]
    return max(drops) if drops else None
