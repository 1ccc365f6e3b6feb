"""Activation quantizers as an export's ``quantization_config`` defines them, written from the spec.

Each spec Quark writes for ``input_tensors`` / ``output_tensors`` (dtype, qscheme, static or dynamic,
symmetric, scale format) becomes one fake-quantizer in float32 (a static FP8 scale divides in the model's dtype,
as the loader does: ``compute_dtype``): the value the loader's kernels must
reproduce up to floating-point rounding. Static scales (and zero points) are read from the export's
own ``<module>.input_scale`` / ``.output_scale`` tensors; dynamic ones are computed from the tensor
as Quark's dynamic quantizers do (symmetric: absmax / half the integer range; floats: absmax / the
format's largest value; MX: a shared power-of-two exponent per block, Quark's "even" rounding of the
block's absmax). A spec not written here raises ``UnsupportedSpec``: the module is judged without
emulation rather than against a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.validate import decode_formats as fmt

if TYPE_CHECKING:
    import numpy as np
    import torch

    from quark_ptq_eval.base.safetensors_io import TensorInfo

FLOAT_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
MX_ELEMENTS = {"fp4": (1, 2), "fp6_e2m3": (3, 2), "fp6_e3m2": (2, 4), "fp8_e4m3": (3, 8)}  # (mantissa bits, emax)


class UnsupportedSpec(ValueError):
    """An activation spec this emulation does not implement."""


@dataclass
class ActivationQuantizer:
    """``q(x)``: x fake-quantized as one spec says (float32 in, float32 out)."""

    dtype: str
    qscheme: str
    dynamic: bool
    scale: torch.Tensor | None = None  # static
    zero_point: torch.Tensor | None = None
    group_size: int = 0
    mx_element: str | None = None
    enabled: bool = True
    # The dtype the loaded model computes in (its source's: BF16 for a BF16 model). A static FP8 quantizer divides
    # by its scale in that dtype, as the loader does (Quark's per-tensor FP8 fake-quantizer divides in the
    # activation's dtype; its integer one converts to float32 first): x / scale rounded to BF16 before the cast
    # to FP8 moves ~2 % of a BF16 model's activations to the neighbouring grid point (double rounding), which read
    # 1.8-3 % on an FP8 KV cache's v_proj against a float32 division (docs/reliability.md).
    compute_dtype: torch.dtype | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        x = x.float()
        if self.mx_element:
            return _mx(x, self.mx_element, self.group_size)
        scale = self._dynamic_scale(x) if self.dynamic else self.scale
        assert scale is not None  # a static quantizer is built with its scale (quantizer_for)
        if self.dtype in FLOAT_MAX:
            return _float(_divide(x, scale, None if self.dynamic else self.compute_dtype), scale, self.dtype)
        return _integer(x / scale, scale, self.zero_point, self.dtype)

    def _dynamic_scale(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        if self.qscheme == "per_tensor":
            amax = x.abs().amax()
        elif self.qscheme == "per_channel":  # activations: one scale per token
            amax = x.abs().amax(dim=-1, keepdim=True)
        else:
            raise UnsupportedSpec(f"dynamic {self.qscheme} activations")
        top = FLOAT_MAX.get(self.dtype) or (int_range(self.dtype)[1] - int_range(self.dtype)[0]) / 2
        return torch.clamp(amax / top, min=torch.finfo(torch.float32).tiny)


def quantizer_for(spec: dict[str, Any], output: dict[str, TensorInfo], prefix: str,
                  compute_dtype: torch.dtype | None = None) -> ActivationQuantizer | None:
    """The quantizer of one activation spec; ``prefix``: ``<module>.input`` or ``<module>.output``;
    ``compute_dtype``: the dtype the loaded model computes in (None: float32)."""
    import torch

    dtype, qscheme = str(spec.get("dtype")), str(spec.get("qscheme"))
    dynamic = bool(spec.get("is_dynamic"))
    element = spec.get("mx_element_dtype") or ("fp4" if dtype == "fp4" and spec.get("scale_format") == "e8m0"
                                               else None)
    if dtype in ("mx", "fp4", "fp6_e2m3", "fp6_e3m2") or element:
        element = str(element or dtype)
        if element not in MX_ELEMENTS or not dynamic or not spec.get("group_size"):
            raise UnsupportedSpec(f"{dtype} activations ({element}, {'dynamic' if dynamic else 'static'})")
        return ActivationQuantizer(dtype, qscheme, True, group_size=int(spec["group_size"]), mx_element=element)
    if dtype not in FLOAT_MAX and not is_int(dtype):
        raise UnsupportedSpec(f"{dtype} activations")
    if dynamic:
        if not spec.get("symmetric", True) and dtype not in FLOAT_MAX:
            raise UnsupportedSpec("asymmetric dynamic activations")
        return ActivationQuantizer(dtype, qscheme, True)
    if qscheme != "per_tensor":
        raise UnsupportedSpec(f"static {qscheme} activations")
    scale = read_scale(output, f"{prefix}_scale")
    if scale is None:
        raise UnsupportedSpec(f"no {prefix}_scale tensor in the export")
    zero = read_scale(output, f"{prefix}_zero_point")
    return ActivationQuantizer(dtype, qscheme, False, torch.from_numpy(scale).reshape(()),
                               None if zero is None else torch.from_numpy(zero).reshape(()),
                               compute_dtype=None if compute_dtype == torch.float32 else compute_dtype)


def read_scale(output: dict[str, TensorInfo], name: str) -> np.ndarray | None:
    info = output.get(name)
    if info is None:
        return None
    import numpy as np

    raw = np.atleast_1d(fmt.read_array(info))  # a 0-d BF16 scale would view as a numpy scalar
    if info.dtype in fmt.NUMPY_FLOATS or info.dtype in fmt.HALF_FLOATS:
        return np.asarray(fmt.as_float(info, raw), dtype=np.float32)
    return raw.astype(np.float32)  # an integer zero point


def is_int(dtype: str) -> bool:
    return dtype.lstrip("u").startswith("int") and dtype.lstrip("uint").isdigit()


def int_range(dtype: str) -> tuple[int, int]:
    bits = int(dtype.lstrip("uint"))
    return (0, (1 << bits) - 1) if dtype.startswith("uint") else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)


def _divide(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``x / scale`` in float32, or rounded to ``dtype`` where the runtime divides in it."""
    if dtype is None:
        return x / scale
    return (x.to(dtype) / scale.to(dtype)).float()


def _integer(ratio: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: str) -> torch.Tensor:
    import torch

    low, high = int_range(dtype)
    z = zero.float() if zero is not None else torch.zeros((), dtype=torch.float32)
    codes = torch.clamp(torch.round(ratio) + z, low, high)  # torch.round: half to even, Quark's half_even
    return (codes - z) * scale


def _float(ratio: torch.Tensor, scale: torch.Tensor, dtype: str) -> torch.Tensor:
    import torch

    top = FLOAT_MAX[dtype]
    target = torch.float8_e4m3fn if dtype == "fp8_e4m3" else torch.float8_e5m2
    return torch.clamp(ratio, -top, top).to(target).float() * scale


def _mx(x: torch.Tensor, element: str, block: int) -> torch.Tensor:
    """MX along the last axis: per block of ``block`` a power-of-two scale from the block's absmax
    (rounded up where its mantissa is within half an element step of the next power, Quark's "even"),
    elements rounded to the element grid, saturating at its largest value."""
    import torch

    mbits, emax = MX_ELEMENTS[element]
    shape = x.shape
    if shape[-1] % block:
        raise UnsupportedSpec(f"MX blocks of {block} over a last dimension of {shape[-1]}")
    blocks = x.reshape(-1, shape[-1] // block, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    bits = amax.view(torch.int32) + (1 << (23 - mbits - 1))
    rounded = (bits & (((1 << 9) - 1) << 23)).view(torch.float32)
    rounded = torch.where(amax == 0, torch.full_like(amax, 2.0 ** -126), rounded)
    scale = torch.exp2(torch.clamp(torch.floor(torch.log2(rounded)) - emax, -127, 127))
    values = _to_grid(blocks / scale, element) * scale
    return values.reshape(shape)


def _to_grid(x: torch.Tensor, element: str) -> torch.Tensor:
    """Nearest value of the element format (ties to the even code), saturating at its largest value."""
    import numpy as np
    import torch

    table = fmt.minifloat_table(element)
    codes = np.flatnonzero(np.isfinite(table) & (table >= 0))
    order = np.argsort(table[codes], kind="stable")
    values = torch.from_numpy(table[codes][order].astype(np.float32))
    even = torch.from_numpy(codes[order] % 2 == 0)
    mag = x.abs().clamp(max=float(values[-1]))
    hi = torch.searchsorted(values, mag.contiguous()).clamp(1, len(values) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even[hi])
    return torch.where(pick_hi, values[hi], values[lo]) * torch.sign(x)
