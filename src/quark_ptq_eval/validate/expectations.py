"""What the quantized output should hold, derived from Quark's own ``quantization_config``.

No table keyed by scheme name: each quantization spec Quark wrote into the output's
``config.json`` (dtype, qscheme, group size, dynamic or static, scale format, second-level
specs) says which tensors a quantized linear layer must carry and how many bytes each takes.
A spec list is a multi-level scheme: level 1 names its tensors ``weight_scale``, level 2
``weight_scale_2`` and so on; a level with ``is_scale_quant`` quantizes the scales of the
level before it (nvfp4's FP8 block scales).

Shapes follow Quark 0.13's export, read off real exports of every CPU scheme (source weight
``[out, in]``): 8-bit and wider elements keep the shape; sub-byte integers are packed into I32
along the last axis (``ceil(n * bits / 32)``), and a per-group integer weight is stored
transposed, ``[in, out/8]``, with scales ``[in/group, out]`` (the AWQ/GEMM layout); sub-byte
floats (fp4, fp6) are packed into U8 along the last axis. Scales: ``[]`` per tensor,
``[n]`` per channel on ``ch_axis``, ``[out, in/group]`` per group or MX block. Integer zero points
take their scale's shape, packed the same way as the weight when sub-byte.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from quark_ptq_eval.base.schemes import as_spec_list, dtype_bits, is_integer

FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})
INTEGER_CONTAINERS = frozenset({"U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"})
FP8_CONTAINERS = {"fp8_e4m3": {"F8_E4M3", "F8_E4M3FNUZ"}, "fp8_e5m2": {"F8_E5M2", "F8_E5M2FNUZ"}}
MINIFLOAT_CONTAINERS = frozenset({"U8", "I8", "F8_E8M0", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})
E8M0_CONTAINERS = frozenset({"U8", "F8_E8M0"})
MINIFLOAT_FORMAT = re.compile(r"e\d+m\d+")


@dataclass(frozen=True)
class TensorExpectation:
    """One tensor a quantized module must carry: its suffix, element count and storage."""

    suffix: str  # "weight", "weight_scale", "input_zero_point_2", ...
    count: int | None  # logical elements; None when the spec does not let us size it
    bits: int | None  # bits per logical element; None for float scales (any float dtype)
    containers: frozenset[str]  # acceptable safetensors dtypes
    why: str  # the spec that asks for it, for messages
    shape: tuple[int, ...] | None = None  # the stored shape; None when the spec does not fix it

    def nbytes(self) -> int | None:
        if self.count is None or self.bits is None:
            return None
        return math.ceil(self.count * self.bits / 8)


def _element_containers(dtype: str, bits: int | None) -> frozenset[str]:
    if dtype in FP8_CONTAINERS:
        return frozenset(FP8_CONTAINERS[dtype])
    if bits == 8 and is_integer(dtype):
        return frozenset({"U8"}) if dtype.startswith("uint") else frozenset({"I8"})
    if bits is not None and bits >= 16:
        return FLOAT_DTYPES | INTEGER_CONTAINERS
    if bits is not None and is_integer(dtype):
        return frozenset({"I32"})  # sub-byte integers: eight int4 per int32
    if bits is not None:
        return frozenset({"U8"})  # sub-byte floats (fp4, fp6): packed bytes
    return INTEGER_CONTAINERS


def _packed(shape: tuple[int, ...], dtype: str, bits: int | None) -> tuple[int, ...]:
    """The stored shape of sub-byte values: packed along the last axis into I32 (ints) or U8 (floats)."""
    if not shape or bits is None or bits >= 8:
        return shape
    container = 32 if is_integer(dtype) else 8
    return (*shape[:-1], math.ceil(shape[-1] * bits / container))


def _transposed(spec: dict[str, Any]) -> bool:
    """Quark stores a per-group sub-byte integer weight (and its scales) transposed."""
    bits = dtype_bits(spec.get("dtype"))
    return is_integer(spec.get("dtype")) and bits is not None and bits < 8 and spec.get("qscheme") == "per_group"


def _scale_shape(spec: dict[str, Any], shape: tuple[int, ...], transposed: bool) -> tuple[int, ...] | None:
    qscheme = spec.get("qscheme")
    if qscheme == "per_tensor":
        return ()
    if qscheme == "per_channel" and shape:
        axis = 0 if spec.get("ch_axis") is None else spec["ch_axis"]
        return (shape[axis],) if -len(shape) <= axis < len(shape) else None
    if qscheme == "per_group" and len(shape) == 2 and spec.get("group_size"):
        groups = math.ceil(shape[-1] / int(spec["group_size"]))
        return (groups, shape[0]) if transposed else (shape[0], groups)
    return None


def _scale_count(spec: dict[str, Any], shape: tuple[int, ...]) -> int | None:
    numel = math.prod(shape)
    qscheme = spec.get("qscheme")
    if qscheme == "per_tensor":
        return 1
    if qscheme == "per_channel" and shape:
        axis = spec.get("ch_axis")
        axis = 0 if axis is None else axis
        return shape[axis] if -len(shape) <= axis < len(shape) else None
    if qscheme == "per_group" and shape and spec.get("group_size"):
        group = int(spec["group_size"])
        return numel // shape[-1] * math.ceil(shape[-1] / group)
    return None


def _scale_storage(specs: list[dict[str, Any]], level: int) -> tuple[int | None, frozenset[str]]:
    """The scale of ``level`` is stored quantized when the next level is a scale quantizer."""
    nxt = specs[level + 1] if level + 1 < len(specs) else None
    if nxt and nxt.get("is_scale_quant"):
        dtype = nxt.get("dtype") or ""
        bits = dtype_bits(dtype)
        return bits, _element_containers(dtype, bits)
    scale_format = str(specs[level].get("scale_format"))
    if scale_format == "e8m0":
        return 8, E8M0_CONTAINERS  # MX block scales: one exponent byte each
    if MINIFLOAT_FORMAT.fullmatch(scale_format):
        return 8, MINIFLOAT_CONTAINERS  # e5m3 (amdfp4), ...: one byte per scale
    return None, FLOAT_DTYPES


def weight_expectations(weight_spec: Any, shape: tuple[int, ...]) -> list[TensorExpectation]:
    """Tensors of a quantized linear weight of source ``shape`` under ``weight_spec``."""
    specs = as_spec_list(weight_spec)
    if not specs:
        return []
    storage = next((s for s in reversed(specs) if not s.get("is_scale_quant")), specs[-1])
    dtype = storage.get("dtype") or ""
    bits = dtype_bits(dtype)
    stored = (shape[1], shape[0]) if _transposed(storage) and len(shape) == 2 else shape
    out = [TensorExpectation("weight", math.prod(shape), bits, _element_containers(dtype, bits),
                             f"weight dtype {dtype}", _packed(stored, dtype, bits))]
    out += _scale_expectations("weight", specs, shape)
    return out


def activation_expectations(kind: str, spec: Any, shape: tuple[int, ...] = ()) -> list[TensorExpectation]:
    """Static activation quantizers (``input``/``output``) store their scales; dynamic ones don't."""
    return _scale_expectations(kind, as_spec_list(spec), shape)


def _scale_expectations(kind: str, specs: list[dict[str, Any]], shape: tuple[int, ...]) -> list[TensorExpectation]:
    out: list[TensorExpectation] = []
    for level, spec in enumerate(specs):
        if kind != "weight" and spec.get("is_dynamic"):
            continue
        sfx = "" if level == 0 else f"_{level + 1}"
        # Activation scales are per tensor in practice; their count is only known for per_tensor.
        count = _scale_count(spec, shape) if kind == "weight" else (1 if spec.get("qscheme") == "per_tensor" else None)
        scale_shape = _scale_shape(spec, shape, _transposed(spec)) if kind == "weight" else \
            (() if spec.get("qscheme") == "per_tensor" else None)
        bits, containers = _scale_storage(specs, level)
        what = f"{kind} spec {level + 1} ({spec.get('dtype')}, {spec.get('qscheme')})"
        out.append(TensorExpectation(f"{kind}_scale{sfx}", count, bits, containers, what, scale_shape))
        if is_integer(spec.get("dtype")):
            zp_bits = dtype_bits(spec.get("dtype"))
            containers = _element_containers(spec["dtype"], zp_bits)
            zp_shape = None if scale_shape is None else _packed(scale_shape, spec["dtype"], zp_bits)
            out.append(TensorExpectation(f"{kind}_zero_point{sfx}", count, zp_bits, containers, what, zp_shape))
    return out


QUANT_PARAM = re.compile(r"^(weight|input|output|bias)_(scale|zero_point)(_\d+)?$")


def is_quant_param(suffix: str) -> bool:
    return bool(QUANT_PARAM.match(suffix))


def matches(module: str, tensor: str | None, patterns: list[str]) -> bool:
    """Quark's exclude semantics: a pattern matches the module name or the full tensor name."""
    return any(fnmatchcase(module, p) or (tensor is not None and fnmatchcase(tensor, p)) for p in patterns)


@dataclass(frozen=True)
class ModuleConfig:
    """The quantization config that applies to one linear module, and where it came from."""

    weight: Any
    input_tensors: Any
    output_tensors: Any
    source: str  # "global_quant_config" or "layer_quant_config[PATTERN]" ...


def module_config(qconfig: dict[str, Any], module: str) -> ModuleConfig | None:
    """First ``layer_quant_config`` pattern matching ``module``, else the global config."""
    for key in ("layer_quant_config", "layer_type_quant_config"):
        for pattern, cfg in (qconfig.get(key) or {}).items():
            if isinstance(cfg, dict) and (fnmatchcase(module, pattern) or key == "layer_type_quant_config"
                                          and pattern in ("Linear", "nn.Linear", "torch.nn.Linear")):
                return _as_module_config(cfg, f"{key}[{pattern!r}]")
    glob = qconfig.get("global_quant_config")
    return _as_module_config(glob, "global_quant_config") if isinstance(glob, dict) else None


def _as_module_config(cfg: dict[str, Any], source: str) -> ModuleConfig:
    return ModuleConfig(cfg.get("weight"), cfg.get("input_tensors"), cfg.get("output_tensors"), source)


def kv_cache_output(qconfig: dict[str, Any], module: str) -> Any:
    """The output (KV-cache) spec applied to ``module`` by ``kv_cache_quant_config``, if any."""
    for pattern, cfg in (qconfig.get("kv_cache_quant_config") or {}).items():
        if isinstance(cfg, dict) and fnmatchcase(module, pattern):
            return cfg.get("output_tensors")
    return None
