"""One quantized weight decoded against its source, in grid units, tile by tile (decode_blocks.py).

``x`` is where the source weight falls on the code grid (``w / scale + zero_point``); ``v`` is the
code the export stores. Round-to-nearest puts ``v`` on a grid point nearest ``x``: the error
``|x - v|`` is at most half the gap between the grid points around ``x`` (0.5 for integers), and
beyond the grid's ends, where the quantizer clamps, ``v`` is the end. Errors are reported in
steps: ``|x - v|`` divided by the local gap (an int step, a float's spacing there), so every
round-to-nearest format is held to 0.5 step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quark_ptq_eval.validate import decode_formats as fmt
from quark_ptq_eval.validate.decode_blocks import DecodeTarget, Tile, TileReader
from quark_ptq_eval.validate.decode_table import table_errors, table_for

if TYPE_CHECKING:
    import numpy as np

    Array = np.ndarray  # for a method whose local ``np`` is the lazily imported module

# Rows decoded at once: float32 work arrays of this many elements stay in the core's cache (1 MiB)
# and are reused by the allocator; at 4 Mi elements each new array page-faults, ~2.5x the CPU.
CHUNK_ELEMENTS = 1 << 18
MIN_CLIP = 0.55  # Quark's AWQ clip search (awq.py _compute_best_clip): max_val down to 1 - 9/20 of the group's


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
    zero_scale: dict[int, list[int]] = field(default_factory=dict)  # row -> groups: scale 0, source not 0
    # row_stats: the gain's worst-case relative error were every code within half a step of its source (decode_damage.py)
    gain_bound: np.ndarray | None = None
    nonzero: np.ndarray | None = None  # row_stats: per row, codes that decode to something other than 0
    peak: np.ndarray | None = None  # row_stats: per row, the largest |code| (from its zero point, in steps)
    col_sums: np.ndarray | None = None  # col_stats: per input column <w,w>, <w,w_hat>, <|w|, step> (3 x cols)


@dataclass(frozen=True)
class Tolerance:
    """Steps per unit |x| a fold's own uncertainty allows: ``sigmas * (rows[:, None] + cols) + slack``,
    built a box at a time (whole, it would be a float copy of the weight)."""

    rows: np.ndarray | None  # per output row (relative standard error), or none
    cols: np.ndarray | None  # per input column, or none
    sigmas: float
    slack: float

    def box(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        import numpy as np

        base = np.zeros((r1 - r0, 1), np.float32) if self.rows is None else self.rows[r0:r1, None]
        if self.cols is not None:
            base = base + self.cols[None, c0:c1]
        box: np.ndarray = self.sigmas * base + self.slack
        return box


@dataclass(frozen=True)
class Fold:
    """A per-channel scale an algorithm moved into this weight: ``w * cols / rows[:, None]``."""

    cols: np.ndarray | None = None
    rows: np.ndarray | None = None
    tolerance: Tolerance | None = None  # the fold's own uncertainty
    origin: str = ""  # where the scale was read, for messages


def values_of(t: DecodeTarget, code_rows: np.ndarray) -> np.ndarray:

    return fmt.code_values(t.dtype, code_rows)


def compare(t: DecodeTarget, limit: float, fold: Fold | None = None, rtn_reference: bool = False,
            clipped: bool = False, row_stats: bool = False, col_stats: bool = False) -> RowErrors:
    """Decode ``t`` and compare it with its source, a tile at a time read through the file and a
    cache-sized chunk of it at a time decoded (see the module docstring); ``limit`` (steps) decides
    which rows and groups are listed as over. ``clipped``: the algorithm searched a clip range per
    group (AWQ), so a source value beyond it decodes to its group's extreme code. ``row_stats``
    (implied by ``rtn_reference``): also each row's gain and error, the gain's worst-case error, the
    codes that survive and the largest; ``col_stats``: each input column's sums for the same. Numeric warnings (a zero scale
    divides by zero) are never printed: what they mean is in the result (``zero_scale``, ``over``)."""
    import numpy as np

    reader = TileReader(t)
    rows, cols = reader.rows, reader.cols
    grid = fmt.grid(t.dtype)
    result = RowErrors(rows, cols, np.zeros(rows, np.float32), np.zeros(rows, np.int64))
    sums = np.zeros((7, rows), np.float64)  # <w,w>, <w,w_hat>, ||w - w_hat||^2, ||w - rtn||^2, <|w|, step>, codes, peak
    col_sums = np.zeros((3, cols), np.float64) if col_stats else None  # <w,w>, <w,w_hat>, <|w|, step> per column
    plain = fold is None and not (rtn_reference or clipped or row_stats or col_stats)
    table = table_for(t, reader) if plain else None  # one scale over a 16-bit source: decoded once per pattern
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for tile in reader.tiles():
            step = max(1, CHUNK_ELEMENTS // max(tile.c1 - tile.c0, 1))
            for a in range(0, tile.r1 - tile.r0, step):
                b = min(tile.r1 - tile.r0, a + step)
                if table is not None:
                    err = table_errors(t, tile, (a, b), table, grid)
                    _record(result, err, tile.r0 + a, tile.c0, reader.width, limit)
                    continue
                _compare_chunk(t, tile, (a, b), _Options(limit, fold, rtn_reference, clipped, row_stats, grid),
                               result, (sums, col_sums))
        result.gain = sums[1] / sums[0]
        result.rel_error = np.sqrt(sums[2] / sums[0])
        result.rtn_error = np.sqrt(sums[3] / sums[0]) if rtn_reference else None
        if row_stats:
            result.gain_bound, result.nonzero, result.peak = 0.5 * sums[4] / sums[1], sums[5].astype(int), sums[6]
        result.col_sums = col_sums
    return result


@dataclass(frozen=True)
class _Options:
    limit: float
    fold: Fold | None
    rtn_reference: bool
    clipped: bool
    row_stats: bool
    grid: fmt.Grid


def _compare_chunk(t: DecodeTarget, tile: Tile, span: tuple[int, int], o: _Options, result: RowErrors,
                   all_sums: tuple[np.ndarray, np.ndarray | None]) -> None:
    """Rows ``span`` of one tile (relative to it) judged, and their sums accumulated."""
    import numpy as np

    a, b = span
    r0, r1, c0, c1 = tile.r0 + a, tile.r0 + b, tile.c0, tile.c1
    w = _folded(fmt.as_float(t.source, tile.w[a:b]), o.fold, r0, r1, c0, c1)
    zero = tile.zero[a:b]
    chunk = _Chunk(t, w, tile.scale[a:b], zero, tile.codes[a:b])
    err = chunk.errors(o.grid, o.limit)
    if o.clipped:
        err = _within_clip(err, chunk.x, chunk.v, chunk.spread(zero), chunk.width)
    if o.fold is not None and o.fold.tolerance is not None:
        err = np.maximum(err - o.fold.tolerance.box(r0, r1, c0, c1) * np.abs(chunk.x), 0.0)
    if chunk.dead is not None:
        err = _zero_scales(result, chunk, w, err, r0, c0)
    _record(result, err, r0, c0, chunk.width, o.limit)
    sums, col_sums = all_sums
    if o.row_stats or o.rtn_reference or col_sums is not None:
        rtn = chunk.dequantized(fmt.nearest_on_grid(chunk.x, o.grid)) if o.rtn_reference else None
        w_hat = chunk.dequantized(chunk.v)
        _accumulate(sums, r0, r1, w, w_hat, rtn)
        if o.row_stats or col_sums is not None:
            _accumulate_bounds(all_sums, (r0, r1, c0, c1), chunk, w, w_hat)


def _zero_scales(result: RowErrors, chunk: _Chunk, w: np.ndarray, err: np.ndarray, r0: int, c0: int) -> np.ndarray:
    """Elements under a zero scale decode to 0 whatever their (finite) code: right where the source
    is 0 (all-zero rows, pruned or padded), a ``zero_scale`` finding where it is not (not also 'over')."""
    import numpy as np

    assert chunk.dead is not None
    dead = chunk.spread(chunk.dead)
    err = np.where(dead, np.where(np.isfinite(chunk.v), 0.0, np.inf), err).astype(np.float32)
    alive = (dead & (w != 0)).reshape(chunk.rows, chunk.groups, chunk.width).any(axis=2)
    for row in np.flatnonzero(alive.any(axis=1)):
        groups = np.flatnonzero(alive[row]) + c0 // chunk.width
        result.zero_scale.setdefault(r0 + int(row), []).extend(int(g) for g in groups)
    return err


class _Chunk:
    """Rows of one tensor on the grid: ``x`` (the source), ``v`` (the codes); scales broadcast per group."""

    def __init__(self, t: DecodeTarget, w: np.ndarray, scale: np.ndarray, zero: np.ndarray, code_rows: np.ndarray):
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
        self.dead = None if scale.all() else scale == 0  # [rows, groups]: w / 0 is no position on the grid
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
            err[suspect] = fmt.grid_steps(self.x[suspect], self.v[suspect], grid)
            if self.t.source.dtype in fmt.HALF_FLOATS:  # Quark may divide in the model's dtype: either is exact
                x = fmt.round_to(self.t.source.dtype, self.quotient[suspect]) + self.spread(self.zero)[suspect]
                err[suspect] = np.minimum(err[suspect], fmt.grid_steps(x, self.v[suspect], grid))
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


def _folded(w: np.ndarray, fold: Fold | None, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
    if fold is None:
        return w
    if fold.cols is not None:
        w = w * fold.cols[None, c0:c1]
    if fold.rows is not None:
        w = w / fold.rows[r0:r1, None]
    return w


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


def _record(result: RowErrors, err: np.ndarray, r0: int, c0: int, width: int, limit: float) -> None:
    """Each row's worst element and its groups over ``limit``; a tile right of the first (``c0``)
    replaces a row's worst only where larger, so the first of equal maxima stays (as ``argmax``)."""
    import numpy as np

    r1 = r0 + err.shape[0]
    col = np.argmax(err, axis=1)
    worst = err[np.arange(err.shape[0]), col]
    if c0 == 0:
        result.worst_col[r0:r1], result.worst_steps[r0:r1] = col, worst
    else:
        held = result.worst_steps[r0:r1]
        better = (worst > held) | (np.isnan(worst) & ~np.isnan(held))
        result.worst_col[r0:r1][better] = col[better] + c0
        held[better] = worst[better]
    for row in np.nonzero(worst > limit)[0]:
        groups = np.nonzero((err[row] > limit).reshape(-1, width).any(axis=1))[0] + c0 // width
        result.over.setdefault(r0 + int(row), []).extend(int(g) for g in groups)


def _accumulate_bounds(all_sums: tuple[np.ndarray, np.ndarray | None], box: tuple[int, int, int, int],
                       chunk: _Chunk, w: np.ndarray, w_hat: np.ndarray) -> None:
    """What certifies a gain: <|w|, step> (a code within half a step moves <w, w_hat> by at most half of it),
    per row and (``col_sums``) per column; per row also the codes off their zero point and the largest.
    A minifloat's step is its smaller gap beside the code: an under-estimate (a row is excused less often, never more)."""
    import numpy as np

    sums, col_sums = all_sums
    r0, r1, c0, c1 = box
    step = chunk.spread(chunk.scale)
    if chunk.t.dtype in fmt.MINIFLOATS:
        step = step / fmt.inverse_min_gap(chunk.t.dtype)[chunk.codes]
    with np.errstate(invalid="ignore", over="ignore"):
        weighted = np.abs(w) * step
        sums[4, r0:r1] += weighted.sum(axis=1, dtype=np.float64)
        codes = np.abs(chunk.v - chunk.spread(chunk.zero))
        sums[5, r0:r1] += (codes != 0).sum(axis=1)
        sums[6, r0:r1] = np.maximum(sums[6, r0:r1], codes.max(axis=1))
        if col_sums is not None:
            col_sums[0, c0:c1] += np.einsum("ij,ij->j", w, w, dtype=np.float64)
            col_sums[1, c0:c1] += np.einsum("ij,ij->j", w, w_hat, dtype=np.float64)
            col_sums[2, c0:c1] += weighted.sum(axis=0, dtype=np.float64)


def _accumulate(sums: np.ndarray, r0: int, r1: int, w: np.ndarray, w_hat: np.ndarray, rtn: np.ndarray | None) -> None:
    import numpy as np

    with np.errstate(invalid="ignore", over="ignore"):  # a tile right of the first adds to its rows' sums
        sums[0, r0:r1] += np.einsum("ij,ij->i", w, w, dtype=np.float64)
        sums[1, r0:r1] += np.einsum("ij,ij->i", w, w_hat, dtype=np.float64)
        diff = w - w_hat
        sums[2, r0:r1] += np.einsum("ij,ij->i", diff, diff, dtype=np.float64)
        if rtn is not None:
            diff = w - rtn
            sums[3, r0:r1] += np.einsum("ij,ij->i", diff, diff, dtype=np.float64)
