"""Direction-aware comparison of quantized scores with a baseline or a published reference."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .options import Thresholds

# Metric-name fragments whose value goes down when the model gets better.
LOWER_IS_BETTER = ("perplexity", "kl_divergence", "bits_per_byte", "loss", "nll")
VERDICT_ORDER = ("unknown", "healthy", "watch", "hurt")  # worst last
# Metrics that describe the model itself: compared with a fixed ideal rather than a second model.
IDEAL_VALUES = {"kl_divergence": 0.0}


@dataclass
class Comparison:
    task: str
    metric: str
    value: float
    compared_to: str | None  # "baseline", "reference" or None
    other: float | None
    higher_is_better: bool
    degradation_pct: float | None  # > 0: worse than the comparison point, direction-aware
    verdict: str

    def as_dict(self) -> dict:
        return asdict(self)


def is_higher_better(metric: str, known: dict[str, bool] | None = None) -> bool:
    if known and metric in known:
        return bool(known[metric])
    base = metric.split(",")[0].lower()
    return not any(fragment in base for fragment in LOWER_IS_BETTER)


def degradation_pct(value: float, other: float, higher_is_better: bool) -> float | None:
    """How much worse ``value`` is than ``other``, in percent of ``other`` (negative: better)."""
    if other == 0 or not math.isfinite(other) or not math.isfinite(value):
        return None
    change = (other - value) if higher_is_better else (value - other)
    return 100.0 * change / abs(other)


def classify(degradation: float | None, thresholds: Thresholds) -> str:
    if degradation is None:
        return "unknown"
    if degradation <= thresholds.healthy_pct:
        return "healthy"
    return "watch" if degradation <= thresholds.hurt_pct else "hurt"


def compare_metric(
    task: str,
    metric: str,
    value: float,
    baseline: float | None,
    reference: float | None,
    higher_is_better: bool,
    thresholds: Thresholds,
) -> Comparison:
    """The baseline (same settings, exact) wins over a reference (published, approximate)."""
    if metric in IDEAL_VALUES:
        # KL is 0 for the baseline itself: exp(KL) is the factor by which the quantized model's
        # perplexity on text drawn from the baseline exceeds the baseline's own.
        worse = 100.0 * math.expm1(value) if math.isfinite(value) else None
        return Comparison(
            task, metric, value, "ideal", IDEAL_VALUES[metric], False, worse, classify(worse, thresholds)
        )
    for label, other in (("baseline", baseline), ("reference", reference)):
        if other is not None:
            worse = degradation_pct(value, other, higher_is_better)
            return Comparison(
                task, metric, value, label, other, higher_is_better, worse, classify(worse, thresholds)
            )
    return Comparison(task, metric, value, None, None, higher_is_better, None, "unknown")


def compare_all(
    quantized: dict[str, dict[str, float]],
    baseline: dict[str, dict[str, float]] | None,
    reference: dict[str, dict[str, float]],
    directions: dict[str, dict[str, bool]],
    thresholds: Thresholds,
    informational: tuple[str, ...] = ("top1_agreement",),
) -> list[Comparison]:
    """One comparison per quantized metric; ``informational`` metrics are reported without a verdict."""
    rows = []
    for task, metrics in quantized.items():
        for metric, value in metrics.items():
            if metric in informational:
                rows.append(Comparison(task, metric, value, None, None, True, None, "info"))
                continue
            published = reference.get(task, {})
            rows.append(
                compare_metric(
                    task,
                    metric,
                    value,
                    (baseline or {}).get(task, {}).get(metric),
                    published.get(metric, published.get(metric.split(",")[0])),
                    is_higher_better(metric, directions.get(task)),
                    thresholds,
                )
            )
    return rows


def overall_verdict(rows: list[Comparison]) -> str:
    """The worst verdict among metrics that have one; "unknown" when none could be compared."""
    judged = [r.verdict for r in rows if r.verdict in VERDICT_ORDER and r.verdict != "unknown"]
    if not judged:
        return "unknown"
    return max(judged, key=VERDICT_ORDER.index)
