"""The speed tier's statistics: each metric's median over the repeats, its spread, the throughput gain
(median quantized / median baseline) and its 95 % interval, and what the server said about its memory.

The interval is Welch's t interval on log throughput (the repeats of the two servers are independent
samples; logs make the ratio a difference and the interval a ratio again): exp of
mean(log q) - mean(log b) +- t(0.975, Welch df) * sqrt(var(log q)/n_q + var(log b)/n_b). It bounds the
ratio of geometric means, which three to a few repeats' medians estimate too; with identical repeats it
has zero width.

Where the two servers are measured alternately (the speed tier with a baseline on a CPU vLLM: repeat i of each
on the same prompts, one right after the other), the repeats are pairs and a drift of the host hits both sides of
a pair: the interval is then the paired t interval on the pairs' log ratios, exp of
mean(log q_i - log b_i) +- t(0.975, n - 1) * sd(log q_i - log b_i) / sqrt(n) (``paired_gain``).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

# our name -> the key of vLLM's result JSON (--save-result, --metric-percentiles 50,99)
METRICS = {
    "output_tokens_per_s": "output_throughput",
    "requests_per_s": "request_throughput",
    "ttft_ms_p50": "p50_ttft_ms",
    "ttft_ms_p99": "p99_ttft_ms",
    "tpot_ms_p50": "p50_tpot_ms",
    "tpot_ms_p99": "p99_tpot_ms",
}
HIGHER_IS_BETTER = {m: m.endswith("_per_s") for m in METRICS}
CI_METHOD = ("Welch's t interval on log output tokens/s over the repeats (independent samples per server), "
             "exponentiated: a 95 % interval of the ratio of geometric means")
PAIRED_CI_METHOD = ("paired t interval on the log ratio of output tokens/s of each pair of repeats (quantized and "
                    "baseline alternately, on the same prompts), exponentiated: a 95 % interval of the geometric "
                    "mean ratio")
# vllm/v1/core/kv_cache_utils.py: "%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx"
_CAPACITY = re.compile(r"(\w[\w +]*?) KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per "
                       r"request: ([\d.]+)x")


def repeat_values(result: dict[str, Any], path: Path) -> dict[str, Any]:
    """One repeat's metrics from vLLM's own result JSON, and the file they were read from."""
    return {name: float(result[key]) for name, key in METRICS.items()} | {"result_file": str(path),
                                                                         "completed": result.get("completed")}


def read_result(path: Path) -> dict[str, Any]:
    """vLLM's own result JSON of one run."""
    result: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return result


def read_repeats(paths: list[Path]) -> list[dict[str, Any]]:
    return [repeat_values(read_result(p), p) for p in paths]


def summarize(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of every metric over the repeats, their spread ((max - min) / median, in %) and the repeats."""
    out: dict[str, Any] = {m: statistics.median(r[m] for r in repeats) for m in METRICS}
    out["spread_pct"] = {m: _spread([r[m] for r in repeats]) for m in METRICS}
    out["repeats"] = repeats
    return out


def _spread(values: list[float]) -> float | None:
    middle = statistics.median(values)
    return 100.0 * (max(values) - min(values)) / middle if middle else None


def gain(quantized: list[float], baseline: list[float]) -> tuple[float, tuple[float, float]]:
    """Median quantized over median baseline throughput, and its 95 % interval (module docstring)."""
    point = statistics.median(quantized) / statistics.median(baseline)
    lq, lb = [math.log(v) for v in quantized], [math.log(v) for v in baseline]
    vq, vb = statistics.variance(lq) / len(lq), statistics.variance(lb) / len(lb)
    centre = statistics.fmean(lq) - statistics.fmean(lb)
    if vq + vb == 0:
        return point, _exp_interval(centre, 0.0, 1.0)
    df = (vq + vb) ** 2 / (vq**2 / (len(lq) - 1) + vb**2 / (len(lb) - 1))
    return point, _exp_interval(centre, math.sqrt(vq + vb), df)


def paired_gain(quantized: list[float], baseline: list[float]) -> tuple[float, tuple[float, float]]:
    """Median quantized over median baseline throughput, and the paired 95 % interval of repeat i of each
    (measured one right after the other on the same prompts; module docstring). Needs two pairs or more."""
    if len(quantized) != len(baseline) or len(quantized) < 2:
        raise ValueError(f"a paired interval needs two or more pairs, not {len(quantized)} and {len(baseline)}")
    point = statistics.median(quantized) / statistics.median(baseline)
    diffs = [math.log(q) - math.log(b) for q, b in zip(quantized, baseline, strict=True)]
    return point, _exp_interval(statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs)),
                                len(diffs) - 1)


def _exp_interval(centre: float, se: float, df: float) -> tuple[float, float]:
    """exp(centre +- t(0.975, df) * se): a 95 % t interval on logs, as a ratio (zero width when se is 0)."""
    from scipy.stats import t

    half = float(t.ppf(0.975, df)) * se if se else 0.0
    return math.exp(centre - half), math.exp(centre + half)


def distance_pct(point: float, ci: tuple[float, float]) -> float:
    """How far the interval reaches from the median gain, either way, in % of it: the precision it states."""
    return 100.0 * max(point - ci[0], ci[1] - point) / point


def verdict_line(gain_value: float, ci: tuple[float, float], target: float | None) -> tuple[str, dict[str, Any]]:
    """The speed verdict in one line, and its parts: beyond noise (the interval excludes 1), target met
    (the median gain reaches it) and whether the whole interval does."""
    beyond = not ci[0] <= 1.0 <= ci[1]
    direction = "faster" if gain_value > 1 else "slower"
    noise = (f"{direction} than the baseline beyond noise" if beyond else
             "not distinguishable from the baseline (the interval holds 1.00x)")
    parts: dict[str, Any] = {"beyond_noise": beyond, "target": target, "target_met": None,
                             "target_met_whole_interval": None}
    line = f"throughput gain {gain_value:.2f}x (95 % interval {ci[0]:.2f}-{ci[1]:.2f}x): {noise}"
    if target is not None:
        parts["target_met"] = gain_value >= target
        parts["target_met_whole_interval"] = ci[0] >= target
        line += (f"; target {target:g}x {'met' if gain_value >= target else 'missed'}"
                 + (" (the whole interval above it)" if ci[0] >= target else
                    " (but the interval reaches below it)" if gain_value >= target else ""))
    return line + ".", parts


def server_capacity(log_path: Path) -> dict[str, Any] | None:
    """What the server logged about its KV cache: its size in tokens and the concurrency it allows at
    its context (None when the log holds no such line)."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = _CAPACITY.findall(text)
    if not found:
        return None
    pool, tokens, context, concurrency = found[-1]
    return {"kv_cache_tokens": int(tokens.replace(",", "")), "max_concurrency": float(concurrency),
            "tokens_per_request": int(context.replace(",", "")), "pool": pool.split()[-1],
            "log_line": f"{pool.split()[-1]} KV cache size: {tokens} tokens, Maximum concurrency for {context} "
                        f"tokens per request: {concurrency}x"}
