"""Direction-aware comparison of quantized scores with a baseline or a published reference.

Every judged metric gets one of ``healthy``, ``watch``, ``hurt``, ``unknown`` (nothing to compare
with) or ``invalid`` (missing or not a number). When the tier measured its sampling noise (a
paired per-window interval in Tier 1, lm-eval's standard errors in Tier 2), the verdict uses the
95 % interval of the degradation: ``healthy`` only when even its upper end is within the healthy
threshold, ``hurt`` only when the point estimate is past the hurt threshold and the worsening is
beyond noise, ``watch`` otherwise.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from quark_ptq_eval.evaluate.details import MetricNoise, Noise, Required, noise_of
from quark_ptq_eval.evaluate.options import Thresholds

# Metric-name fragments whose value goes down when the model gets better.
LOWER_IS_BETTER = ("perplexity", "kl_divergence", "bits_per_byte", "loss", "nll")
VERDICT_ORDER = ("unknown", "healthy", "watch", "hurt", "invalid")  # worst last
# Metrics that describe the model itself: compared with a fixed ideal rather than a second model.
IDEAL_VALUES = {"kl_divergence": 0.0}
Z95 = 1.959963984540054
WITHIN_NOISE, BEYOND_NOISE = "within noise", "beyond noise"
_EXP_MAX = 709.0  # math.exp overflows a float just above 709.78


@dataclass
class MetricVerdict:
    """One metric of one task against its comparison point (baseline, reference or ideal), with its verdict."""

    task: str
    metric: str
    value: float
    compared_to: str | None  # "baseline", "reference", "ideal" or None
    other: float | None
    higher_is_better: bool
    degradation_pct: float | None  # > 0: worse than the comparison point, direction-aware
    verdict: str
    ci95_pct: tuple[float, float] | None = None  # 95 % interval of degradation_pct (sampling noise)
    noise: str | None = None  # "within noise" (interval holds 0), "beyond noise", None: not measured
    note: str | None = None  # why the verdict is invalid, or why a noisy one is only "watch"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def safe_exp(x: float) -> float:
    """``math.exp`` that returns inf instead of raising OverflowError (log-space results stay finite)."""
    return math.inf if x > _EXP_MAX else math.exp(x)


def safe_expm1(x: float) -> float:
    return math.inf if x > _EXP_MAX else math.expm1(x)


def is_higher_better(metric: str, known: dict[str, bool] | None = None) -> bool:
    if known and metric in known:
        return bool(known[metric])
    base = metric.split(",")[0].lower()
    return not any(fragment in base for fragment in LOWER_IS_BETTER)


def degradation_pct(value: float, other: float, higher_is_better: bool) -> float | None:
    """How much worse ``value`` is than ``other``, in percent of ``other`` (negative: better).

    An infinite ``value`` in the worse direction (an overflowing perplexity) is infinitely worse.
    """
    if math.isnan(value) or not math.isfinite(other):
        return None
    change = (other - value) if higher_is_better else (value - other)
    if other == 0:
        return 0.0 if change == 0 else math.copysign(math.inf, change)
    return 100.0 * change / abs(other)


def classify(degradation: float | None, thresholds: Thresholds) -> str:
    if degradation is None:
        return "unknown"
    if degradation <= thresholds.healthy_pct:
        return "healthy"
    return "watch" if degradation <= thresholds.hurt_pct else "hurt"


def judge(
    degradation: float | None, interval: tuple[float, float] | None, thresholds: Thresholds
) -> tuple[str, str | None, str | None]:
    """(verdict, noise label, note) from the point estimate and, when measured, its 95 % interval."""
    if degradation is None or interval is None:
        return classify(degradation, thresholds), None, None
    low, high = interval
    noise = WITHIN_NOISE if low <= 0 <= high else BEYOND_NOISE
    if high <= thresholds.healthy_pct:
        return "healthy", noise, None
    if degradation > thresholds.hurt_pct and low > 0:
        return "hurt", noise, None
    if degradation <= thresholds.healthy_pct:
        note = (
            f"the 95 % interval reaches {high:+.2f} %: too little data to call it healthy "
            f"(healthy: at most {thresholds.healthy_pct:g} % worse)"
        )
    elif low <= 0:
        hurt = degradation > thresholds.hurt_pct
        note = f"the difference is within noise: too little data to call it {'hurt' if hurt else 'healthy or hurt'}"
    else:
        note = None
    return "watch", noise, note


def _invalid(task: str, metric: str, value: float, higher: bool, why: str, **kw: Any) -> MetricVerdict:
    return MetricVerdict(task, metric, value, None, None, higher, None, "invalid", note=why, **kw)


def _bad_value(value: float | None, higher_is_better: bool) -> str | None:
    """Why ``value`` cannot be judged, or None. Only an infinity in the worse direction is a result."""
    if value is None:
        return "missing from the quantized results"
    if math.isnan(value):
        return "not a number (NaN)"
    if math.isinf(value) and (value > 0) == higher_is_better:
        return f"not finite ({value})"
    return None


@dataclass(frozen=True)
class Observed:
    """One metric as measured: the quantized model's value, the baseline's and a published reference
    (None: not known), and the tier's noise estimate of it (standard errors, paired deltas)."""

    value: float | None
    baseline: float | None = None
    reference: float | None = None
    noise: MetricNoise | None = None

    def __post_init__(self) -> None:  # the noise may come as the dict a document holds
        object.__setattr__(self, "noise", MetricNoise.of(self.noise))


@dataclass(frozen=True)
class TierEvidence:
    """What a tier knows about its metrics beyond their values: those reported without a verdict,
    each metric's noise (task -> metric -> noise) and the metrics it must have returned."""

    informational: tuple[str, ...] = ("top1_agreement",)
    noise: Noise | None = None
    required: Required | None = None

    def __post_init__(self) -> None:  # the noise may come as the dicts a document holds
        object.__setattr__(self, "noise", noise_of(self.noise))


def compare_metric(
    task: str,
    metric: str,
    value: float | None,
    baseline: float | None,
    reference: float | None,
    higher_is_better: bool,
    thresholds: Thresholds,
) -> MetricVerdict:
    """``judge_metric`` of a value measured without a noise estimate."""
    return judge_metric(task, metric, Observed(value, baseline, reference), higher_is_better, thresholds)


def judge_metric(
    task: str, metric: str, observed: Observed, higher_is_better: bool, thresholds: Thresholds
) -> MetricVerdict:
    """The baseline (same settings, exact) wins over a reference (published, approximate)."""
    value, baseline, reference, noise = observed.value, observed.baseline, observed.reference, observed.noise
    bad = _bad_value(value, higher_is_better)
    if bad:
        return _invalid(task, metric, math.nan if value is None else value, higher_is_better, bad)
    assert value is not None  # _bad_value said why a missing value cannot be judged
    if metric in IDEAL_VALUES:
        # KL is 0 for the baseline itself: exp(KL) is the factor by which the quantized model's
        # perplexity on text drawn from the baseline exceeds the baseline's own.
        worse: float | None = 100.0 * safe_expm1(value)
        interval = _ideal_interval(value, noise)
        verdict, label, note = judge(worse, interval, thresholds)
        return MetricVerdict(
            task, metric, value, "ideal", IDEAL_VALUES[metric], False, worse, verdict, interval, label, note
        )
    for label, other in (("baseline", baseline), ("reference", reference)):
        if other is None:
            continue
        if not math.isfinite(other):
            return _invalid(task, metric, value, higher_is_better, f"the {label} value is not finite ({other})")
        worse = degradation_pct(value, other, higher_is_better)
        interval = _interval(value, other, label, higher_is_better, worse, noise)
        verdict, noise_label, note = judge(worse, interval, thresholds)
        return MetricVerdict(
            task, metric, value, label, other, higher_is_better, worse, verdict, interval, noise_label, note
        )
    return MetricVerdict(task, metric, value, None, None, higher_is_better, None, "unknown")


def _finite(noise: MetricNoise | None, key: str) -> float | None:
    value = noise.get(key) if noise is not None else None
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _ideal_interval(value: float, noise: MetricNoise | None) -> tuple[float, float] | None:
    se = _finite(noise, "stderr")
    if se is None:
        return None
    return 100.0 * safe_expm1(value - Z95 * se), 100.0 * safe_expm1(value + Z95 * se)


def _log_interval(delta: float, se: float, higher_is_better: bool) -> tuple[float, float]:
    """Degradation interval from log(value / other) and its standard error."""
    low, high = safe_expm1(delta - Z95 * se), safe_expm1(delta + Z95 * se)
    return (-100.0 * high, -100.0 * low) if higher_is_better else (100.0 * low, 100.0 * high)


def _interval(
    value: float, other: float, label: str, higher: bool, worse: float | None, noise: MetricNoise | None
) -> tuple[float, float] | None:
    """95 % interval of the degradation: paired when the tier measured it, else from standard errors."""
    baseline = label == "baseline"
    if worse is None or not noise:
        return None
    delta, paired_se = _finite(noise, "paired_log_delta"), _finite(noise, "paired_log_stderr")
    if baseline and delta is not None and paired_se is not None:
        return _log_interval(delta, paired_se, higher)
    log_se = _finite(noise, "log_stderr")
    if log_se is not None and value > 0 and other > 0:
        other_se = (_finite(noise, "baseline_log_stderr") or 0.0) if baseline else 0.0
        return _log_interval(math.log(value) - math.log(other), math.hypot(log_se, other_se), higher)
    se = _finite(noise, "stderr")
    if se is None or other == 0 or not math.isfinite(worse):
        return None
    other_se = (_finite(noise, "baseline_stderr") or 0.0) if baseline else 0.0
    half = 100.0 * Z95 * math.hypot(se, other_se) / abs(other)
    return worse - half, worse + half


def compare_all(
    quantized: dict[str, dict[str, float]],
    baseline: dict[str, dict[str, float]] | None,
    reference: dict[str, dict[str, float]],
    directions: dict[str, dict[str, bool]],
    thresholds: Thresholds,
    evidence: TierEvidence | None = None,
) -> list[MetricVerdict]:
    """One comparison per metric of the quantized model, of the baseline, and of ``required``.

    A metric the baseline has (or the tier requires) but the quantized results lack is ``invalid``;
    ``informational`` metrics are reported without a verdict unless they are not finite.
    """
    evidence = evidence or TierEvidence()
    informational, noise = evidence.informational, evidence.noise
    rows = []
    for task, metric, value in _metrics(quantized, baseline, evidence.required):
        higher = is_higher_better(metric, directions.get(task))
        if metric in informational:
            bad = _bad_value(value, higher) or (
                None if value is None or math.isfinite(value) else "not finite"
            )
            rows.append(
                _invalid(task, metric, math.nan if value is None else value, higher,
                         bad or "missing from the quantized results")
                if bad or value is None
                else MetricVerdict(task, metric, value, None, None, True, None, "info")
            )
            continue
        published = reference.get(task, {})
        rows.append(
            judge_metric(
                task,
                metric,
                Observed(
                    value,
                    (baseline or {}).get(task, {}).get(metric),
                    published.get(metric, published.get(metric.split(",")[0])),
                    (noise or {}).get(task, {}).get(metric),
                ),
                higher,
                thresholds,
            )
        )
    return rows


def _metrics(quantized: dict[str, dict[str, float]], baseline: dict[str, dict[str, float]] | None,
             required: dict[str, list[str]] | None) -> list[tuple[str, str, float | None]]:
    """(task, metric, quantized value or None) over the union of what was measured and required."""
    seen: dict[tuple[str, str], float | None] = {}
    for task, metrics in quantized.items():
        for metric, value in metrics.items():
            seen[(task, metric)] = value
    sources: tuple[dict[str, Any], ...] = (baseline or {}, {t: dict.fromkeys(ms) for t, ms in (required or {}).items()})
    for source in sources:
        for task, metrics in source.items():
            for metric in metrics:
                seen.setdefault((task, metric), None)
    return [(task, metric, value) for (task, metric), value in seen.items()]


def overall_verdict(rows: list[MetricVerdict]) -> str:
    """``invalid`` when any metric is; else the worst judged verdict; ``unknown`` when none was judged."""
    judged = [r.verdict for r in rows if r.verdict in VERDICT_ORDER and r.verdict != "unknown"]
    if not judged:
        return "unknown"
    return max(judged, key=VERDICT_ORDER.index)


def invalid_reasons(rows: list[MetricVerdict]) -> list[str]:
    """``task:metric is <why>`` for every invalid row: what an ``invalid`` verdict names."""
    return [f"{r.task}:{r.metric} is {r.note}" for r in rows if r.verdict == "invalid"]
