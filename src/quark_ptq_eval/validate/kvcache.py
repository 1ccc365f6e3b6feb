"""KV-cache scales: every attention layer a KV-cache scheme quantizes carries its scales, usable.

Quark 0.13 quantizes the KV cache with a static output quantizer on each KV projection (the
template's ``kv_layers_name``: ``*k_proj``/``*v_proj``, MLA's ``*kv_b_proj``, a fused ``*qkv``)
and exports its scale as ``<projection>.output_scale``; with ``export.kv_cache_group`` it merges
the k and v scales of one attention layer into their maximum. A serving stack reads that scale
for every token it caches, so a missing, non-finite, zero or negative one breaks the layer
however well the weights came out. Part of the calibration check: these are activation scales
calibration sets, and reading them costs a few bytes each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from quark_ptq_eval.base.safetensors_io import TensorInfo
from quark_ptq_eval.base.schemes import as_spec_list
from quark_ptq_eval.validate.expectations import activation_expectations
from quark_ptq_eval.validate.registry import CheckInputs
from quark_ptq_eval.validate.report import MAX_LISTED, CheckResult, Finding

if TYPE_CHECKING:
    import numpy as np

MERGE_TOLERANCE = 1e-6  # relative: merged k/v scales are the same float


FloatReader = Callable[[TensorInfo, int], "np.ndarray | None"]  # (tensor, how many) -> its first values as floats


def check_kv_scales(ctx: CheckInputs, result: CheckResult, read_floats: FloatReader) -> None:
    """Add the KV-scale findings, stats and the list of scales checked to the calibration ``result``."""
    qconfig = ctx.shared.expected_qconfig or ctx.qconfig or {}
    patterns = {p: (cfg or {}).get("output_tensors") for p, cfg in (qconfig.get("kv_cache_quant_config") or {}).items()}
    if not patterns:  # no KV-cache scheme: nothing to list
        return
    cut = {name.rpartition(".")[0] for name in ctx.without_data}  # past a truncated shard's cut: layout names it
    modules = {m: spec for m, spec in _kv_modules(ctx.readable("source"), patterns).items() if m not in cut}
    scheme = (ctx.plan or {}).get("kv_cache_scheme") or "the export's"
    if not modules:
        result.findings.append(Finding("kv_cache_quant_config", f"names no layer of the model: {sorted(patterns)} "
                                       "match no linear of the source.", side="quark"))
        return
    values: dict[str, float] = {}
    for module, spec in modules.items():
        finding = _check_one(module, spec, ctx.readable("output"), scheme, read_floats, values)
        if finding is not None:
            result.findings.append(finding)
    if (ctx.qconfig or {}).get("export", {}).get("kv_cache_group"):
        result.findings += _unmerged(values)
    result.stats["kv_scales"] = len(values)
    result.stats["kv_scales_checked"] = values
    listed = ", ".join(f"{n}={v:.4g}" for n, v in list(values.items())[:MAX_LISTED])
    more = f" ... and {len(values) - MAX_LISTED} more" if len(values) > MAX_LISTED else ""
    result.notes.append(f"KV-cache scales checked ({len(values)} of {len(modules)} KV projections, KV scheme "
                        f"{scheme}): {listed or 'none readable'}{more}")


def _kv_modules(source: dict[str, TensorInfo], patterns: dict[str, object]) -> dict[str, object]:
    """Source linears each KV pattern matches (first pattern wins, as Quark's lookup), with its output spec."""
    out: dict[str, object] = {}
    for name, info in source.items():
        module, _, suffix = name.rpartition(".")
        if suffix != "weight" or len(info.shape) != 2:
            continue
        spec = next((s for p, s in patterns.items() if fnmatchcase(module, p)), None)
        if spec is not None:
            out[module] = spec
    return dict(sorted(out.items()))


def _check_one(module: str, spec: object, output: dict[str, TensorInfo], scheme: str, read_floats: FloatReader,
               values: dict[str, float]) -> Finding | None:
    layer = module.rpartition(".")[0] or module
    expected = next((e for e in activation_expectations("output", spec) if e.suffix == "output_scale"), None)
    if expected is None:  # a dynamic KV spec stores no scale
        return None
    name = f"{module}.output_scale"
    got = output.get(name)
    if got is None:
        return Finding(name, f"is missing: the KV-cache scheme {scheme} quantizes {layer}'s cache with a static "
                             "scale that the export does not carry.", side="quark",
                       evidence=f"expected: {_describe(spec)} scale of {module}; found: no such tensor")
    if got.dtype not in expected.containers or (expected.shape is not None and tuple(got.shape) != expected.shape):
        return Finding(name, f"is stored as {got.dtype} {list(got.shape)}, but {layer}'s KV scale needs one of "
                             f"{sorted(expected.containers)} with shape {list(expected.shape or ())}.", side="quark")
    floats = read_floats(got, max(math.prod(got.shape), 1))
    if floats is None or floats.size == 0:
        return Finding(name, f"cannot be read as a float scale ({got.dtype}).", side="quark")
    bad = [float(v) for v in floats.ravel() if not math.isfinite(float(v)) or float(v) <= 0]
    if bad:
        return Finding(name, f"is {bad[0]!r}: {layer}'s KV cache would be quantized with a non-finite or "
                             "non-positive scale.", side="quark",
                       evidence=f"expected: a finite scale > 0; found {len(bad)} bad value(s) in {got.file.name}")
    values[name] = float(floats.ravel()[0])
    return None


def _unmerged(values: dict[str, float]) -> list[Finding]:
    """With kv_cache_group, Quark's exporter gives k and v of one attention layer the same (max) scale."""
    by_layer: dict[str, dict[str, float]] = {}
    for name, value in values.items():
        module = name.rpartition(".")[0]
        by_layer.setdefault(module.rpartition(".")[0], {})[module] = value
    findings = []
    for layer, scales in by_layer.items():
        low, high = min(scales.values()), max(scales.values())
        if high - low > MERGE_TOLERANCE * high:
            findings.append(Finding(layer, "holds different k/v cache scales although the export's kv_cache_group "
                                           "merges them into one per attention layer.", side="quark",
                                    evidence=", ".join(f"{m}={v:.4g}" for m, v in scales.items())))
    return findings


def _describe(spec: object) -> str:
    specs = as_spec_list(spec)
    return " + ".join(f"{s.get('dtype')} {s.get('qscheme')}" for s in specs) or "a"
