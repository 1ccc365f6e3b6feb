"""Paired significance between two models' per-document scores (Tiers 2 and 3, compare --tasks),
and lm-eval's standard errors as the verdict's noise."""

from __future__ import annotations

import math
from typing import Any

from quark_ptq_eval.evaluate.details import MetricNoise, Noise

BOOTSTRAP_ITERS = 10_000
ALPHA = 0.05


def mcnemar(b: int, c: int) -> dict[str, float]:
    """McNemar's exact test on the discordant pairs: ``b`` documents right for the baseline only,
    ``c`` right for the scheme only. Under H0 each discordant pair is a fair coin, so with n = b + c
    the two-sided exact p is 2·P(X <= min(b, c)) (capped at 1) and the mid-p subtracts P(X = min)."""
    n, k = b + c, min(b, c)
    if n == 0:
        return {"p_value": 1.0, "mid_p_value": 1.0}
    pmf = [math.comb(n, i) / 2**n for i in range(k + 1)]
    tail = sum(pmf)
    return {"p_value": min(1.0, 2 * tail), "mid_p_value": min(1.0, 2 * tail - pmf[k])}


def paired_bootstrap(base: list[float], ours: list[float], iters: int = BOOTSTRAP_ITERS, seed: int = 0) -> float:
    """Two-sided p of the paired mean difference: resample documents, count resampled differences at
    least as far from the observed one as the observed one is from 0 (the shifted-null bootstrap)."""
    import numpy as np

    diffs = np.asarray(ours, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    n = diffs.size
    if n == 0:
        return 1.0
    observed = float(diffs.mean())
    if observed == 0 and np.all(diffs == 0):
        return 1.0
    rng, far, done = np.random.default_rng(seed), 0, 0
    chunk = max(1, 2**22 // n)  # resamples drawn at once (memory bound)
    while done < iters:
        m = min(chunk, iters - done)
        means = diffs[rng.integers(0, n, size=(m, n))].mean(axis=1)
        far += int(np.count_nonzero(np.abs(means - observed) >= abs(observed)))
        done += m
    return (far + 1) / (iters + 1)


def paired_tests(baseline: dict[str, Any], quantized: dict[str, Any], directions: dict[str, Any] | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """Per task and metric, the paired test between two per-sample score sets (per_sample_scores):
    McNemar (exact mid-p) where every score is 0/1, else a paired bootstrap of the mean difference."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for task, metrics in quantized.items():
        for metric, ours in metrics.items():
            theirs = (baseline.get(task) or {}).get(metric) or {}
            docs = sorted(set(ours) & set(theirs), key=lambda d: (len(d), d))
            if not docs:
                continue
            q, b = [ours[d] for d in docs], [theirs[d] for d in docs]
            entry: dict[str, Any] = {"documents": len(docs), "baseline_mean": sum(b) / len(b),
                                     "mean": sum(q) / len(q), "higher_is_better": (directions or {}).get(task, {}).get(metric)}
            if all(v in (0.0, 1.0) for v in q + b):
                lost = sum(1 for x, y in zip(b, q, strict=True) if x == 1 and y == 0)
                gained = sum(1 for x, y in zip(b, q, strict=True) if x == 0 and y == 1)
                exact = mcnemar(lost, gained)
                entry.update(test="McNemar exact (mid-p)", baseline_only=lost, scheme_only=gained,
                             p_value=exact["mid_p_value"], exact_p_value=exact["p_value"])
            else:
                entry.update(test=f"paired bootstrap ({BOOTSTRAP_ITERS} resamples)", p_value=paired_bootstrap(b, q))
            entry["significant"] = entry["p_value"] < ALPHA
            out.setdefault(task, {})[metric] = entry
    return out


def noise_from_stderr(quantized: dict[str, Any], baseline: dict[str, Any] | None) -> Noise:
    """lm-eval's standard errors as the verdict's noise input: {task: {metric: its stderr, baseline_stderr}}."""
    noise: Noise = {}
    for task, metrics in quantized.items():
        for metric, se in metrics.items():
            other = (baseline or {}).get(task, {}).get(metric)
            noise.setdefault(task, {})[metric] = MetricNoise(stderr=se, baseline_stderr=other)
    return noise
