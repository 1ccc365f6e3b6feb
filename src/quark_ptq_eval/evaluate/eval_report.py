"""What an evaluation produced (EvalReport): the type the report files are written from, kept
apart from the flow that builds it (api.py) and the writers that render it (report.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quark_ptq_eval.evaluate.context import RuntimeEstimate, Scores
from quark_ptq_eval.evaluate.options import Thresholds
from quark_ptq_eval.evaluate.verdict import MetricVerdict

REPORT_NAME = "eval_report.md"
RESULTS_NAME = "eval_results.json"


@dataclass
class EvalReport:
    tier: str
    model_dir: Path
    workdir: Path
    source_model: Path | None
    settings: dict[str, Any]
    thresholds: Thresholds
    quantized: Scores
    baseline: Scores | None
    reference: Scores
    comparisons: list[MetricVerdict]
    verdict: str
    remedies: list[str]
    estimate: RuntimeEstimate | None
    actual_s: float | None
    details: dict[str, Any] = field(default_factory=dict)
    deferred_commands: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    artifacts: dict[str, str] = field(default_factory=dict)
    chart_path: Path | None = None
    sensitivity: dict[str, Any] | None = None  # the plan's scan proposal: predicted vs measured KL
    verdict_qualifier: str | None = None  # e.g. "optimistic: scored on calibration text"

    @property
    def report_path(self) -> Path:
        return self.workdir / REPORT_NAME

    @property
    def results_path(self) -> Path:
        return self.workdir / RESULTS_NAME

    def one_line(self) -> str:
        scores = "; ".join(f"{t}:{m}={v:.4g}" for t, ms in self.quantized.items() for m, v in ms.items())
        qualified = f"{self.verdict} ({self.verdict_qualifier})" if self.verdict_qualifier else self.verdict
        return f"eval tier {self.tier}: verdict {qualified}" + (f" ({scores})" if scores else "")
