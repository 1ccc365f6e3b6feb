"""eval_report.md, eval_results.json and the chart next to them."""

from __future__ import annotations

import math
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.fsio import atomic_write_text, write_json, write_png
from quark_ptq_eval.evaluate.context import SPAN, format_duration
from quark_ptq_eval.evaluate.eval_report import REPORT_NAME, RESULTS_NAME, EvalReport  # noqa: F401 (names kept importable here)
from quark_ptq_eval.evaluate.ppl.kld_report import num as _num
from quark_ptq_eval.evaluate.verdict import invalid_reasons

if TYPE_CHECKING:
    from quark_ptq_eval.evaluate.context import RuntimeEstimate

CHART_NAME = "eval_chart.png"
RESULTS_SCHEMA = "quark-ptq-eval/eval_results/1"


def write_all(report: EvalReport, timed_from: float | None = None) -> None:
    """Write the chart, eval_results.json and eval_report.md. With ``timed_from`` (a perf_counter
    reading: the tier's approval), the actual time is measured here, after the chart, so that it
    spans what the estimate announced (the two text files take milliseconds)."""
    report.chart_path = write_chart(report, report.workdir / CHART_NAME)
    if timed_from is not None:
        report.actual_s = time.perf_counter() - timed_from
    write_json(report.results_path, results_document(report))
    atomic_write_text(report.report_path, markdown(report))


def results_document(report: EvalReport) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema": RESULTS_SCHEMA,
        "tier": report.tier,
        "model": str(report.model_dir),
        "source_model": str(report.source_model) if report.source_model else None,
        "settings": report.settings,
        "quantized": report.quantized,
    }
    if report.baseline is not None:
        doc["baseline"] = report.baseline
    doc.update(
        {
            "reference": report.reference,
            "deltas": [c.as_dict() for c in report.comparisons],
            "verdict": report.verdict,
            "verdict_qualifier": report.verdict_qualifier,
            "remedies": report.remedies,
            "runtime": runtime_document(report),
            "details": report.details,
            "deferred_commands": report.deferred_commands,
            "notes": report.notes,
            "artifacts": report.artifacts | ({"chart": str(report.chart_path)} if report.chart_path else {}),
        }
    )
    if report.sensitivity is not None:  # the plan's scan proposal: predicted vs measured KL
        doc["sensitivity"] = report.sensitivity
    safe: dict[str, Any] = json_safe(doc)
    return safe


def runtime_document(report: EvalReport) -> dict[str, Any]:
    """Estimated and actual time over the same span, and their ratio."""
    estimated = report.estimate.total_s if report.estimate else None
    ratio = estimated / report.actual_s if estimated is not None and report.actual_s else None
    return {
        "span": SPAN,
        "estimated_s": estimated,
        "actual_s": report.actual_s,
        "estimated_over_actual": ratio,
        "estimate": report.estimate.as_dict() if report.estimate else None,
    }


def json_safe(value: Any) -> Any:  # any JSON-able value, nested
    """NaN is not JSON: write null instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def markdown(report: EvalReport) -> str:
    lines = [
        f"# Evaluation report — tier {report.tier}",
        "",
        f"**Verdict: {report.verdict}**" + (f" **({report.verdict_qualifier})**" if report.verdict_qualifier else "")
        + _verdict_explanation(report),
        "",
    ]
    lines += _settings_section(report)
    lines += _scores_section(report)
    lines += _details_section(report)
    from quark_ptq_eval.evaluate.scan_followup import followup_markdown

    lines += followup_markdown(report.sensitivity)
    if report.remedies:
        lines += ["## Remedies", "", *[f"- {r}" for r in report.remedies], ""]
    if report.deferred_commands:
        lines += _deferred_section(report)
    if report.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in report.notes], ""]
    if report.chart_path:
        caption = "per-window NLL delta, per-token KL and Δp" if "distribution" in report.details else "quantized vs baseline"
        lines += ["## Chart", "", f"![{caption}]({report.chart_path.name})", ""]
    return "\n".join(lines)


def _verdict_explanation(report: EvalReport) -> str:
    t = report.thresholds
    if report.verdict == "invalid":
        return (
            " — a metric is missing or not a number, so no verdict on the model can be trusted: "
            + "; ".join(invalid_reasons(report.comparisons))
            + "."
        )
    if report.verdict == "unknown" and report.comparisons and all(c.verdict == "info" for c in report.comparisons):
        return " — this tier measures without an accuracy verdict: its own section below judges what it measured."
    if report.verdict == "unknown":
        return (
            " — scores only: no baseline and no published reference to compare with, so the delta is "
            "unknown (opt in with --baseline, or give --reference task:metric=value)."
        )
    return (
        f" (healthy: at most {t.healthy_pct:g} % worse; hurt: more than {t.hurt_pct:g} % worse; "
        "direction-aware per metric. Where the sampling noise was measured, healthy needs the whole "
        "95 % interval within the healthy threshold and hurt needs a worsening beyond noise)."
    )


def _settings_section(report: EvalReport) -> list[str]:
    rows = [("model", str(report.model_dir)), ("source model", str(report.source_model or "-"))]
    rows += [(k, str(v)) for k, v in report.settings.items()]
    if report.estimate:
        estimate = report.estimate
        rows += [
            ("hardware", estimate.hardware),
            ("data", estimate.data),
            ("pilot", estimate.basis),
            ("estimated time", _estimated(estimate)),
        ]
    if report.actual_s is not None:
        rows.append(("actual time", f"{format_duration(report.actual_s)} ({report.actual_s:.1f} s, {SPAN})"))
    return [
        "## Settings and environment",
        "",
        "| setting | value |",
        "|---|---|",
        *[f"| {k} | {_cell(v)} |" for k, v in rows],
        "",
    ]


def _estimated(estimate: RuntimeEstimate) -> str:
    total = estimate.total_s
    if total is None or estimate.seconds is None:
        return "-"
    return (
        f"{format_duration(total)} ({total:.1f} s: {estimate.elapsed_s:.1f} s measured before the "
        f"announcement + {estimate.seconds + estimate.finish_s:.1f} s predicted)"
    )


def _scores_section(report: EvalReport) -> list[str]:
    if not report.comparisons:
        return ["## Scores", "", "No scores (nothing was evaluated on this host).", ""]
    lines = [
        "## Scores, deltas and verdicts",
        "",
        "| task | metric | quantized | compared to | value | worse by | 95 % interval | noise | verdict |",
        "|---|---|---:|---|---:|---:|---|---|---|",
    ]
    for c in report.comparisons:
        other = "-" if c.other is None else _num(c.other)
        worse = "unknown" if c.degradation_pct is None else _pct(c.degradation_pct)
        if c.verdict in ("info", "invalid"):
            worse = "-"
        interval = "-" if c.ci95_pct is None else f"{_pct(c.ci95_pct[0])} … {_pct(c.ci95_pct[1])}"
        lines.append(
            f"| {c.task} | {c.metric} | {_num(c.value)} | {c.compared_to or '-'} | {other} | "
            f"{worse} | {interval} | {c.noise or '-'} | {c.verdict} |"
        )
    notes = [f"- {c.task}:{c.metric}: {c.note}" for c in report.comparisons if c.note]
    return [*lines, "", *notes, *([""] if notes else [])]


def _pct(value: float) -> str:
    return f"{value:+.2f} %" if math.isfinite(value) else f"{'+' if value > 0 else '-'}inf %"


def _details_section(report: EvalReport) -> list[str]:
    """The tier's own section (its runner's ``section``), then the files it wrote."""
    from quark_ptq_eval.evaluate.context import tier_runner
    from quark_ptq_eval.evaluate.tiers import TIERS

    tier = TIERS.get(report.tier)
    lines: list[str] = tier_runner(tier).section(report) if tier and tier.runner else []
    if report.artifacts:
        lines += ["## Files", "", *[f"- {name}: `{path}`" for name, path in report.artifacts.items()], ""]
    return lines


def _deferred_section(report: EvalReport) -> list[str]:
    lines = [
        "## Deferred commands (run later on a ROCm host)",
        "",
        "These were planned but not run here; each is an exact argument list.",
        "",
        "```sh",
    ]
    for command in report.deferred_commands:
        lines.append(f"# {command['purpose']}")
        lines.append(shlex.join(command["argv"]))
    return [*lines, "```", ""]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_chart(report: EvalReport, path: Path) -> Path | None:
    """Tier 1 with a baseline: the per-window NLL deltas and the per-token KL as distributions.
    Otherwise one small panel per metric: quantized next to baseline (or reference)."""
    if (report.details.get("distribution") or {}).get("window_nll_delta"):
        from quark_ptq_eval.evaluate.ppl.kld_report import distribution_chart

        return distribution_chart(report, path)
    rows = [c for c in report.comparisons if c.verdict != "info" and math.isfinite(c.value)]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.2), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        labels, values, colors = (
            ["quantized"],
            [row.value],
            ["#d9534f" if row.verdict == "hurt" else "#5b9bd5"],
        )
        if row.other is not None:
            labels.append(row.compared_to or "other")
            values.append(row.other)
            colors.append("#7f7f7f")
        ax.bar(labels, values, color=colors)
        ax.set_title(f"{row.task}\n{row.metric}", fontsize=9)
        ax.tick_params(labelsize=8)
        for x, v in enumerate(values):
            ax.annotate(_num(v), (x, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"Tier {report.tier}: verdict {report.verdict}", fontsize=10)
    fig.tight_layout()
    write_png(fig, path)
    return path
