"""Tier 1's statistics, accumulated batch by batch: per-window means (our intervals), llama.cpp's
running sums (its ``perplexity --kl-divergence`` report) and one float32 per token of KL and Δp
(their percentiles). Memory: 8 bytes per scored token, nothing per vocabulary entry.

llama.cpp's definitions (tools/perplexity/perplexity.cpp, ``kl_divergence``), over all scored
tokens: a mean's uncertainty is ``sqrt((mean(x^2) - mean(x)^2) / (n - 1))`` (0 below 11 tokens),
the covariance of the two NLLs ``(mean(xy) - mean(x) mean(y)) / (n - 1)``; PPL = exp(mean NLL) ± PPL
times the NLL's uncertainty; ln(PPL(Q)/PPL(base)) ± sqrt(u_Q^2 + u_b^2 - 2 cov); the ratio ± ratio
times that; the difference ± sqrt(uPPL_Q^2 + uPPL_b^2 - 2 PPL_Q PPL_b cov); Cor = cov / (u_Q u_b).
Δp = p_Q(label) - p_base(label); RMS Δp = sqrt(mean Δp^2) ± the uncertainty of mean Δp^2 over
2 RMS; same top p = share of tokens whose argmaxes agree ± sqrt(p (1 - p) / (n - 1)). Percentiles
interpolate linearly at fraction * (n - 1) of the sorted values (the median is the 50 % one).
These uncertainties treat tokens as independent; the per-window intervals (``perplexity_stats``,
``paired_delta``) do not, and are the ones our verdicts use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from quark_ptq_eval.evaluate.verdict import BEYOND_NOISE, WITHIN_NOISE, Z95, safe_exp, safe_expm1

PERCENTILES = (("p99_9", 0.999), ("p99", 0.99), ("p95", 0.95), ("p90", 0.90), ("median", 0.5),
               ("p10", 0.10), ("p5", 0.05), ("p1", 0.01), ("p0_1", 0.001))
DP_PERCENTILES = (*PERCENTILES[:4], ("p75", 0.75), ("median", 0.5), ("p25", 0.25), *PERCENTILES[5:])
SUMS = ("nll", "nll2", "base", "base2", "nll_base", "kld", "kld2", "dp", "dp2", "dp4")


@dataclass
class Accumulator:
    """Per-window mean NLLs and KLs, llama.cpp's per-token sums, and per-token KL and Δp (float32)."""

    window_nll: list[float] = field(default_factory=list)
    base_window_nll: list[float] = field(default_factory=list)
    window_kl: list[float] = field(default_factory=list)
    kl_values: list[Any] = field(default_factory=list)  # float32 tensors, one per batch
    dp_values: list[Any] = field(default_factory=list)  # float32 tensors, one per batch
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SUMS, 0.0))
    top1_matches: int = 0
    tokens: int = 0
    windows: int = 0

    def add(self, stats: Mapping[str, Any], windows: int) -> None:
        """One batch's per-token ``[B, T]`` float64 stats: ``nll``, and with a baseline ``base_nll``,
        ``kl``, ``top1``."""
        import torch

        nll = stats["nll"]
        self.window_nll.extend(nll.mean(dim=1).tolist())
        self.tokens += nll.numel()
        self.windows += windows
        if "base_nll" not in stats:
            return
        base, kl = stats["base_nll"].to(nll.device), stats["kl"]
        dp = torch.exp(-nll) - torch.exp(-base)
        self.base_window_nll.extend(base.mean(dim=1).tolist())
        self.window_kl.extend(kl.mean(dim=1).tolist())
        self.kl_values.append(kl.reshape(-1).float().cpu())
        self.dp_values.append(dp.reshape(-1).float().cpu())
        self.top1_matches += int(stats["top1"].sum())
        dp2 = dp * dp
        for name, value in (("nll", nll), ("nll2", nll * nll), ("base", base), ("base2", base * base),
                            ("nll_base", nll * base), ("kld", kl), ("kld2", kl * kl), ("dp", dp), ("dp2", dp2),
                            ("dp4", dp2 * dp2)):
            self.sums[name] += float(value.sum())


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error over windows (tokens inside a window are correlated)."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, math.nan
    return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in values) / (n - 1) / n)


def perplexity_stats(window_nll: list[float], tokens_per_window: int) -> dict[str, float]:
    """Perplexity (exp of the mean NLL: inf when that overflows), the NLL's standard error, a 95 % interval."""
    n = len(window_nll)
    mean_nll, stderr = mean_and_stderr(window_nll)
    return {
        "perplexity": safe_exp(mean_nll),
        "mean_nll": mean_nll,
        "nll_stderr": stderr,
        "perplexity_ci95_low": safe_exp(mean_nll - Z95 * stderr) if n > 1 else math.nan,
        "perplexity_ci95_high": safe_exp(mean_nll + Z95 * stderr) if n > 1 else math.nan,
        "tokens": n * tokens_per_window,
        "windows": n,
    }


def sorted_values(parts: list[Any]) -> Any:
    """All per-token values of one kind, sorted (a float32 numpy array)."""
    import numpy as np

    return np.sort(np.concatenate([p.numpy() for p in parts]))


def percentile(ordered: Any, fraction: float) -> float:
    """llama.cpp's: linear interpolation at ``fraction * (n - 1)`` (numpy's default method)."""
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    weight = position - low
    return (1 - weight) * float(ordered[low]) + weight * float(ordered[high])


def kl_stats(acc: Accumulator, kl_sorted: Any | None = None) -> dict[str, float]:
    """Our KL summary (kept keys): mean over tokens, its standard error over windows, p50/p90/p99, max, top-1."""
    kl = sorted_values(acc.kl_values) if kl_sorted is None else kl_sorted
    _, stderr = mean_and_stderr(acc.window_kl)
    return {
        "kl_divergence": acc.sums["kld"] / acc.tokens,
        "kl_stderr": stderr,  # over per-window means: the windows are the independent samples
        "kl_p50": percentile(kl, 0.5),
        "kl_p90": percentile(kl, 0.9),
        "kl_p99": percentile(kl, 0.99),
        "kl_max": float(kl[-1]),
        "top1_agreement": acc.top1_matches / acc.tokens,
    }


def _mean_unc(total: float, squares: float, n: int) -> tuple[float, float]:
    mean = total / n
    var = squares / n - mean * mean
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def llama_cpp_stats(acc: Accumulator, kl_sorted: Any, dp_sorted: Any) -> dict[str, float]:
    """Every figure of llama.cpp's KL-divergence report, by its definitions (module docstring)."""
    s, n = acc.sums, acc.tokens
    log_q, u_q = _mean_unc(s["nll"], s["nll2"], n)
    log_b, u_b = _mean_unc(s["base"], s["base2"], n)
    cov = (s["nll_base"] / n - log_q * log_b) / (n - 1) if n >= 10 else 0.0
    ppl_q, ppl_b = safe_exp(log_q), safe_exp(log_b)
    ln_ratio_unc = math.sqrt(max(0.0, u_q * u_q + u_b * u_b - 2 * cov))
    ratio = safe_exp(log_q - log_b)
    diff_var = (ppl_q * u_q) ** 2 + (ppl_b * u_b) ** 2 - 2 * ppl_q * ppl_b * cov
    kld, kld_unc = _mean_unc(s["kld"], s["kld2"], n)
    dp, dp_unc = _mean_unc(s["dp"], s["dp2"], n)
    mse, mse_unc = _mean_unc(s["dp2"], s["dp4"], n)
    rms = math.sqrt(mse)
    same = acc.top1_matches / n
    out = {
        "tokens": n,
        "ppl_q": ppl_q, "ppl_q_unc": ppl_q * u_q, "ppl_base": ppl_b, "ppl_base_unc": ppl_b * u_b,
        "cor_ln_ppl": cov / (u_q * u_b) if u_q > 0 and u_b > 0 else math.nan,
        "ln_ppl_ratio": log_q - log_b, "ln_ppl_ratio_unc": ln_ratio_unc,
        "ppl_ratio": ratio, "ppl_ratio_unc": ratio * ln_ratio_unc,
        "ppl_diff": ppl_q - ppl_b, "ppl_diff_unc": math.sqrt(max(0.0, diff_var)),
        "kld_mean": kld, "kld_mean_unc": kld_unc, "kld_max": float(kl_sorted[-1]), "kld_min": float(kl_sorted[0]),
        "dp_mean": dp, "dp_mean_unc": dp_unc, "dp_max": float(dp_sorted[-1]), "dp_min": float(dp_sorted[0]),
        "dp_rms": rms, "dp_rms_unc": 0.5 / rms * mse_unc if rms > 0 else 0.0,
        "same_top_p": same, "same_top_p_unc": math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else math.nan,
    }
    out.update({f"kld_{name}": percentile(kl_sorted, f) for name, f in PERCENTILES})
    out.update({f"dp_{name}": percentile(dp_sorted, f) for name, f in DP_PERCENTILES})
    return out


def distribution(acc: Accumulator, bins: int = 40, kl_sorted: Any | None = None,
                 dp_sorted: Any | None = None) -> dict[str, Any]:
    """What the report's chart draws: every window's paired NLL delta (quantized - baseline), a
    histogram of the per-token KL over log-spaced bins (at most 8 decades below the largest) and
    one of the per-token Δp over linear bins."""
    import numpy as np

    kl = sorted_values(acc.kl_values) if kl_sorted is None else kl_sorted
    dp = sorted_values(acc.dp_values) if dp_sorted is None and acc.dp_values else dp_sorted
    positive = kl[kl > 0].astype(np.float64)
    deltas = [q - b for q, b in zip(acc.window_nll, acc.base_window_nll, strict=True)]
    hist: dict[str, Any] = {"edges": [], "counts": [], "zero": int(kl.size)}
    if positive.size:
        high = float(positive[-1])
        low = max(float(positive[0]), high * 1e-8)
        high = max(high, low * 10)  # one value: still a bin with a width
        edges = np.logspace(math.log10(low), math.log10(high), bins + 1)
        edges[0], edges[-1] = low, high  # 10 ** log10(x) can miss x by a rounding: the extremes stay in
        counts, _ = np.histogram(positive.clip(low, high), bins=edges)
        hist = {"edges": edges.tolist(), "counts": [int(c) for c in counts], "zero": int(kl.size - positive.size)}
    out = {"window_nll_delta": deltas, "token_kl_histogram": hist}
    if dp is not None and len(dp):
        low, high = float(dp[0]), float(dp[-1])
        counts, edges = np.histogram(dp.astype(np.float64), bins=bins, range=(low, high if high > low else low + 1e-12))
        out["token_dp_histogram"] = {"edges": edges.tolist(), "counts": [int(c) for c in counts]}
    return out


def paired_delta(acc: Accumulator) -> dict[str, Any]:
    """Per-window NLL difference quantized - baseline: mean, paired standard error, 95 % interval."""
    diffs = [q - b for q, b in zip(acc.window_nll, acc.base_window_nll, strict=True)]
    mean, se = mean_and_stderr(diffs)
    low, high = mean - Z95 * se, mean + Z95 * se
    within = len(diffs) > 1 and low <= 0 <= high
    return {
        "delta_nll": mean,
        "delta_nll_stderr": se,
        "delta_nll_ci95_low": low,
        "delta_nll_ci95_high": high,
        "perplexity_ratio": safe_exp(mean),
        "perplexity_ratio_ci95_low": safe_exp(low),
        "perplexity_ratio_ci95_high": safe_exp(high),
        "noise": WITHIN_NOISE if within else (BEYOND_NOISE if len(diffs) > 1 else None),
    }


def resolution_pct(window_values: list[float], windows: int) -> float | None:
    """Half-width, in percent of perplexity, of the 95 % interval ``windows`` windows would give,
    projected from the spread of ``window_values`` (per-window NLLs or paired NLL differences)."""
    if len(window_values) < 2:
        return None
    _, se = mean_and_stderr(window_values)
    sd = se * math.sqrt(len(window_values))
    return 100.0 * safe_expm1(Z95 * sd / math.sqrt(windows))
