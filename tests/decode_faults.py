"""Faults planted into a real Quark export's quantized weights, in its own packing (not through our decoder).

Each planter edits the raw tensors of one module in place (``read_tensors``/``write_tensors`` form)
and returns what it did. The packing is re-implemented here from Quark's ``pack.py`` (``Pack_4_bits``
with the reorder nibble order, ``Pack_fp4`` low nibble first), so the decoder under test is not
also the planter.
"""

from __future__ import annotations

import numpy as np

NIBBLE_OF = (0, 2, 4, 6, 1, 3, 5, 7)  # Quark's reorder: nibble i of a word holds element NIBBLE_OF[i]
NP = {"I8": np.int8, "U8": np.uint8, "I32": np.int32, "F32": np.float32, "F8_E4M3": np.uint8}
FAULTS = ("negate_row", "zero_rows", "scale_25", "zero_point_step", "swap_nibbles", "mx_exponent")
ROW = 5  # the output row a fault is planted into
ZEROED = (9, 10, 11, 12)


def _array(tensors: dict, name: str) -> np.ndarray:
    dtype, shape, data = tensors[name]
    return np.frombuffer(data, dtype=NP[dtype]).reshape(shape).copy()


def _store(tensors: dict, name: str, values: np.ndarray) -> None:
    dtype, shape, _ = tensors[name]
    tensors[name] = (dtype, shape, np.ascontiguousarray(values.astype(NP[dtype])).tobytes())


def _int4_codes(words: np.ndarray, signed: bool) -> np.ndarray:
    """[in, out/8] int32 -> [out, in] codes (element NIBBLE_OF[i] in nibble i)."""
    u = words.view(np.uint32)
    codes = np.zeros((u.shape[0], u.shape[1] * 8), np.int32)
    for i, element in enumerate(NIBBLE_OF):
        codes[:, element::8] = (u >> (4 * i)) & 0xF
    if signed:
        codes = np.where(codes >= 8, codes - 16, codes)
    return codes.T


def _int4_words(codes: np.ndarray) -> np.ndarray:
    t = (codes.T & 0xF).astype(np.uint32)
    words = np.zeros((t.shape[0], t.shape[1] // 8), np.uint32)
    for i, element in enumerate(NIBBLE_OF):
        words |= t[:, element::8] << (4 * i)
    return words.view(np.int32)


def _fp4_codes(data: np.ndarray) -> np.ndarray:
    return np.stack([data & 0xF, data >> 4], axis=-1).reshape(data.shape[0], -1)


def _fp4_bytes(codes: np.ndarray) -> np.ndarray:
    pairs = codes.reshape(codes.shape[0], -1, 2).astype(np.uint8)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _kind(tensors: dict, module: str) -> str:
    dtype = tensors[f"{module}.weight"][0]
    return {"I32": "int4", "U8": "fp4", "F8_E4M3": "fp8", "I8": "int8"}[dtype]


def _codes(tensors: dict, module: str, signed: bool = True) -> np.ndarray:
    raw = _array(tensors, f"{module}.weight")
    kind = _kind(tensors, module)
    return _int4_codes(raw, signed) if kind == "int4" else _fp4_codes(raw) if kind == "fp4" else raw.astype(np.int32)


def _put_codes(tensors: dict, module: str, codes: np.ndarray) -> None:
    kind = _kind(tensors, module)
    packed = _int4_words(codes) if kind == "int4" else _fp4_bytes(codes) if kind == "fp4" else codes
    _store(tensors, f"{module}.weight", packed)


def _zero_code(tensors: dict, module: str, rows) -> np.ndarray:
    """Per listed row, the code that decodes to zero (its zero point for integers; +0 for floats)."""
    name = f"{module}.weight_zero_point"
    if _kind(tensors, module) in ("fp4", "fp8") or name not in tensors:
        return np.zeros((len(rows), 1), np.int32)
    zp = _array(tensors, name)
    if zp.ndim == 0:
        return np.full((len(rows), 1), int(zp), np.int32)
    return _int4_codes(zp, True)[list(rows), :1]  # a row's first group: one zero point per row in these tests


def negate_row(tensors: dict, module: str) -> str:
    codes = _codes(tensors, module)
    kind = _kind(tensors, module)
    if kind in ("fp4", "fp8"):
        codes[ROW] ^= 0x8 if kind == "fp4" else 0x80  # the sign bit
    else:
        low, high = (-8, 7) if kind == "int4" else (-128, 127)
        zero = _zero_code(tensors, module, [ROW])[0, 0]
        codes[ROW] = np.clip(2 * zero - codes[ROW], low, high)
    _put_codes(tensors, module, codes)
    return f"output row {ROW} of {module} negated"


def zero_rows(tensors: dict, module: str) -> str:
    codes = _codes(tensors, module)
    codes[list(ZEROED)] = _zero_code(tensors, module, ZEROED)
    _put_codes(tensors, module, codes)
    return f"output rows {ZEROED[0]}-{ZEROED[-1]} of {module} zeroed"


def scale_25(tensors: dict, module: str) -> str:
    name = f"{module}.weight_scale"
    _store(tensors, name, _array(tensors, name) * np.float32(1.25))
    return f"{name} x1.25"


def zero_point_step(tensors: dict, module: str) -> str:
    name = f"{module}.weight_zero_point"
    zp = _array(tensors, name)
    if tensors[name][0] == "I32":  # packed like the weight: shift every group's zero point of row ROW
        codes = _int4_codes(zp, True)
        codes[ROW] += 1
        _store(tensors, name, _int4_words(codes))
    else:
        _store(tensors, name, zp + 1)
    return f"{name} one step up"


def swap_nibbles(tensors: dict, module: str) -> str:
    """Two 4-bit codes of one packed word (int32 word: 8 codes; fp4 byte: 2) swapped where they differ most."""
    raw = _array(tensors, f"{module}.weight")
    if _kind(tensors, module) == "fp4":
        lo, hi = raw & 0xF, raw >> 4
        spread = np.abs(_fp4_value(lo) - _fp4_value(hi))
        r, c = np.unravel_index(np.argmax(spread), spread.shape)
        raw[r, c] = (lo[r, c] << 4) | hi[r, c]
        _store(tensors, f"{module}.weight", raw)
        return f"the two fp4 codes of byte ({r}, {c}) of {module} swapped"
    u = raw.view(np.uint32)
    nib = np.stack([(u >> (4 * i)) & 0xF for i in range(8)], axis=-1).astype(np.int32)
    signed = np.where(nib >= 8, nib - 16, nib)
    spread = signed.max(axis=-1) - signed.min(axis=-1)
    r, c = np.unravel_index(np.argmax(spread), spread.shape)
    a, b = int(np.argmax(signed[r, c])), int(np.argmin(signed[r, c]))
    word = int(u[r, c])
    na, nb = (word >> 4 * a) & 0xF, (word >> 4 * b) & 0xF
    word &= ~((0xF << 4 * a) | (0xF << 4 * b)) & 0xFFFFFFFF
    u[r, c] = word | (nb << 4 * a) | (na << 4 * b)
    _store(tensors, f"{module}.weight", u.view(np.int32))
    return f"nibbles {a} and {b} of word ({r}, {c}) of {module} swapped (output rows {c * 8 + NIBBLE_OF[a]}, " \
           f"{c * 8 + NIBBLE_OF[b]})"


def _fp4_value(code: np.ndarray) -> np.ndarray:
    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    return table[code]


def mx_exponent(tensors: dict, module: str) -> str:
    name = f"{module}.weight_scale"
    scale = _array(tensors, name)
    scale[ROW, 1] += 1
    _store(tensors, name, scale)
    return f"the e8m0 exponent of block (row {ROW}, block 1) of {module} +1"


PLANTERS = {"negate_row": negate_row, "zero_rows": zero_rows, "scale_25": scale_25,
            "zero_point_step": zero_point_step, "swap_nibbles": swap_nibbles, "mx_exponent": mx_exponent}


def applicable(tensors: dict, module: str) -> list[str]:
    """The faults this module's format can carry."""
    kind = _kind(tensors, module)
    faults = ["negate_row", "zero_rows"]
    if tensors[f"{module}.weight_scale"][0] == "F32":
        faults.append("scale_25")
    if f"{module}.weight_zero_point" in tensors:
        faults.append("zero_point_step")
    if kind in ("int4", "fp4"):
        faults.append("swap_nibbles")
    if tensors[f"{module}.weight_scale"][0] == "U8":
        faults.append("mx_exponent")
    return faults
