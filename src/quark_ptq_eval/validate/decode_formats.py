"""How Quark 0.13 stores a quantized weight, read back with numpy: codes, grids, scales, zero points.

What the exporter writes (``quark/torch/utils/pack.py``, ``export/nn/modules/realquantizer.py``):

- int8 / uint8: one code per byte, ``[out, in]``; fp8 (e4m3fn, e5m2): one float8 per byte.
- int4 / uint4 per group: the weight transposed to ``[in, out]``, eight codes per int32 along
  ``out``; nibble ``i`` (shift ``4 i``) holds element ``order[i]`` of its eight, ``order`` =
  0 2 4 6 1 3 5 7 when ``export.pack_method`` is ``reorder``, 0..7 otherwise. The scale is
  transposed to ``[in / group, out]``, the zero point packed the same way, ``[in / group, out / 8]``.
- fp4 (MX): two codes per byte along ``in``, the low nibble first; e2m1 bit layout. fp6: four codes
  in three bytes (``Pack_fp6``). An MX scale (``scale_format`` e8m0) is one exponent byte, 2^(b-127).

Everything is returned in the weight's logical ``[out, in]`` orientation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.safetensors_io import TensorInfo

if TYPE_CHECKING:
    import numpy as np

REORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # Pack_4_bits: nibble i of a word holds element REORDER[i]
MINIFLOATS = {"fp8_e4m3": (4, 3, "fn"), "fp8_e5m2": (5, 2, "ieee"), "fp4": (2, 1, "finite"),
              "fp6_e2m3": (2, 3, "finite"), "fp6_e3m2": (3, 2, "finite")}
NUMPY_FLOATS = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}


class UnsupportedFormat(ValueError):
    """A storage the decoder does not know: the check says 'not checked' instead of guessing."""


@dataclass(frozen=True)
class Grid:
    """The values a code can take, in the units of one scale step (ints: the codes themselves)."""

    values: np.ndarray  # sorted, unique, finite
    integer: bool

    @property
    def lowest(self) -> float:
        return float(self.values[0])

    @property
    def highest(self) -> float:
        return float(self.values[-1])


def _numpy_dtype(info: TensorInfo) -> np.dtype[Any]:
    import numpy as np

    dtype: Any = {"I8": np.int8, "U8": np.uint8, "I32": np.int32, "U32": np.uint32, "I16": np.int16, "U16": np.uint16,
             "BF16": np.uint16, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "F8_E8M0": np.uint8, "I64": np.int64,
             **{k: np.dtype(v) for k, v in NUMPY_FLOATS.items()}}.get(info.dtype)
    if dtype is None:
        raise UnsupportedFormat(f"{info.dtype} tensors")
    resolved: np.dtype[Any] = np.dtype(dtype)
    return resolved


def read_array(info: TensorInfo) -> np.ndarray:
    """The tensor's raw elements, read in one sequential pass."""
    return read_rows(info, 0, info.shape[0] if info.shape else 1)


def read_weight(info: TensorInfo) -> np.ndarray:
    """A 2-D weight as ``[out, in]``: a fused-expert slice stored ``[in, out]`` (``info.transposed``:
    gpt-oss experts, DBRX ``w2``) is read in its stored order and transposed (a view)."""
    if not info.transposed:
        return read_array(info)
    return read_array(dataclasses.replace(info, shape=tuple(reversed(info.shape)), transposed=False)).T


def read_rows(info: TensorInfo, first: int, end: int) -> np.ndarray:
    """Rows ``first:end`` of a row-major tensor (a scalar: its one element), one sequential read."""
    import numpy as np

    dtype = _numpy_dtype(info)
    shape = tuple(info.shape)
    per_row = math.prod(shape[1:]) if shape else 1
    count = (end - first) * per_row
    if count <= 0:
        return np.zeros((0, *shape[1:]) if shape else (), dtype=dtype)
    with open(info.file, "rb") as fh:
        fh.seek(info.start + first * per_row * dtype.itemsize)
        data = np.fromfile(fh, dtype=dtype, count=count)
    if data.size != count:
        raise UnsupportedFormat(f"{info.file.name} ends inside tensor {info.name}")
    return data.reshape((end - first, *shape[1:]) if shape else ())


def read_box(info: TensorInfo, shape: tuple[int, int], rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
    """Elements ``[r0:r1, c0:c1]`` of a tensor stored row-major as ``shape``, read through the file:
    whole rows in one read; a narrower box one read per row (never the rows' whole span, which may
    be the whole tensor)."""
    import numpy as np

    (r0, r1), (c0, c1) = rows, cols
    if (c0, c1) == (0, shape[1]):
        return read_rows(dataclasses.replace(info, shape=shape, transposed=False), r0, r1)
    dtype = _numpy_dtype(info)
    out = np.empty((r1 - r0, c1 - c0), dtype=dtype)
    width, row_bytes = (c1 - c0) * dtype.itemsize, shape[1] * dtype.itemsize
    with open(info.file, "rb", buffering=0) as fh:
        fd = fh.fileno()
        flat = memoryview(out.reshape(-1).view(np.uint8).data)
        for i in range(r1 - r0):
            offset = info.start + (r0 + i) * row_bytes + c0 * dtype.itemsize
            if os.preadv(fd, [flat[i * width: (i + 1) * width]], offset) != width:
                raise UnsupportedFormat(f"{info.file.name} ends inside tensor {info.name}")
    return out


def prefetch(infos: list[TensorInfo]) -> None:
    """Ask the kernel to start reading these tensors now (``POSIX_FADV_WILLNEED``), so that their
    reads overlap the arithmetic on the tensor before them; a hint: errors are ignored."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for info in infos:
        if info.nbytes <= 0:
            continue
        try:
            fd = os.open(info.file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            continue
        try:
            advise(fd, info.start, info.nbytes, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def as_float(info: TensorInfo, raw: np.ndarray) -> np.ndarray:
    """A float tensor's values as float32 (BF16 is the upper half of a float32)."""
    return float_of(info.dtype, raw)


def float_of(dtype: str, raw: np.ndarray) -> np.ndarray:
    """``as_float`` for elements stored as ``dtype`` (a safetensors dtype name)."""
    import numpy as np

    if dtype == "BF16":
        return (np.asarray(raw).astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return half_to_float(np.asarray(raw).view(np.uint16))
    if dtype in NUMPY_FLOATS:
        return np.asarray(raw, dtype=np.float32)
    raise UnsupportedFormat(f"a {dtype} source weight (dequantize it to BF16/F32 first)")


def half_to_float(bits: np.ndarray) -> np.ndarray:
    """IEEE half-precision bits -> float32, exactly, in vectorized integer ops: ~2.5x faster than
    numpy's scalar cast (the decode check's largest cost on F16 sources). The 15 magnitude bits
    shifted into a float32's place read as the value times 2^-112, subnormals included."""
    import numpy as np

    word = bits.astype(np.uint32)
    sign = (word & np.uint32(0x8000)) << np.uint32(16)
    word &= np.uint32(0x7FFF)
    word <<= np.uint32(13)
    special = word >= np.uint32(0x0F800000)  # exponent all ones: inf or NaN
    infinite = word[special] == np.uint32(0x0F800000) if special.any() else None
    value = word.view(np.float32)
    value *= np.float32(2.0 ** 112)
    if infinite is not None:
        value[special] = np.where(infinite, np.inf, np.nan)
    word |= sign
    return value


HALF_FLOATS = ("BF16", "F16")


def round_to(dtype: str, values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest BF16 / F16 (ties to even), as float32."""
    import numpy as np

    if dtype == "F16":
        return values.astype(np.float16).astype(np.float32)
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


@functools.cache
def minifloat_table(dtype: str) -> np.ndarray:
    """Every code's value (NaN for NaN/inf codes) of a 4-, 6- or 8-bit float, indexed by its bits."""
    import numpy as np

    ebits, mbits, kind = MINIFLOATS[dtype]
    bias = (1 << (ebits - 1)) - 1
    values = []
    for code in range(1 << (1 + ebits + mbits)):
        sign = -1.0 if code >> (ebits + mbits) else 1.0
        exp, man = (code >> mbits) & ((1 << ebits) - 1), code & ((1 << mbits) - 1)
        top = exp == (1 << ebits) - 1
        if kind == "fn" and top and man == (1 << mbits) - 1 or kind == "ieee" and top:
            values.append(float("nan"))
        elif exp == 0:
            values.append(sign * man / (1 << mbits) * 2.0 ** (1 - bias))
        else:
            values.append(sign * (1 + man / (1 << mbits)) * 2.0 ** (exp - bias))
    return np.array(values, dtype=np.float32)


@functools.cache
def inverse_min_gap(dtype: str) -> np.ndarray:
    """Per code of a minifloat: 1 / the smaller gap to its neighbours on the grid (0 for NaN codes)."""
    import numpy as np

    table, values = minifloat_table(dtype), grid(dtype).values
    out = np.zeros(len(table), np.float32)
    for code, value in enumerate(table):
        if not np.isfinite(value):
            continue
        p = int(np.searchsorted(values, value))
        gaps = [values[i + 1] - values[i] for i in (p - 1, p) if 0 <= i < len(values) - 1]
        out[code] = 1.0 / min(gaps)
    return out


def grid(dtype: str) -> Grid:
    import numpy as np

    if dtype in MINIFLOATS:
        table = minifloat_table(dtype)
        return Grid(np.unique(table[np.isfinite(table)]), integer=False)
    bits = int(dtype.lstrip("uint"))
    low, high = (0, (1 << bits) - 1) if dtype.startswith("uint") else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    return Grid(np.arange(low, high + 1, dtype=np.float32), integer=True)


def code_values(dtype: str, codes: np.ndarray) -> np.ndarray:
    """Codes as the grid values they stand for (minifloats: through the table; ints: themselves), float32."""
    import numpy as np

    if dtype in MINIFLOATS:
        values: np.ndarray = minifloat_table(dtype)[codes]
        return values
    return codes.astype(np.float32)


def nearest_on_grid(x: np.ndarray, grid: Grid) -> np.ndarray:
    """The grid value nearest each x (ints: rounded half to even; beyond the ends: the end)."""
    import numpy as np

    if grid.integer:
        rounded: np.ndarray = np.clip(np.rint(x), grid.lowest, grid.highest)
        return rounded
    idx = np.clip(np.searchsorted(grid.values, x), 1, len(grid.values) - 1)
    lo, hi = grid.values[idx - 1], grid.values[idx]
    return np.clip(np.where(x - lo <= hi - x, lo, hi), grid.lowest, grid.highest)


def grid_steps(x: np.ndarray, v: np.ndarray, grid: Grid) -> np.ndarray:
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


def unpack_int4(raw: np.ndarray, signed: bool, reorder: bool) -> np.ndarray:
    """Quark's ``[in, out / 8]`` int32 words -> int8 codes ``[out, in]`` (``Pack_4_bits.unpack``)."""
    import numpy as np

    words = np.asarray(raw).view(np.uint32)
    order = REORDER if reorder else tuple(range(8))
    codes = np.empty((*words.shape, 8), np.int8)  # one byte per code: no [in, out/8, 8] uint32 temporaries
    for i, element in enumerate(order):
        codes[..., element] = (words >> np.uint32(4 * i)) & np.uint32(0xF)
    codes = codes.reshape(words.shape[0], -1)
    if signed:
        codes[codes >= 8] -= 16
    return codes.T


def unpack_fp4(raw: np.ndarray) -> np.ndarray:
    """Two e2m1 codes per byte, the low nibble first (``Pack_fp4``) -> code bits ``[out, in]``."""
    import numpy as np

    data = np.asarray(raw)
    return np.stack([data & 0xF, data >> 4], axis=-1).reshape(*data.shape[:-1], -1)


def unpack_fp6(raw: np.ndarray) -> np.ndarray:
    """Four 6-bit codes in three bytes (``Pack_fp6``: v0 in the low 6 bits of byte 0, ...)."""
    import numpy as np

    data = np.asarray(raw).reshape(*raw.shape[:-1], -1, 3).astype(np.uint32)
    word = data[..., 0] | data[..., 1] << 8 | data[..., 2] << 16
    codes = np.stack([(word >> (6 * i)) & 0x3F for i in range(4)], axis=-1)
    return codes.reshape(*raw.shape[:-1], -1).astype(np.uint8)


def e8m0(raw: np.ndarray) -> np.ndarray:
    import numpy as np

    scales: np.ndarray = np.exp2(np.asarray(raw).astype(np.float32) - 127.0)
    return scales
