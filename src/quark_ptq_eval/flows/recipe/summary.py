"""The final summary: every artifact with its path, the scheme, sizes, verdicts, time per phase."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypedDict

from quark_ptq_eval.base.calibration_text import describe_used
from quark_ptq_eval.base.step_table import STEP_NAMES, artifact_files
from quark_ptq_eval.publish import upload_command


class EvalSummary(TypedDict):
    """The evaluation's line of the summary: its tier, verdict and report."""

    tier: str
    verdict: str
    report: str
    verdict_qualifier: str | None


class RunSummary(TypedDict):
    """run_summary.json: what a run (or the step it stopped after) produced, as the commands print it."""

    status: str  # "done" or "stopped"
    stopped_after: str | None
    workdir: str
    model: str | None
    scheme: str | None
    algorithm: str | None
    size_before_bytes: int | None
    size_after_bytes: int | None
    calibration: str | None
    validation: str | None
    evaluation: EvalSummary | str | None  # None: not reached; "skipped"
    artifacts: dict[str, str]
    timings_s: dict[str, float]
    upload: str | None  # the line that publishes the export: printed last, never run


def _dir_bytes(path: Path) -> int | None:
    if not path.is_dir():
        return None
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def build_summary(wd: Path, model: str | None, output_dir: str | None, timings: dict[str, float],
                  stopped_at: str | None, parts: dict[str, Any]) -> RunSummary:
    """``parts``: what each step produced, by its ``Step.part`` name."""
    plan = parts.get("plan")
    analysis = parts.get("analysis")
    out = Path(output_dir).resolve() if output_dir else None
    validation, evaluation = parts.get("validation"), parts.get("evaluation")
    artifacts = {name: str(wd / name) for name in artifact_files() if (wd / name).exists()}
    if out is not None and out.is_dir():
        artifacts["quantized_model"] = str(out)
    if parts.get("card"):
        artifacts["model_card"] = str(parts["card"])
    return {
        "status": "stopped" if stopped_at else "done",
        "stopped_after": stopped_at,
        "workdir": str(wd),
        "model": model,
        "scheme": plan.global_scheme if plan else None,
        "algorithm": plan.algorithm if plan else None,
        "size_before_bytes": analysis.size["bytes"] if analysis else None,
        "size_after_bytes": _dir_bytes(out) if out and _executed(stopped_at) else None,
        "calibration": describe_used(plan) if plan else None,
        "validation": getattr(validation, "status", None),
        "evaluation": _eval_summary(evaluation),
        "artifacts": artifacts,
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        # the line that publishes the export: printed last, never run
        "upload": upload_command(out) if out is not None and out.is_dir() and stopped_at is None else None,
    }


def _executed(stopped_at: str | None) -> bool:
    """Did the run get as far as the execute step (so the output dir is ours to measure)?"""
    return stopped_at is None or STEP_NAMES.index(stopped_at) >= STEP_NAMES.index("execute")


def _eval_summary(evaluation: Any) -> EvalSummary | str | None:
    """``None`` (not reached), ``"skipped"``, or the tier, verdict and report of an EvalReport."""
    if evaluation is None or isinstance(evaluation, str):
        return evaluation
    return {"tier": evaluation.tier, "verdict": evaluation.verdict, "report": str(evaluation.report_path),
            "verdict_qualifier": getattr(evaluation, "verdict_qualifier", None)}


def summary_rows(summary: RunSummary) -> list[tuple[str, str]]:
    rows = [(name, path) for name, path in summary["artifacts"].items()]
    mib = lambda b: f"{b / 2**20:.2f} MiB" if b else "-"  # noqa: E731
    rows += [("scheme", f"{summary['scheme']}" + (f" + {summary['algorithm']}" if summary["algorithm"] else "")),
             ("size before → after", f"{mib(summary['size_before_bytes'])} → {mib(summary['size_after_bytes'])}"),
             ("calibration", str(summary.get("calibration") or "-")),
             ("validation", str(summary["validation"])), ("evaluation", _verdict_text(summary["evaluation"]))]
    rows += [(f"time: {k}", f"{v:.1f} s") for k, v in summary["timings_s"].items()]
    return rows


def _verdict_text(evaluation: EvalSummary | str | None) -> str:
    if isinstance(evaluation, dict):
        qualifier = f", {evaluation['verdict_qualifier']}" if evaluation.get("verdict_qualifier") else ""
        return f"{evaluation['verdict']} (tier {evaluation['tier']}{qualifier})"
    return str(evaluation)
