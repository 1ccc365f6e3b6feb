"""A tensor written in a wider float type with every value equal: benign drift, not a change.

Quark's export writes some tensors the model keeps in float32 (DeepSeek-V3 / MiniMax-M2's
``e_score_correction_bias``) as F32 where the source stored BF16. BF16 and F16 widen to F32
exactly, so the tensor is unchanged when each output value is the widened source value, bit for
bit; this module checks that on the payloads (bounded: small tensors only, as these are).
"""

from __future__ import annotations

from quark_ptq_eval.base.safetensors_io import TensorInfo
from quark_ptq_eval.validate.report import Side

WIDENINGS = {("BF16", "F32"), ("F16", "F32")}
MAX_BYTES = 64 * 2**20  # biases and norms, never a weight matrix
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32", "F64"})


def _payload(info: TensorInfo) -> bytes:
    with open(info.file, "rb") as f:
        f.seek(info.start)
        return f.read(info.nbytes)


def is_lossless_widening(src: TensorInfo, out: TensorInfo) -> bool:
    """Same shape, BF16/F16 -> F32, and every output value equals its source value exactly."""
    if src.shape != out.shape or (src.dtype, out.dtype) not in WIDENINGS or out.nbytes > MAX_BYTES:
        return False
    import numpy as np

    try:
        a, b = _payload(src), _payload(out)
    except OSError:
        return False
    if src.dtype == "BF16":
        widened = (np.frombuffer(a, dtype="<u2").astype(np.uint32) << 16).view("<f4")
    else:
        widened = np.frombuffer(a, dtype="<f2").astype("<f4")
    return widened.tobytes() == b


def widening_note(src: TensorInfo, out: TensorInfo) -> str:
    return (f"written as {out.dtype} where the source has {src.dtype}, every value equal: a lossless widening "
            "(the model keeps this tensor in float32)")


def header_change(src: TensorInfo, out: TensorInfo) -> tuple[Side, str]:
    """(side, evidence) of a tensor that should have kept its header and did not, one rule for every
    check: a float tensor of the same shape in another float dtype was loaded in another dtype (the
    environment); one stored in integer or FP8 codes, or reshaped (packed), was quantized by Quark."""
    if src.shape == out.shape and src.dtype in FLOAT_DTYPES and out.dtype in FLOAT_DTYPES:
        return "environment", "same shape, other float dtype: the model was loaded in another dtype"
    return "quark", f"stored as {out.dtype} {list(out.shape)}: quantized codes, not the source's {src.dtype} values"
