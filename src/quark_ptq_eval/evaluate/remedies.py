"""Remedies for a model that quantization hurt, chosen from what the plan did not already try."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quark_ptq_eval.evaluate.scan_followup import sensitivity_remedy

# A wider format to fall back to, per scheme family (first match on the scheme name wins).
WIDER_FORMAT = (
    ("int4_fp8", "fp8 (w8a8)"),
    ("nvfp4", "fp8 (w8a8) or mxfp6"),
    ("mxfp4", "mxfp6 or fp8 (w8a8)"),
    ("mxfp6", "fp8 (w8a8)"),
    ("int4", "int8 weights (or int4 with a smaller group size, e.g. int4_wo_64)"),
    ("uint4", "int8 weights (or a smaller group size)"),
    ("int8", "fp8 (w8a8), which keeps more dynamic range for activations"),
    ("fp8", "bf16 for the most sensitive layers (fp8 is already wide: exclude those layers instead)"),
)
WEIGHT_ONLY_MARKERS = ("_wo", "w4a16", "w8a16")
ACCURACY_ALGORITHMS = ("awq", "gptq", "smoothquant", "rotation", "quarot", "autosmoothquant")
MIN_CALIBRATION = 512


def suggest_remedies(plan: Mapping[str, Any] | None, num_layers: int | None = None) -> list[str]:
    """Concrete next steps, most effective first, skipping what the plan already does."""
    plan = plan or {}
    scheme = str(plan.get("global_scheme") or plan.get("scheme") or "")
    algorithms = plan_algorithms(plan)
    excluded = " ".join(plan.get("exclude_layers") or [])
    remedies = []
    remedies += _algorithm_remedies(scheme, algorithms)
    remedies += _exclusion_remedies(excluded, num_layers)
    remedies += sensitivity_remedy(plan)  # the measured answer: which layers to keep unquantized
    samples = (plan.get("calibration") or {}).get("num_samples")
    if samples is None or samples < MIN_CALIBRATION:
        have = f"{samples}" if samples is not None else "the current number of"
        remedies.append(
            f"Calibrate on more data: {have} samples -> {MIN_CALIBRATION} (--num-calib-samples "
            f"{MIN_CALIBRATION}), drawn from text like the model's real use."
        )
    wider = next((w for key, w in WIDER_FORMAT if key in scheme), None)
    if wider:
        remedies.append(f"Use a wider format than {scheme}: {wider}.")
    elif not scheme:
        remedies.append("Use a wider format (e.g. fp8 instead of a 4-bit scheme).")
    return remedies


def plan_algorithms(plan: Mapping[str, Any]) -> set[str]:
    return algorithm_names(plan.get("algorithm") or plan.get("algorithms"))


def algorithm_names(value: str | list[str] | tuple[str, ...] | None) -> set[str]:
    """A plan's algorithm field ("smoothquant,gptq", a list, '' or None) as lower-case names."""
    items = (value or "").split(",") if isinstance(value, str) or value is None else list(value)
    return {a.strip().lower() for a in items if a and a.strip()}


def _algorithm_remedies(scheme: str, algorithms: set[str]) -> list[str]:
    if algorithms & set(ACCURACY_ALGORITHMS):
        tried = ", ".join(sorted(algorithms & set(ACCURACY_ALGORITHMS)))
        return [
            f"The plan already uses {tried}: try another of awq / gptq / smoothquant, or combine "
            "rotation with it."
        ]
    if any(marker in scheme for marker in WEIGHT_ONLY_MARKERS):
        return [
            "Add an accuracy-recovering algorithm for weight-only quantization: --algorithm awq (or gptq)."
        ]
    return [
        "Add an accuracy-recovering algorithm: --algorithm smoothquant for activation outliers "
        "(w8a8), or awq / gptq for the weights."
    ]


def _exclusion_remedies(excluded: str, num_layers: int | None) -> list[str]:
    remedies = []
    if "down_proj" not in excluded:
        remedies.append("Keep the most sensitive projections unquantized: add '*down_proj' to --exclude.")
    if "layers.0." not in excluded:
        last = f"model.layers.{num_layers - 1}.*" if num_layers else "the last block"
        remedies.append(
            f"Exclude the first and last blocks (model.layers.0.*, {last}), which quantize worst."
        )
    return remedies


def block_remedies(per_block: list[dict[str, float]] | None, shown: int = 2) -> list[str]:
    """The streamed Tier 1 measured each block's own error: the blocks adding most, named first (their
    share of the sum), with the exclusion that keeps them unquantized."""
    rows = [r for r in per_block or [] if r.get("own_error") == r.get("own_error")]  # NaN-free
    total = sum(r["own_error"] for r in rows)
    if not rows or total <= 0:
        return []
    worst = sorted(rows, key=lambda r: r["own_error"], reverse=True)[:shown]
    named = ", ".join(f"block {int(r['block'])} ({100 * r['own_error'] / total:.0f} % of the summed per-block error)"
                      for r in worst)
    patterns = " ".join(f"'model.layers.{int(r['block'])}.*'" for r in worst)
    return [f"Measured where the error enters (Tier 1, streamed): {named}; keep them unquantized or wider "
            f"(--exclude {patterns}) and measure again."]


def validation_evidence(workdir: Path) -> list[str]:
    """What validation measured for Phase 3 (``for_evaluation`` in the run's validation_report.json: the
    load check's largest quantization error, its cause and the remedies worth measuring); [] without one."""
    try:
        report = json.loads((workdir / "validation_report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    lines = report.get("for_evaluation") if isinstance(report, dict) else None
    return [str(line) for line in lines] if isinstance(lines, list) else []
