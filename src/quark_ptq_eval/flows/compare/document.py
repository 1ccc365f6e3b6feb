"""comparison.json's top level as a type: what ``compare()`` returns to the command line and to Python callers.

Its rows (a scheme's figures, the recommendation, the speed block) stay JSON objects: their keys are written and
documented in ``results.py`` (and docs/compare.md); this names the document's parts so a caller is told what it
holds, and the type checker sees a key that is not there."""

from __future__ import annotations

from typing import Any, TypedDict


class ComparisonDocument(TypedDict, total=False):
    schema: str
    model: str
    source_bytes: int
    source_params: int
    created_at: str
    settings: dict[str, Any]  # the evaluation's windows, seq_len, top_k, device, algorithm, tasks
    budget: dict[str, float]
    schemes: list[dict[str, Any]]  # one row per scheme (results.scheme_row)
    recommendation: dict[str, Any]
    pareto_front: dict[str, list[str]]
    speed: dict[str, Any] | None
    baseline_cache: dict[str, Any]
    artifacts: dict[str, str | None]
    cluster: dict[str, Any]  # compare --ray: the cluster the cells ran on


class SweepSummary(TypedDict):
    """sweep_summary.json: the grid's schemes and one entry per comparison (its status, report, schemes)."""

    schema: str
    schemes: list[str]
    comparisons: list[dict[str, Any]]
