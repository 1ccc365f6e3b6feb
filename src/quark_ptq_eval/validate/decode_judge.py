"""The decode check's verdicts: the bound each element is held to, and the findings for one tensor.

Rows with elements over the bound, rows (GPTQ) off in gain or error, and rows whose scale is zero
while their source is not: such a scale decodes every weight of its group to 0 (numpy's
"divide by zero" of ``w / scale`` there, never printed, is this finding). A zero scale over an
all-zero group (pruned or padded rows) decodes it exactly and is healthy.
"""

from __future__ import annotations

from dataclasses import dataclass

from quark_ptq_eval.validate.decode_blocks import DecodeTarget
from quark_ptq_eval.validate.decode_weights import Fold, RowErrors
from quark_ptq_eval.validate.report import Finding

RTN_SLACK = 1e-3  # steps: float32 rounding of w / scale (+ zero point); measured worst 0.5000005
# GPTQ, measured on healthy exports (bench/benchmarks/bench_decode.py): codes <= 2.9 steps off, |gain - 1| <= 0.031,
# row error <= 2.0x round-to-nearest's (tiny Llama int4_wo_128): each limit holds a margin of >= 1.4x.
GPTQ_STEPS = 4.0
GPTQ_GAIN = 0.1
GPTQ_ERROR_RATIO = 3.0
MAX_ROWS_LISTED = 8


@dataclass(frozen=True)
class Bound:
    kind: str  # "round-to-nearest" or "gptq"
    steps: float
    gain: float | None = None
    error_ratio: float | None = None

    def describe(self) -> str:
        text = f"{self.steps:g} step per element ({self.kind})"
        if self.gain is not None:
            text += f", row gain 1 +- {self.gain:g}, row error <= {self.error_ratio:g}x round-to-nearest's"
        return text


def bound_for(algos: set[str]) -> Bound:
    if "gptq" in algos:
        return Bound("gptq", GPTQ_STEPS, GPTQ_GAIN, GPTQ_ERROR_RATIO)
    return Bound("round-to-nearest", 0.5 + RTN_SLACK)


def judge(target: DecodeTarget, c: RowErrors, bound: Bound, fold: Fold | None) -> list[Finding]:
    """Findings for one tensor: rows with elements over the bound, and (GPTQ) rows off in gain or error."""
    import numpy as np

    findings = []
    name = target.weight.name
    folded = f" after undoing the scale folded from {fold.origin}" if fold is not None else ""
    if c.over:
        rows = sorted(c.over)
        row = max(rows, key=lambda r: c.worst_steps[r])
        where = _groups(target, c.over) if target.grouped else ""
        findings.append(Finding(
            name, f"decodes{folded} to more than {bound.steps:g} step from the source weight in {len(rows)} of "
                  f"{c.rows} output rows ({ranges(rows)}){where}.", side="quark",
            evidence=f"bound: {bound.describe()}; worst: {float(c.worst_steps[row]):.3g} steps at row {row}, column "
                     f"{int(c.worst_col[row])}; decoded with {format_of(target)}"))
    if bound.gain is not None and c.gain is not None and c.rtn_error is not None and c.rel_error is not None:
        with np.errstate(invalid="ignore"):
            gain_off = np.nonzero(~(np.abs(c.gain - 1) <= bound.gain) & (c.rtn_error > 0) | ~np.isfinite(c.gain))[0]
            ratio = np.where(c.rtn_error > 0, c.rel_error / c.rtn_error, 0.0)
        off = sorted(set(gain_off.tolist()) | set(np.nonzero(~(ratio <= bound.error_ratio))[0].tolist()))
        if off:
            row = off[0]
            findings.append(Finding(
                name, f"decodes{folded} to rows off the source's beyond GPTQ's error compensation in {len(off)} of "
                      f"{c.rows} output rows ({ranges(off)}).", side="quark",
                evidence=f"bound: {bound.describe()}; row {row}: gain {float(c.gain[row]):.3g}, error "
                         f"{float(ratio[row]):.3g}x round-to-nearest's; decoded with {format_of(target)}"))
    return findings + _zero_scales(target, c)


def _zero_scales(target: DecodeTarget, c: RowErrors) -> list[Finding]:
    if not c.zero_scale:
        return []
    rows = sorted(c.zero_scale)
    where = _groups(target, c.zero_scale) if target.grouped else ""
    return [Finding(
        target.weight.name, f"has a zero scale over source weights that are not zero in {len(rows)} of {c.rows} "
                            f"output rows ({ranges(rows)}){where}: they decode to 0.", side="quark",
        evidence=f"expected: a scale > 0 wherever the source is not all zero (an all-zero group may have scale 0); "
                 f"found: scale 0 at row {rows[0]} (numpy's 'divide by zero' in w / scale); decoded with "
                 f"{format_of(target)}")]


def _groups(target: DecodeTarget, over: dict[int, list[int]]) -> str:
    groups = sorted({g for gs in over.values() for g in gs})
    size = target.group_size
    return f", groups {ranges(groups)} of {size} columns" if size else ""


def format_of(t: DecodeTarget) -> str:
    text = f"{t.dtype} {t.spec.get('qscheme')}"
    if t.group_size:
        text += f" group {t.group_size}"
    if t.spec.get("scale_format"):
        text += f" ({t.spec['scale_format']} scales)"
    return text + (" and zero points" if t.zero_point is not None else "")


def ranges(values: list[int]) -> str:
    """``3, 7-9, 12 ...``: at most ``MAX_ROWS_LISTED`` runs."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:MAX_ROWS_LISTED])
    return text + (" ..." if len(runs) > MAX_ROWS_LISTED else "")
