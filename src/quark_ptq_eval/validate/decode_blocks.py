"""One quantized weight's stored tensors, read a tile at a time through the file.

Each tensor is seen as a matrix in the weight's logical orientation (codes and source ``[out, in]``,
scales and zero points ``[out, groups]``) whatever its storage: transposed (int4 / int8 per group,
a fused expert's ``[in, out]`` slice) or packed (eight int4 codes per int32, two fp4 codes per byte,
four fp6 codes in three bytes; decode_formats.py). ``TileReader`` cuts ``[out, in]`` into boxes of
at most ``TILE_ELEMENTS`` and reads each tensor's part of one box at a time, so the decode check's
memory follows the tile, not the tensor (nor the model): a few tens of MB per worker.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.safetensors_io import TensorInfo
from quark_ptq_eval.validate import decode_formats as fmt

if TYPE_CHECKING:
    import numpy as np

TILE_ELEMENTS = 1 << 22  # per tensor and read (8 MiB of a BF16 source); decoded CHUNK_ELEMENTS at a time
COLUMN_TILE = 2048  # a tile's columns where a transposed tensor of a grouped weight is read by groups


@dataclass(frozen=True)
class DecodeTarget:
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


@dataclass(frozen=True)
class Plane:
    """A stored 2-D tensor as a logical ``[rows, cols]`` matrix; ``unit``: (logical, stored) elements
    per packing unit along the stored rows (int4 words: (8, 1), fp6: (4, 3))."""

    info: TensorInfo
    stored: tuple[int, int]
    transposed: bool = False  # stored ``[cols, rows]``
    unit: tuple[int, int] = (1, 1)

    @property
    def shape(self) -> tuple[int, int]:
        major, minor = self.stored
        minor = minor * self.unit[0] // self.unit[1] if minor % self.unit[1] == 0 else -1
        return (minor, major) if self.transposed else (major, minor)

    def read(self, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
        """The stored elements holding logical ``rows`` x ``cols``, in stored orientation."""
        major, minor = (cols, rows) if self.transposed else (rows, cols)
        lo, so = self.unit
        return fmt.read_box(self.info, self.stored, major, (minor[0] // lo * so, -(-minor[1] // lo) * so))


def _stored(info: TensorInfo) -> tuple[int, int]:
    if len(info.shape) != 2:
        raise fmt.UnsupportedFormat(f"a {len(info.shape)}-D {info.name}")
    return int(info.shape[0]), int(info.shape[1])


def code_plane(t: DecodeTarget) -> tuple[Plane, Callable[[np.ndarray], np.ndarray]]:
    """Where the codes are and how a box of them becomes grid codes ``[out, in]`` (ints: the integers;
    floats: their bits, values via the table)."""
    import numpy as np

    dtype, stored = t.dtype, t.weight.dtype
    if dtype in ("int4", "uint4") and stored == "I32":
        return (Plane(t.weight, _stored(t.weight), True, (8, 1)),
                lambda raw: fmt.unpack_int4(raw, dtype == "int4", t.reorder))
    if dtype in ("int8", "uint8"):
        return Plane(t.weight, _stored(t.weight), t.grouped), (lambda raw: np.asarray(raw).T) if t.grouped else np.asarray
    if dtype.startswith("fp8") and stored.startswith("F8"):
        return Plane(t.weight, _stored(t.weight)), np.asarray
    if dtype == "fp4" and stored == "U8":
        return Plane(t.weight, _stored(t.weight), unit=(2, 1)), fmt.unpack_fp4
    if dtype.startswith("fp6") and stored == "U8":
        return Plane(t.weight, _stored(t.weight), unit=(4, 3)), fmt.unpack_fp6
    raise fmt.UnsupportedFormat(f"{dtype} stored as {stored}")


class PerRow:
    """A scale or zero point as logical ``[out, groups]``: one value for the tensor, one per row, or a plane."""

    def __init__(self, info: TensorInfo, rows: int, transposed: bool, convert: Callable[[np.ndarray], np.ndarray]):
        self.info, self.convert, self.constant, self.plane = info, convert, None, None
        shape = tuple(info.shape)
        if math.prod(shape) == 1:
            self.constant = float(convert(fmt.read_array(info)).reshape(-1)[0])
            self.shape = (rows, 1)
        elif len(shape) == 1:
            self.plane = Plane(info, (int(shape[0]), 1))
        elif len(shape) == 2:
            self.plane = Plane(info, (int(shape[0]), int(shape[1])), transposed)
        else:
            raise fmt.UnsupportedFormat(f"a {len(shape)}-D {info.name}")
        if self.plane is not None:
            self.shape = self.plane.shape

    def read(self, rows: tuple[int, int], groups: tuple[int, int]) -> np.ndarray:
        import numpy as np

        if self.plane is None:
            return np.full((rows[1] - rows[0], 1), self.constant, dtype=np.float32)
        raw = self.plane.read(rows, groups)
        values = np.asarray(self.convert(raw.T if self.plane.transposed else raw), dtype=np.float32)
        return np.ascontiguousarray(values[: rows[1] - rows[0]])


class PackedZero(PerRow):
    """An int4 zero point packed as the codes are, ``[groups, out / 8]`` (rows past ``out``: padding)."""

    def __init__(self, t: DecodeTarget):
        import numpy as np

        assert t.zero_point is not None
        self.info, self.constant = t.zero_point, None
        self.plane = Plane(t.zero_point, _stored(t.zero_point), True, (8, 1))
        # unpack_int4 takes the stored orientation and returns [out, groups]: PerRow.read hands it raw.T
        self.convert = lambda raw: fmt.unpack_int4(raw.T, t.dtype == "int4", t.reorder).astype(np.float32)
        self.shape = self.plane.shape


def scale_reader(t: DecodeTarget, rows: int) -> PerRow:
    if t.spec.get("scale_format") not in (None, "e8m0") or (t.scale.dtype not in fmt.NUMPY_FLOATS and t.scale.dtype
                                                            not in ("BF16", "U8", "F8_E8M0")):
        raise fmt.UnsupportedFormat(f"{t.spec.get('scale_format') or t.scale.dtype} scales")
    info = t.scale
    convert = fmt.e8m0 if t.spec.get("scale_format") == "e8m0" else (lambda raw: fmt.as_float(info, raw))
    return PerRow(info, rows, t.grouped and not t.dtype.startswith("fp"), convert)


def zero_reader(t: DecodeTarget, rows: int) -> PerRow | None:
    import numpy as np

    z = t.zero_point
    if z is None or t.dtype.startswith("fp"):
        return None
    if z.dtype == "I32" and t.dtype in ("int4", "uint4") and len(z.shape) == 2:
        return PackedZero(t)
    if z.dtype in fmt.NUMPY_FLOATS or z.dtype == "BF16":
        return PerRow(z, rows, t.grouped, lambda raw: fmt.as_float(z, raw))
    return PerRow(z, rows, t.grouped, lambda raw: np.asarray(raw).astype(np.float32))


@dataclass
class Tile:
    """One box of the weight: rows ``r0:r1``, columns ``c0:c1``, each tensor's part in ``[out, in]`` order."""

    r0: int
    r1: int
    c0: int
    c1: int
    w: np.ndarray  # the source's raw elements (widened to float32 a chunk at a time: fmt.as_float)
    codes: np.ndarray
    scale: np.ndarray  # [rows, groups of the box]
    zero: np.ndarray


class TileReader:
    """The tiles of one target, checked against each other's shapes before anything is read."""

    def __init__(self, t: DecodeTarget):
        self.t = t
        rows, cols = (int(x) for x in t.source.shape)
        self.rows, self.cols = rows, cols
        self.codes, self.decode = code_plane(t)
        if self.codes.shape != (rows, cols):
            raise fmt.UnsupportedFormat(f"codes of shape {list(self.codes.shape)} for a source of {[rows, cols]}")
        self.source = Plane(t.source, (cols, rows), True) if t.source.transposed else Plane(t.source, (rows, cols))
        self.scale, self.zero = scale_reader(t, rows), zero_reader(t, rows)
        groups = self.scale.shape[1]
        if self.scale.shape[0] != rows:
            raise fmt.UnsupportedFormat(f"scales of shape {list(t.scale.shape)} for {rows} rows")
        if cols % groups:
            raise fmt.UnsupportedFormat(f"{groups} scale groups over {cols} columns")
        if self.zero is not None and (self.zero.shape[1] != groups or self.zero.shape[0] < rows
                                      or (self.zero.shape[0] != rows and not isinstance(self.zero, PackedZero))):
            raise fmt.UnsupportedFormat(f"a zero point of shape {list(t.zero_point.shape)} for scales "  # type: ignore[union-attr]
                                        f"{[rows, groups]}")
        self.width = cols // groups
        self.tile_rows, self.tile_cols = self._tiling()

    def _planes(self) -> list[Plane]:
        readers = [r for r in (self.scale, self.zero) if r is not None and r.plane is not None]
        return [self.codes, self.source] + [r.plane for r in readers if r.plane is not None]

    def _tiling(self) -> tuple[int, int]:
        """Whole rows, unless a grouped weight has a transposed tensor: then groups at a time, so that
        every tensor's part of a tile is a few KB per stored row."""
        planes = self._planes()
        row_align = math.lcm(*(p.unit[0] for p in planes if p.transposed), 1)
        col_align = math.lcm(self.width, *(p.unit[0] for p in planes if not p.transposed))
        cols = self.cols
        if self.t.grouped and any(p.transposed for p in planes):
            cols = min(self.cols, max(col_align, COLUMN_TILE // col_align * col_align))
        rows = max(row_align, TILE_ELEMENTS // max(cols, 1) // row_align * row_align)
        return rows, cols

    def tiles(self) -> Iterator[Tile]:
        for r0 in range(0, self.rows, self.tile_rows):
            r1 = min(self.rows, r0 + self.tile_rows)
            for c0 in range(0, self.cols, self.tile_cols):
                yield self.read(r0, r1, c0, min(self.cols, c0 + self.tile_cols))

    def read(self, r0: int, r1: int, c0: int, c1: int) -> Tile:
        import numpy as np

        raw = self.source.read((r0, r1), (c0, c1))
        codes = self.decode(self.codes.read((r0, r1), (c0, c1)))[: r1 - r0]
        groups = (c0 // self.width, c1 // self.width)
        scale = self.scale.read((r0, r1), groups)
        zero = self.zero.read((r0, r1), groups) if self.zero is not None else np.zeros_like(scale)
        return Tile(r0, r1, c0, c1, raw.T if self.source.transposed else raw, codes, scale, zero)
