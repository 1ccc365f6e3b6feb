"""The Tier 1 report's llama.cpp-style block and its distribution chart (per-window ΔNLL, per-token
KL and Δp): the figures of llama.cpp's
``perplexity --kl-divergence`` report (ppl.stats.llama_cpp_stats) laid out as it prints them, so a
Quark export's numbers sit beside a GGUF quant's."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.fsio import write_png

if TYPE_CHECKING:
    from pathlib import Path

    from matplotlib.axes import Axes

    from quark_ptq_eval.evaluate.eval_report import EvalReport

_KLD_ROWS = (("Maximum KLD", "kld_max"), ("99.9%   KLD", "kld_p99_9"), ("99.0%   KLD", "kld_p99"),
             ("95.0%   KLD", "kld_p95"), ("90.0%   KLD", "kld_p90"), ("Median  KLD", "kld_median"),
             ("10.0%   KLD", "kld_p10"), (" 5.0%   KLD", "kld_p5"), (" 1.0%   KLD", "kld_p1"),
             (" 0.1%   KLD", "kld_p0_1"), ("Minimum KLD", "kld_min"))
_DP_ROWS = (("Maximum Δp", "dp_max"), ("99.9%   Δp", "dp_p99_9"), ("99.0%   Δp", "dp_p99"), ("95.0%   Δp", "dp_p95"),
            ("90.0%   Δp", "dp_p90"), ("75.0%   Δp", "dp_p75"), ("Median  Δp", "dp_median"), ("25.0%   Δp", "dp_p25"),
            ("10.0%   Δp", "dp_p10"), (" 5.0%   Δp", "dp_p5"), (" 1.0%   Δp", "dp_p1"), (" 0.1%   Δp", "dp_p0_1"),
            ("Minimum Δp", "dp_min"))


def kld_report_lines(r: dict[str, Any] | None) -> list[str]:
    """The markdown block (a fenced text block in llama.cpp's layout), or nothing without a baseline."""
    if not r:
        return []
    def pm(key: str, width: int = 10, digits: int = 6) -> str:
        return f"{_f(r[key], width, digits)} ± {_f(r[key + '_unc'], width, digits)}"
    text = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {pm('ppl_q')}",
        f"Mean PPL(base)                : {pm('ppl_base')}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {_f(100 * r['cor_ln_ppl'], 6, 2)}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {pm('ln_ppl_ratio')}",
        f"Mean PPL(Q)/PPL(base)         : {pm('ppl_ratio')}",
        f"Mean PPL(Q)-PPL(base)         : {pm('ppl_diff')}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {pm('kld_mean')}",
        *[f"{label}: {_f(r[key], 10, 6)}" for label, key in _KLD_ROWS],
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {_f(100 * r['dp_mean'], 6, 3)} ± {_f(100 * r['dp_mean_unc'], 5, 3)} %",
        *[f"{label}: {_f(100 * r[key], 6, 3)}%" for label, key in _DP_ROWS],
        f"RMS Δp    : {_f(100 * r['dp_rms'], 6, 3)} ± {_f(100 * r['dp_rms_unc'], 5, 3)} %",
        f"Same top p: {_f(100 * r['same_top_p'], 6, 3)} ± {_f(100 * r['same_top_p_unc'], 5, 3)} %",
    ]
    return ["### llama.cpp-style KL-divergence statistics", "",
            f"Over {r['tokens']:,} scored tokens. {r.get('definitions', '')}", "", "```text", *text, "```", ""]


def num(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan / inf / -inf: say what it is, never hide it
    if abs(value) >= 1e9:
        return f"{value:.4g}"
    return f"{value:.4f}" if abs(value) < 1000 else f"{value:,.1f}"


def _f(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def dp_panel(ax: Axes, hist: dict[str, Any], r: dict[str, Any]) -> None:
    """Per-token Δp = p_Q(label) − p_base(label), in percent, with its mean and 1 %/99 % lines."""
    edges = [100 * e for e in hist["edges"]]
    ax.stairs(hist["counts"], edges, fill=True, color="#5b9bd5")
    ax.set_yscale("log")
    for key, color, name in (("dp_mean", "#d9534f", "mean"), ("dp_p1", "#2f6f3f", "1 %"), ("dp_p99", "#2f6f3f", "99 %")):
        if key in r:
            ax.axvline(100 * r[key], color=color, linewidth=1.2, label=f"{name} {100 * r[key]:+.3g} %")
    ax.legend(fontsize=7)
    rms = f", RMS {100 * r['dp_rms']:.3g} %" if "dp_rms" in r else ""
    ax.set_title(f"per-token Δp = p_Q(token) − p_base(token){rms}", fontsize=9)
    ax.set_xlabel("percentage points", fontsize=8)
    ax.set_ylabel("tokens", fontsize=8)


def distribution_chart(report: EvalReport, path: Path) -> Path:
    """Left: how the quantized model's per-window NLL differs from the baseline's (0 = no change),
    with the paired mean and its 95 % interval. Right: the per-token KL on a log axis, p50 and p99."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt


    details = report.details
    deltas, paired = details["distribution"]["window_nll_delta"], details["paired"]
    dp_hist = details["distribution"].get("token_dp_histogram")
    fig, axes = plt.subplots(1, 3 if dp_hist else 2, figsize=(14.4 if dp_hist else 9.6, 3.6))
    left, right = axes[0], axes[1]
    finite = [d for d in deltas if math.isfinite(d)]
    left.hist(finite, bins=min(40, max(5, len(finite) // 4)), color="#5b9bd5")
    left.axvline(0.0, color="#7f7f7f", linewidth=1, label="no change")
    if math.isfinite(paired["delta_nll"]):
        left.axvline(paired["delta_nll"], color="#d9534f", linewidth=1.5, label=f"mean {paired['delta_nll']:+.4g}")
        left.axvspan(paired["delta_nll_ci95_low"], paired["delta_nll_ci95_high"], color="#d9534f", alpha=0.15,
                     label="95 % interval")
    left.set_title(f"per-window NLL delta, quantized − baseline ({len(deltas)} windows)", fontsize=9)
    left.set_xlabel("nats per token", fontsize=8)
    left.set_ylabel("windows", fontsize=8)
    left.legend(fontsize=7)
    kl_panel(right, details["distribution"]["token_kl_histogram"], details["kl"])
    if dp_hist:
        dp_panel(axes[2], dp_hist, details.get("kld_report") or {})
    for ax in axes:
        ax.tick_params(labelsize=8)
    kl = details["kl"]
    fig.suptitle(
        f"Tier {report.tier}: verdict {report.verdict} — perplexity {num(details['quantized']['perplexity'])} vs "
        f"{num(details['baseline']['perplexity'])}, top-1 agreement {100 * kl['top1_agreement']:.2f} %",
        fontsize=10,
    )
    fig.tight_layout()
    write_png(fig, path)
    return path


def kl_panel(ax: Axes, hist: dict[str, Any], kl: dict[str, Any]) -> None:
    if hist["counts"]:
        ax.stairs(hist["counts"], hist["edges"], fill=True, color="#5b9bd5")
        ax.set_xscale("log")
        for name, color in (("kl_p50", "#2f6f3f"), ("kl_p99", "#d9534f")):
            if kl[name] > 0:
                ax.axvline(kl[name], color=color, linewidth=1.5, label=f"{name[3:]} {kl[name]:.3g}")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "KL is 0 at every token", ha="center", va="center", transform=ax.transAxes)
    zero = f"; {hist['zero']:,} tokens at 0" if hist["zero"] else ""
    ax.set_title(f"per-token KL(baseline ‖ quantized), mean {kl['kl_divergence']:.3g}{zero}", fontsize=9)
    ax.set_xlabel("nats", fontsize=8)
    ax.set_ylabel("tokens", fontsize=8)
