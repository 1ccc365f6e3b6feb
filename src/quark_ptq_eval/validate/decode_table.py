"""The decode check's fast path: a 16-bit source under one scale, judged through a table of its 65,536 values.

Where a weight has a single scale (and zero point), the code round-to-nearest gives an element depends on its
source bits alone, and a BF16 or F16 element has 65,536 of them. So each pattern is decoded once, with the very
arithmetic of the general path (``decode_weights``: ``x = w / scale + zero`` in float32, the grid's nearest
value, the exact step rule), into two tables: the code it must have and its error in steps. An element is then
judged by two lookups: a stored code equal to the table's is within its rounding by construction, and its error
is the table's; any other element (a tie the quantizer broke the other way, a signed zero, a fault) is judged by
the general path's own rule, element by element. Verdicts are the general path's; the error reported for an
element is the exact one (the general path may report its cheaper upper bound). On a 2-block Llama-3-70B-shaped
FP8 pair, one worker, the read included: 3.8 ns an element where the general path took 5.9 (a busy host, load 2.5 to
11, both); the 405 B validation's decode check reads 1.2 TB in ~11 min (docs/reliability.md).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quark_ptq_eval.validate import decode_formats as fmt

if TYPE_CHECKING:
    import numpy as np

    from quark_ptq_eval.validate.decode_blocks import DecodeTarget, Tile, TileReader

NO_CODE = -1  # the table's code for a source pattern no code decodes to (NaN, infinity): never equal to a stored one


@dataclass(frozen=True)
class CodeTable:
    code: np.ndarray  # int16 [65536]: the code round-to-nearest gives each source bit pattern
    steps: np.ndarray  # float32 [65536]: that code's error in steps (the exact rule)


def table_for(t: DecodeTarget, reader: TileReader) -> CodeTable | None:
    """The weight's table, or None where the general path must judge it (a source that is not 16-bit, scales
    or zero points that vary, a zero or non-finite scale)."""
    if t.source.dtype not in fmt.HALF_FLOATS or reader.scale.constant is None:
        return None
    zero = 0.0 if reader.zero is None else reader.zero.constant
    if zero is None or not math.isfinite(reader.scale.constant) or reader.scale.constant == 0:
        return None
    return _table(t.source.dtype, t.dtype, reader.scale.constant, zero)


@functools.lru_cache(maxsize=64)  # a model's weights share few scales rarely; the cost is ~10 ms a table
def _table(source_dtype: str, dtype: str, scale: float, zero: float) -> CodeTable:
    import numpy as np

    w = fmt.float_of(source_dtype, np.arange(65536, dtype=np.uint16))
    grid = fmt.grid(dtype)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        x = w.reshape(65536, 1, 1) / np.full((65536, 1), scale, np.float32)[:, :, None]  # as _Chunk divides
        x = x.reshape(65536)
        if zero:
            x = x + np.float32(zero)
        nearest = fmt.nearest_on_grid(x, grid)
        steps = fmt.grid_steps(x, nearest, grid).astype(np.float32)
    code = _codes_of(nearest, x, dtype)
    code[~np.isfinite(x)] = NO_CODE
    return CodeTable(code, steps)


def _codes_of(values: np.ndarray, x: np.ndarray, dtype: str) -> np.ndarray:
    """The code of each grid value (minifloats: its bits; a zero takes the sign of ``x``, as a float cast does)."""
    import numpy as np

    if dtype not in fmt.MINIFLOATS:
        ints: np.ndarray = np.nan_to_num(values).astype(np.int16)
        return ints
    table = fmt.minifloat_table(dtype)
    finite = np.flatnonzero(np.isfinite(table))
    order = np.argsort(table[finite], kind="stable")
    ordered, codes = table[finite][order], finite[order]
    found: np.ndarray = codes[np.clip(np.searchsorted(ordered, np.nan_to_num(values)), 0, len(codes) - 1)].astype(np.int16)
    zeros = np.flatnonzero(table == 0)
    with np.errstate(invalid="ignore"):
        negative = np.signbit(x) & (values == 0)
    found[negative] = zeros.max()
    found[(values == 0) & ~negative] = zeros.min()
    return found


def table_errors(t: DecodeTarget, tile: Tile, span: tuple[int, int], table: CodeTable, grid: fmt.Grid) -> np.ndarray:
    """Rows ``span`` of the tile in steps: the table's error where the stored code is the table's, the general
    path's exact rule elsewhere."""
    import numpy as np

    a, b = span
    bits = tile.w[a:b].view(np.uint16)
    codes = tile.codes[a:b]
    err = np.take(table.steps, bits)
    other = np.take(table.code, bits) != codes
    if other.any():
        rows, cols = np.nonzero(other)
        w = fmt.as_float(t.source, bits[rows, cols])
        scale, zero = tile.scale[a:b][rows, 0], tile.zero[a:b][rows, 0]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            quotient = w / scale
            err[rows, cols] = _exact(quotient + zero, quotient, zero, fmt.code_values(t.dtype, codes[rows, cols]), grid, t)
    return err


def _exact(x: np.ndarray, quotient: np.ndarray, zero: np.ndarray, v: np.ndarray, grid: fmt.Grid,
           t: DecodeTarget) -> np.ndarray:
    """The general path's rule for elements it finds over half a step (``_Chunk.errors``): exact steps, and for a
    half-float source the smaller of dividing in float32 and in the source's dtype (Quark may do either)."""
    import numpy as np

    err = fmt.grid_steps(x, v, grid)
    half = fmt.round_to(t.source.dtype, quotient) + zero
    exact: np.ndarray = np.minimum(err, fmt.grid_steps(half, v, grid)).astype(np.float32)
    return exact
