"""Published reference scores: `--reference task:metric=value` and the model card's `model-index`."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UsageError

REFERENCE_RE = re.compile(r"^(?P<task>[^:=\s]+):(?P<metric>[^=\s]+)=(?P<value>\S+)$")


def parse_reference(items: list[str] | None) -> dict[str, dict[str, float]]:
    """``["gsm8k:exact_match,flexible-extract=0.62"]`` -> ``{"gsm8k": {"exact_match,flexible-extract": 0.62}}``."""
    out: dict[str, dict[str, float]] = {}
    for item in items or []:
        match = REFERENCE_RE.match(item.strip())
        if not match:
            raise UsageError(
                f"--reference {item!r} is not of the form task:metric=value (e.g. gsm8k:acc=0.61)."
            )
        try:
            value = float(match["value"])
        except ValueError:
            raise UsageError(f"--reference {item!r}: {match['value']!r} is not a number.") from None
        if not math.isfinite(value):
            raise UsageError(
                f"--reference {item!r} has the non-finite value {value}: give the published score as a finite number."
            )
        out.setdefault(match["task"], {})[match["metric"]] = value
    return out


def model_card_reference(model_dir: Path | None) -> dict[str, dict[str, float]]:
    """Scores from the README front matter's ``model-index`` (empty when there is none)."""
    if model_dir is None or not (Path(model_dir) / "README.md").is_file():
        return {}
    front = _front_matter((Path(model_dir) / "README.md").read_text(encoding="utf-8", errors="replace"))
    out: dict[str, dict[str, float]] = {}
    for entry in front.get("model-index") or []:
        for result in (entry or {}).get("results") or []:
            _add_result(out, result or {})
    return out


def _front_matter(text: str) -> dict[str, Any]:
    import yaml

    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    if end < 0:
        return {}
    try:
        data = yaml.safe_load(text[3:end])
    except yaml.YAMLError:
        return {}  # a broken card is no reference, not a failed evaluation
    return data if isinstance(data, dict) else {}


def _add_result(out: dict[str, dict[str, float]], result: dict[str, Any]) -> None:
    dataset = result.get("dataset") or {}
    task = dataset.get("type") or dataset.get("name") or (result.get("task") or {}).get("type")
    if not task:
        return
    for metric in result.get("metrics") or []:
        value = (metric or {}).get("value")
        name = (metric or {}).get("type") or (metric or {}).get("name")
        # A non-finite card value is no reference (and must not turn into a verdict).
        if name and isinstance(value, int | float) and math.isfinite(value):
            out.setdefault(str(task), {})[str(name)] = float(value)


def merge_references(*sources: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Later sources win: the user's --reference overrides the model card."""
    merged: dict[str, dict[str, float]] = {}
    for source in sources:
        for task, metrics in source.items():
            merged.setdefault(task, {}).update(metrics)
    return merged


def align_scale(reference: dict[str, dict[str, float]], scores: dict[str, dict[str, float]]) -> list[str]:
    """Cards often publish accuracies in percent while lm-eval reports fractions: rescale in place."""
    notes = []
    for task, metrics in reference.items():
        for metric, value in list(metrics.items()):
            ours = _lookup(scores.get(task, {}), metric)
            if ours is not None and 0 <= ours <= 1 and 1 < value <= 100:
                metrics[metric] = value / 100
                notes.append(f"reference {task}:{metric}={value} read as a percentage ({value / 100:.4f}).")
    return notes


def _lookup(metrics: dict[str, float], name: str) -> float | None:
    return metrics.get(name, next((v for k, v in metrics.items() if k.split(",")[0] == name), None))
