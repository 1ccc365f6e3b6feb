"""Activation scales that calibration never set.

Quark's observers give a scale of exactly 1.0 when they saw no data (their min/max still at the
initial +-inf). Under a static activation scheme that is the scale the export ships for a module no
calibration token reached: typically an MoE expert the router never chose for the calibration
text. Under int8 such an expert then rounds nearly every activation to zero (DeepSeek-V4's tiny
export, 3 of 4 experts in a layer: its experts module 85 % away from the source's); under fp8 it
loses the small activations. A calibrated per-tensor scale is amax / qmax, exactly 1.0 only by
coincidence. Only scalar-sized scale tensors are read, from the headers' offsets.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from quark_ptq_eval.base.safetensors_io import TensorInfo
from quark_ptq_eval.validate.kvcache import check_kv_scales
from quark_ptq_eval.validate.registry import CheckInputs, unreadable_headers
from quark_ptq_eval.validate.report import MAX_LISTED, CheckResult, Finding

if TYPE_CHECKING:
    import numpy as np

ACTIVATION_SCALES = (".input_scale", ".output_scale")  # a linear's input; its output where the KV cache is
UNOBSERVED = 1.0  # Quark's observer: no valid min/max -> scale 1.0 (quark/torch/quantization/observer)
MAX_ELEMENTS = 4096  # static scales are per tensor (or per channel at most): never read a large tensor


def check_calibration(ctx: CheckInputs) -> CheckResult:
    if (bad := unreadable_headers(ctx, "calibration")) is not None:
        return bad
    result = CheckResult("calibration")
    scales = {n: t for n, t in ctx.readable("output").items() if n.endswith(ACTIVATION_SCALES)}
    result.stats["activation_scales"] = len(scales)
    check_kv_scales(ctx, result, _read_floats)  # the KV cache's scales: present, finite, positive (kvcache.py)
    if not scales:
        result.notes.append("no static activation scales in the export (weight-only or dynamic activations)")
        return result
    unset = sorted(n for n, t in scales.items() if _all_unobserved(t))
    result.stats["uncalibrated"] = len(unset)
    for name in unset[:MAX_LISTED]:
        result.findings.append(Finding(
            name, "is exactly 1.0, the scale Quark keeps for an observer that saw no calibration data: this module's "
                  "activations are quantized with an uncalibrated scale.", side="quark",
            evidence=f"expected: a scale calibrated on the data; found 1.0 in {scales[name].file.name}"))
    if unset:
        experts = sum(".experts." in n for n in unset)
        cause = (f"{experts} of them in MoE experts the router sent no calibration token to; " if experts else "")
        result.notes.append(f"{len(unset)} of {len(scales)} activation scales were never calibrated ({cause}"
                            "quantize again with more or more varied calibration text: --num-calib-samples, "
                            "--calib-data)")
    return result


def _all_unobserved(info: TensorInfo) -> bool:
    count = math.prod(info.shape)
    if count == 0 or count > MAX_ELEMENTS:
        return False
    values = _read_floats(info, count)
    return values is not None and bool((values == UNOBSERVED).all())


def _read_floats(info: TensorInfo, count: int) -> np.ndarray | None:
    import numpy as np  # only where an export has static scales: keeps the validator's import light

    if info.dtype in ("F32", "F16"):
        return np.fromfile(info.file, dtype=np.float32 if info.dtype == "F32" else np.float16, count=count,
                           offset=info.start).astype(np.float32)
    if info.dtype == "BF16":  # the upper half of a float32
        raw = np.fromfile(info.file, dtype=np.uint16, count=count, offset=info.start).astype(np.uint32)
        return (raw << 16).view(np.float32)
    return None
