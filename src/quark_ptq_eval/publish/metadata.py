"""The card's metadata block, built with huggingface_hub's own types (``ModelCardData``,
``EvalResult``): what the Hub indexes (base model and relation, licence, tags, results)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCardData

from quark_ptq_eval.evaluate.tiers import TIERS
from quark_ptq_eval.publish.facts import RunFacts

LIBRARY = "transformers"  # transformers' Quark integration loads the export (and vLLM serves it)
PIPELINE = "text-generation"
BASE_SUFFIX = " (base model, unquantized)"  # the metric name of the base model's figure beside ours
# number formats a scheme name spells, as Hub tags: (pattern, tag), the first match wins
FORMAT_TAGS: tuple[tuple[str, str], ...] = (
    (r"mxfp4|^mx4", "mxfp4"), (r"mxfp6", "mxfp6"), (r"nvfp4", "nvfp4"), (r"fp8", "fp8"),
    (r"^u?int8|w8a8", "int8"), (r"^u?int4|w4a16", "int4"),
)


def card_data(facts: RunFacts, model_name: str) -> ModelCardData:
    base = facts.base
    data = ModelCardData(
        base_model=base.hub_id, library_name=LIBRARY, pipeline_tag=base.pipeline_tag or PIPELINE,
        tags=tags(facts), model_name=model_name, eval_results=eval_results(facts) or None,
        base_model_relation="quantized" if base.hub_id else None,
        **{k: v for k, v in base.carried.items() if k != "license"}, license=base.license,
    )
    return data


def tags(facts: RunFacts) -> list[str]:
    """quark, the scheme, its number format, the KV-cache scheme; then the base card's own tags."""
    scheme, kv = facts.plan.global_scheme, facts.plan.kv_cache_scheme
    fmt = next((tag for pattern, tag in FORMAT_TAGS if re.search(pattern, scheme)), None)
    ours = ["quark", scheme, *([fmt] if fmt else [])]
    if facts.plan.algorithm:
        ours += [a.strip() for a in str(facts.plan.algorithm).split(",") if a.strip()]
    if kv:
        ours.append(f"kv-cache-{kv}")
    return list(dict.fromkeys([*ours, *facts.base.tags]))


def eval_results(facts: RunFacts) -> list[EvalResult]:
    """One result per figure of eval_results.json: ours, then the base model's beside it."""
    ev = facts.evaluation
    if not ev:
        return []
    baseline = ev.get("baseline") or {}
    results = []
    for task, metrics in (ev.get("quantized") or {}).items():  # eval_results.json's order
        dataset_type, dataset_name = dataset_of(ev, task)
        for metric, value in metrics.items():
            if not _number(value):
                continue
            same = {"task_type": PIPELINE, "task_name": task, "dataset_type": dataset_type,
                    "dataset_name": dataset_name, "metric_type": metric}
            results.append(EvalResult(**same, metric_value=value, metric_name=metric))
            base_value = (baseline.get(task) or {}).get(metric)
            if _number(base_value):
                results.append(EvalResult(**same, metric_value=base_value, metric_name=metric + BASE_SUFFIX))
    return results


def dataset_of(ev: dict[str, Any], task: str) -> tuple[str, str]:
    """(type, name) of what a task scored: Tier 1's text (a local file by its name), else the lm-eval task."""
    data = (ev.get("settings") or {}).get("eval_data")
    scores_text = ev.get("tier") in TIERS.names() and TIERS[ev["tier"]].scores_text
    if not scores_text or not data:
        return task, task
    path = Path(str(data))
    return (path.stem, f"{path.name} (local text)") if path.is_absolute() else (str(data), str(data))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
