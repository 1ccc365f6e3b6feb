"""Rows a fold crushed: quantization damage, told from an export fault by the scale the pair's other linear took.

SmoothQuant and AWQ divide output row ``i`` of a linear (``up_proj``, ``v_proj``) by ``s_i`` and multiply
input column ``i`` of its consumer (``down_proj``, ``o_proj``) by the same ``s_i``. The decode check reads
``s_i`` from the row's own codes (``decode_folds.py``: ``g``, the least-squares gain of the decoded row on the
source's, is ``1 / s_i``). What those codes can certify, in the worst case: were every code within half a step
``q_j`` of its source (round-to-nearest), ``sum_j w_j w_hat_j`` is off by at most ``1/2 sum_j |w_j| q_j``, so

    |g s_i - 1| <= delta_i = 1/2 sum_j |w_j| q_j / sum_j w_j w_hat_j

a bound in the codes alone, whatever their noise. A row of ``k`` non-zero codes of at most ``m`` steps has
``delta ~ n |x| / (2 k m^2)`` over its ``n`` elements: a row of 128 elements that one code of 1 survives
(the scheme rounded the rest to 0) gives ``delta ~ 15-20``, its scale anywhere from 0 to 20 times the
estimate, and a row of no code ``delta = inf``. A large ``s_i`` is exactly what crushes a row; the
statistical tolerance the estimate is given (``FOLD_SIGMAS`` standard errors) assumes noise that averages
out, which rounding to 0 does not.

So a row over the bound (or with no positive scale) whose ``delta_i`` exceeds the tolerance it was given
may fail for its estimate, not its codes. Its consumer's column ``i`` took the same ``s_i``, magnified by it:
the column's own ``delta`` (the same bound down the column; ~1 % where the row's was 15) certifies ``s_i``.
The row is judged again with that scale, held to the same half step plus that ``delta``. Passing, the row
is what round-to-nearest makes of the source under the plan: quantization damage, recorded (the weight,
its rows, the codes that survive of how many, the largest |code|) as evidence for Phase 3, which measures
what it costs; never a failure. Failing, it stays a finding, and a row that no consumer column certifies
(its consumer crushed too, or carrying other scales) is judged as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.validate.decode_judge import MAX_ROWS_LISTED
from quark_ptq_eval.validate.report import CheckResult

if TYPE_CHECKING:
    import numpy as np

    from quark_ptq_eval.validate.decode_blocks import DecodeTarget
    from quark_ptq_eval.validate.decode_weights import RowErrors


@dataclass(frozen=True)
class Damage:
    """Rows of one weight the scheme rounded to (nearly) nothing, their scale certified by the consumer."""

    weight: str
    rows: list[int]
    nonzero: list[int]  # per row: codes that decode to something other than 0
    peak: list[float]  # per row: the largest |code|, in steps from the zero point
    columns: int  # elements per row
    certified_by: str  # the consumer whose columns gave the scale
    scale_error: float  # the largest certified relative error of those scales

    def as_json(self) -> dict[str, Any]:
        return {"weight": self.weight, "rows": self.rows, "nonzero_codes": self.nonzero, "max_code": self.peak,
                "codes_per_row": self.columns, "scale_from": self.certified_by,
                "scale_error": round(self.scale_error, 4)}

    def describe(self) -> str:
        shown = [f"{r} ({k} of {self.columns} codes non-zero, max |code| {p:g})"
                 for r, k, p in zip(self.rows, self.nonzero, self.peak, strict=True)][:MAX_ROWS_LISTED]
        more = f" and {len(self.rows) - MAX_ROWS_LISTED} more" if len(self.rows) > MAX_ROWS_LISTED else ""
        return (f"{self.weight}: rows {', '.join(shown)}{more}; their scale certified by {self.certified_by}'s "
                f"columns (within {self.scale_error:.1%})")


def uncertified(c: RowErrors, scale: np.ndarray, bound: np.ndarray, granted: np.ndarray) -> list[int]:
    """Rows over the bound, or whose estimated scale is no positive number, where the estimate's
    worst-case error ``bound`` exceeds the tolerance ``granted`` it: the failure may be the estimate's.
    A negative gain is never excused (a faithful code has its source's sign: the sum is >= 0)."""
    import numpy as np

    with np.errstate(invalid="ignore"):
        suspect = set(c.over) | set(np.flatnonzero(~(scale > 0) | ~np.isfinite(scale)).tolist())
        return sorted(r for r in suspect if not bound[r] <= granted[r] and not bound[r] < 0)


def column_scale(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``s`` per row from the consumer's column sums (``<w,w>``, ``<w,w_hat>``, ``<|w|, step>``, summed over
    the columns a row feeds) and its certified relative error (the module docstring's ``delta``)."""
    import numpy as np

    with np.errstate(divide="ignore", invalid="ignore"):
        scale = sums[1] / sums[0]
        bound = np.where(sums[1] > 0, 0.5 * sums[2] / sums[1], np.inf)
    return scale.astype(np.float32), bound.astype(np.float32)


def settled(c: RowErrors, rows: list[int]) -> list[int]:
    """The re-judged rows that now decode within the bound."""
    return [r for r in rows if r not in c.over and r not in c.zero_scale]


def record(result: CheckResult, damage: list[Damage]) -> None:
    """The damage in the check's stats (JSON) and notes (markdown): evidence for the verdict, never a failure."""
    if not damage:
        return
    rows = sum(len(d.rows) for d in damage)
    result.stats["damaged_rows"] = rows
    result.stats["quantization_damage"] = [d.as_json() for d in damage]
    result.notes.append(
        f"quantization damage, not an export fault ({rows} rows of {len(damage)} weights; Phase 3 measures what it "
        "costs): the scheme rounded these rows to (nearly) nothing, so their own codes cannot bound the scale "
        "folded into them; with the scale their consumer's columns certify, they decode within the bound")
    result.notes += [f"damage: {d.describe()}" for d in damage[:MAX_ROWS_LISTED]]


@dataclass(frozen=True)
class Intervals:
    """Per channel, the scales ``[lo, hi]`` under which every code of it is round-to-nearest of its source;
    per channel also the codes off their zero point and the largest (for the damage record)."""

    lo: np.ndarray
    hi: np.ndarray
    nonzero: np.ndarray
    peak: np.ndarray


def scale_intervals(target: DecodeTarget, cols: np.ndarray | None, divided: bool, slack: float) -> Intervals:
    """Where a row (``divided``: the row was divided by ``s``) or a column (multiplied by ``s``) allows ``s``
    to be, from the format's own arithmetic: code ``v`` stands for every ``x = w k / step + zero`` between the
    midpoints to its grid neighbours (beyond an end of the grid, the quantizer clamps: unbounded there), so
    each element bounds ``k`` (``1 / s`` or ``s``); a channel's interval is the elements' intersection,
    widened by the model's float rounding (``slack``, relative). No estimate: an empty interval is a fault
    no fold explains, a non-empty one is what round-to-nearest makes of the source for some ``s`` in it."""
    import numpy as np

    from quark_ptq_eval.validate import decode_formats as fmt
    from quark_ptq_eval.validate.decode_blocks import TileReader

    reader = TileReader(target)
    n = reader.rows if divided else reader.cols
    lo, hi = np.zeros(n, np.float64), np.full(n, np.inf, np.float64)
    nonzero, peak = np.zeros(n, np.int64), np.zeros(n, np.float64)
    values = fmt.grid(target.dtype).values.astype(np.float64)
    below = np.concatenate([[-np.inf], (values[:-1] + values[1:]) / 2])  # each grid value's lower midpoint
    above = np.concatenate([(values[:-1] + values[1:]) / 2, [np.inf]])
    axis = 1 if divided else 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for tile in reader.tiles():
            w = fmt.as_float(target.source, tile.w).astype(np.float64)
            if cols is not None:
                w = w * cols[None, tile.c0:tile.c1]
            width = (tile.c1 - tile.c0) // tile.scale.shape[1]
            step = np.repeat(tile.scale.astype(np.float64), width, axis=1)
            zero = np.repeat(tile.zero.astype(np.float64), width, axis=1)
            v = fmt.code_values(target.dtype, tile.codes).astype(np.float64)
            where = np.searchsorted(values, v)
            edge_lo, edge_hi = (below[where] - zero) * step, (above[where] - zero) * step
            # w k must lie in [edge_lo, edge_hi]: k's bounds flip with w's sign; w = 0 fits where the edges hold 0
            k_lo = np.where(w > 0, edge_lo / w, np.where(w < 0, edge_hi / w, np.where(edge_lo <= 0, 0.0, np.inf)))
            k_hi = np.where(w > 0, edge_hi / w, np.where(w < 0, edge_lo / w, np.where(edge_hi >= 0, np.inf, 0.0)))
            k_lo, k_hi = np.maximum(np.nan_to_num(k_lo, nan=0.0), 0.0), np.nan_to_num(k_hi, nan=np.inf)
            off = np.abs(v - zero)
            if divided:  # k = 1 / s
                s_lo, s_hi = 1.0 / k_hi.min(axis=1), 1.0 / k_lo.max(axis=1)
                sl = slice(tile.r0, tile.r1)
            else:
                s_lo, s_hi = k_lo.max(axis=0), k_hi.min(axis=0)
                sl = slice(tile.c0, tile.c1)
            lo[sl], hi[sl] = np.maximum(lo[sl], s_lo), np.minimum(hi[sl], s_hi)
            nonzero[sl] += (off != 0).sum(axis=axis)
            peak[sl] = np.maximum(peak[sl], off.max(axis=axis))
    return Intervals(lo * (1 - slack), hi * (1 + slack), nonzero, peak)
