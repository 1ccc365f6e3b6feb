"""One quantized weight decoded against its source, in grid units, row chunk by row chunk.

``x`` is where the source weight falls on the code grid (``w / scale + zero_point``); ``v`` is the
code the export stores. Round-to-nearest puts ``v`` on a grid point nearest ``x``: the error
``|x - v|`` is at most half the gap between the grid points around ``x`` (0.5 for integers), and
beyond the grid's ends, where the quantizer clamps, ``v`` is the end. Errors are reported in
steps: ``|x - v|`` divided by the local gap (an int step, a float's spacing there), so every
round-to-nearest format is held to 0.5 step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.safetensors_io import TensorInfo
from quark_ptq_eval.validate import decode_formats as fmt

if TYPE_CHECKING:
    import numpy as np

    Array = np.ndarray  # for a method whose local ``np`` is the lazily imported module

# Rows decoded at once: float32 work arrays of this many elements stay in the core's cache (1 MiB)
# and are reused by the allocator; at 4 Mi elements each new array page-faults, ~2.5x the CPU.
CHUNK_ELEMENTS = 1 << 18
MIN_CLIP = 0.55  # Quark's AWQ clip search (awq.py _compute_best_clip): max_val down to 1 - 9/20 of the group's


@dataclass(frozen=True)
class Target:
    """A quantized weight and what decodes it: its spec (one level) and the tensors it needs."""

    module: str
    weight: TensorInfo
    scale: TensorInfo
    zero_point: TensorInfo | None
    source: TensorInfo
    spec: dict[str, Any]
    reorder: bool  # export.pack_method == "reorder" (int4 nibble order)

    @property
    def dtype(self) -> str:
        return str(self.spec.get("dtype"))

    @property
    def grouped(self) -> bool:
        return self.spec.get("qscheme") == "per_group"

    @property
    def group_size(self) -> int:
        return int(self.spec.get("group_size") or 0) if self.grouped else 0

    def tensors(self) -> list[TensorInfo]:
        """Everything decoding this weight reads, in file order."""
        parts = [self.weight, self.scale, self.zero_point, self.source]
        return sorted((p for p in parts if p is not None), key=lambda p: (str(p.file), p.start))


@dataclass
class RowErrors:
    """Per-row figures of one tensor: what the bounds are checked against."""

    rows: int
    cols: int
    worst_steps: np.ndarray  # per row: the largest |x - v| in steps
    worst_col: np.ndarray  # per row: where it is
    over: dict[int, list[int]] = field(default_factory=dict)  # row -> groups (or [0]) with an element over
    gain: np.ndarray | None = None  # per row: least-squares gain of the decoded row on the source's
    rel_error: np.ndarray | None = None  # per row: ||w - w_hat|| / ||w||
    rtn_error: np.ndarray | None = None  # per row: the same for round-to-nearest with the export's scales


@dataclass(frozen=True)
class Fold:
    """A per-channel scale an algorithm moved into this weight: ``w * cols / rows[:, None]``."""

    cols: np.ndarray | None = None
    rows: np.ndarray | None = None
    tolerance: np.ndarray | None = None  # [rows or 1, cols or 1], steps per unit |x|: the fold's own uncertainty
    origin: str = ""  # where the scale was read, for messages


def codes(t: Target) -> np.ndarray:
    """The stored codes as grid values ``[out, in]`` (ints: the integers; floats: their values)."""
    import numpy as np

    raw = fmt.read_array(t.weight)
    dtype = t.dtype
    if dtype in ("int4", "uint4") and t.weight.dtype == "I32":
        return fmt.unpack_int4(raw, dtype == "int4", t.reorder)
    if dtype in ("int8", "uint8"):
        return np.asarray(raw).T if t.grouped else np.asarray(raw)
    if dtype.startswith("fp8") and t.weight.dtype.startswith("F8"):
        return np.asarray(raw)  # code bits; values via the table
    if dtype == "fp4" and t.weight.dtype == "U8":
        return fmt.unpack_fp4(raw)
    if dtype.startswith("fp6") and t.weight.dtype == "U8":
        return fmt.unpack_fp6(raw)
    raise fmt.UnsupportedFormat(f"{dtype} stored as {t.weight.dtype}")


def values_of(t: Target, code_rows: np.ndarray) -> np.ndarray:
    import numpy as np

    if t.dtype in fmt.MINIFLOATS:
        values: np.ndarray = fmt.minifloat_table(t.dtype)[code_rows]
        return values
    return code_rows.astype(np.float32)


def scales(t: Target, out: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero point) as ``[out, groups]`` float32 (one group per row where not grouped)."""
    import numpy as np

    raw = fmt.read_array(t.scale)
    if t.spec.get("scale_format") not in (None, "e8m0") or (t.scale.dtype not in fmt.NUMPY_FLOATS and t.scale.dtype
                                                            not in ("BF16", "U8", "F8_E8M0")):
        raise fmt.UnsupportedFormat(f"{t.spec.get('scale_format') or t.scale.dtype} scales")
    scale = fmt.e8m0(raw) if t.spec.get("scale_format") == "e8m0" else fmt.as_float(t.scale, raw)
    scale = _per_row(scale, out, transposed=t.grouped and not t.dtype.startswith("fp"))
    zero = np.zeros_like(scale)
    if t.zero_point is not None and not t.dtype.startswith("fp"):
        zraw = fmt.read_array(t.zero_point)
        if t.zero_point.dtype == "I32" and t.dtype in ("int4", "uint4") and zraw.ndim == 2:
            zero = fmt.unpack_int4(zraw, t.dtype == "int4", t.reorder).astype(np.float32)[: out]
        elif t.zero_point.dtype in fmt.NUMPY_FLOATS or t.zero_point.dtype == "BF16":
            zero = _per_row(fmt.as_float(t.zero_point, zraw), out, transposed=t.grouped)
        else:
            zero = _per_row(np.asarray(zraw).astype(np.float32), out, transposed=t.grouped)
    if t.zero_point is not None and zero.shape != scale.shape:
        raise fmt.UnsupportedFormat(f"a zero point of shape {list(t.zero_point.shape)} for scales {list(scale.shape)}")
    return scale, zero


def _per_row(values: np.ndarray, out: int, transposed: bool) -> np.ndarray:
    import numpy as np

    values = np.asarray(values, dtype=np.float32)
    if values.ndim == 0 or values.size == 1:
        return np.full((out, 1), float(values.reshape(-1)[0]), dtype=np.float32)
    if values.ndim == 1:
        return values.reshape(out, 1)
    return np.ascontiguousarray(values.T if transposed else values)


def compare(t: Target, limit: float, fold: Fold | None = None, rtn_reference: bool = False,
            clipped: bool = False, row_stats: bool = False) -> RowErrors:
    """Decode ``t`` and compare it with its source, row chunk by row chunk (see the module docstring);
    ``limit`` (steps) decides which rows and groups are listed as over. ``clipped``: the algorithm
    searched a clip range per group (AWQ), so a source value beyond it decodes to its group's extreme code.
    ``row_stats`` (implied by ``rtn_reference``): also each row's gain and error."""
    import numpy as np

    code_all = codes(t)
    rows, cols = t.source.shape
    if code_all.shape != (rows, cols):
        raise fmt.UnsupportedFormat(f"codes of shape {list(code_all.shape)} for a source of {[rows, cols]}")
    scale, zero = scales(t, rows)
    if cols % scale.shape[1]:
        raise fmt.UnsupportedFormat(f"{scale.shape[1]} scale groups over {cols} columns")
    grid = fmt.grid(t.dtype)
    result = RowErrors(rows, cols, np.zeros(rows, np.float32), np.zeros(rows, np.int64))
    sums = np.zeros((4, rows), np.float64)  # <w,w>, <w,w_hat>, ||w - w_hat||^2, ||w - rtn||^2
    source = fmt.read_weight(t.source)  # one sequential read; decoded a cache-sized chunk at a time
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w = _folded(fmt.as_float(t.source, source[r0:r1]), fold, r0, r1)
        chunk = _Chunk(t, w, scale[r0:r1], zero[r0:r1], code_all[r0:r1])
        err = chunk.errors(grid, limit)
        if clipped:
            err = _within_clip(err, chunk.x, chunk.v, chunk.spread(zero[r0:r1]), chunk.width)
        if fold is not None and fold.tolerance is not None:
            tol = fold.tolerance[r0:r1] if fold.tolerance.shape[0] > 1 else fold.tolerance
            err = np.maximum(err - tol * np.abs(chunk.x), 0.0)
        _record(result, err, r0, chunk.width, limit)
        if row_stats or rtn_reference:
            rtn = chunk.dequantized(_nearest(chunk.x, grid)) if rtn_reference else None
            _accumulate(sums, r0, r1, w, chunk.dequantized(chunk.v), rtn)
    with np.errstate(divide="ignore", invalid="ignore"):
        result.gain = sums[1] / sums[0]
        result.rel_error = np.sqrt(sums[2] / sums[0])
        result.rtn_error = np.sqrt(sums[3] / sums[0]) if rtn_reference else None
    return result


class _Chunk:
    """Rows of one tensor on the grid: ``x`` (the source), ``v`` (the codes); scales broadcast per group."""

    def __init__(self, t: Target, w: np.ndarray, scale: np.ndarray, zero: np.ndarray, code_rows: np.ndarray):
        import numpy as np

        self.t, self.codes, self.scale, self.zero = t, code_rows, scale, zero
        self.rows, cols = w.shape
        self.groups = scale.shape[1]
        self.width = cols // self.groups
        x = w.reshape(self.rows, self.groups, self.width) / scale[:, :, None]
        self.quotient = x.reshape(self.rows, cols)  # w / scale, before the zero point
        if zero.any():
            x = x + zero[:, :, None]
        self.x = x.reshape(self.rows, cols)
        self.v = values_of(t, code_rows)
        self._np = np

    def spread(self, per_group: np.ndarray) -> np.ndarray:
        return self._np.repeat(per_group, self.width, axis=1)

    def dequantized(self, grid_values: np.ndarray) -> np.ndarray:
        shaped = grid_values.reshape(self.rows, self.groups, self.width) - self.zero[:, :, None]
        dequantized: np.ndarray = (shaped * self.scale[:, :, None]).reshape(self.rows, -1)
        return dequantized

    def errors(self, grid: fmt.Grid, limit: float) -> np.ndarray:
        """|x - v| in steps. Fast: ints step 1, floats the smaller gap beside v (never larger than the
        exact error); the exact rule (``_steps``) only where that reads over half a step."""
        np = self._np
        err: Array = np.subtract(self.x, self.v)
        np.abs(err, out=err)
        if not grid.integer:
            err *= fmt.inverse_min_gap(self.t.dtype)[self.codes]
        suspect = _over(err, min(limit, 0.5))  # over half a step: the exact rule says
        if suspect is not None:
            err[suspect] = _steps(self.x[suspect], self.v[suspect], grid)
            if self.t.source.dtype in fmt.HALF_FLOATS:  # Quark may divide in the model's dtype: either is exact
                x = fmt.round_to(self.t.source.dtype, self.quotient[suspect]) + self.spread(self.zero)[suspect]
                err[suspect] = np.minimum(err[suspect], _steps(x, self.v[suspect], grid))
        steps: Array = err  # (err *= ... made it Any to mypy)
        return steps


def _over(err: np.ndarray, limit: float) -> tuple[np.ndarray, np.ndarray] | None:
    """(rows, columns) of the elements not within ``limit`` (NaN included), or None: rows first, by
    their maxima, so a healthy chunk costs one reduction rather than a 2-D ``nonzero``."""
    import numpy as np

    with np.errstate(invalid="ignore"):
        rows = np.flatnonzero(~(err.max(axis=1) <= limit))
        if not rows.size:
            return None
        r, c = np.nonzero(~(err[rows] <= limit))
    return rows[r], c


def _folded(w: np.ndarray, fold: Fold | None, r0: int, r1: int) -> np.ndarray:
    if fold is None:
        return w
    if fold.cols is not None:
        w = w * fold.cols[None, :]
    if fold.rows is not None:
        w = w / fold.rows[r0:r1, None]
    return w


def _steps(x: np.ndarray, v: np.ndarray, grid: fmt.Grid) -> np.ndarray:
    """|x - v| in steps of the grid around x (beyond its ends: the distance to the end counts half)."""
    import numpy as np

    with np.errstate(invalid="ignore"):
        dist = np.abs(x - v)
        if grid.integer:
            gap = np.maximum(1.0, 2.0 * np.maximum(grid.lowest - x, x - grid.highest))
        else:
            idx = np.clip(np.searchsorted(grid.values, x), 1, len(grid.values) - 1)
            gap = grid.values[idx] - grid.values[idx - 1]
            gap = np.maximum(gap, 2.0 * np.maximum(grid.lowest - x, x - grid.highest))
        err = dist / gap
    return np.where(np.isfinite(err), err, np.inf)  # a NaN code or scale is never within a bound


def _within_clip(err: np.ndarray, x: np.ndarray, v: np.ndarray, z: np.ndarray, width: int) -> np.ndarray:
    """An element on its group's largest (smallest) code with the source beyond it, but within what the
    clip search can cut (``MIN_CLIP`` of the group's range), was clipped: half a step."""
    import numpy as np

    grouped = v.reshape(v.shape[0], -1, width)
    top = np.repeat(grouped.max(axis=2), width, axis=1)
    bottom = np.repeat(grouped.min(axis=2), width, axis=1)
    reach = np.abs(x - z) <= (np.abs(v - z) + 0.5) / MIN_CLIP
    clipped = ((v == top) & (x >= v) | (v == bottom) & (x <= v)) & reach
    return np.where(clipped, np.minimum(err, 0.5), err)


def _nearest(x: np.ndarray, grid: fmt.Grid) -> np.ndarray:
    import numpy as np

    if grid.integer:
        rounded: np.ndarray = np.clip(np.rint(x), grid.lowest, grid.highest)
        return rounded
    idx = np.clip(np.searchsorted(grid.values, x), 1, len(grid.values) - 1)
    lo, hi = grid.values[idx - 1], grid.values[idx]
    return np.clip(np.where(x - lo <= hi - x, lo, hi), grid.lowest, grid.highest)


def _record(result: RowErrors, err: np.ndarray, r0: int, width: int, limit: float) -> None:
    import numpy as np

    r1 = r0 + err.shape[0]
    result.worst_col[r0:r1] = np.argmax(err, axis=1)
    result.worst_steps[r0:r1] = err[np.arange(err.shape[0]), result.worst_col[r0:r1]]
    for row in np.nonzero(result.worst_steps[r0:r1] > limit)[0]:
        groups = np.nonzero((err[row] > limit).reshape(-1, width).any(axis=1))[0]
        result.over[r0 + int(row)] = [int(g) for g in groups]


def _accumulate(sums: np.ndarray, r0: int, r1: int, w: np.ndarray, w_hat: np.ndarray, rtn: np.ndarray | None) -> None:
    import numpy as np

    with np.errstate(invalid="ignore", over="ignore"):
        sums[0, r0:r1] = np.einsum("ij,ij->i", w, w, dtype=np.float64)
        sums[1, r0:r1] = np.einsum("ij,ij->i", w, w_hat, dtype=np.float64)
        diff = w - w_hat
        sums[2, r0:r1] = np.einsum("ij,ij->i", diff, diff, dtype=np.float64)
        if rtn is not None:
            diff = w - rtn
            sums[3, r0:r1] = np.einsum("ij,ij->i", diff, diff, dtype=np.float64)
