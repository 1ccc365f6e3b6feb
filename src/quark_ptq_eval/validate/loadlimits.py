"""How far a healthy module's replayed output may be from the source's, per scheme and algorithm:
only for the units the export's emulation does not cover (emulate.py; a weight held under other
names, such as transformers 5's fused experts, or an activation spec not emulated). Every other
unit is held to the emulation within rounding (load_judge.py), and its distance from the source is
reported, never judged: these limits were measured on models without outlier channels, where a
correct int8 export of a model with one massive channel reads 15-17 % (tests/fixtures/traits.py).

One limit for all (0.45, set by the noisiest scheme, mxfp4 on random weights) let an int8 export
with a row of its attention negated pass at 10-25 %, where int8's healthy modules stay within a
few percent. So the limit follows the export's weight format: the largest relative module error
measured on healthy exports of that format (``bench/benchmarks/bench_load_check.py --no-faults``, numbers in
``HEALTHY``) times ``MARGIN``, never above the old limit. AWQ and SmoothQuant are replayed in larger
units (folds.py), so their own measured maxima apply. A mixed export (per-layer overrides) is held
to the loosest format it uses.
"""

from __future__ import annotations

from typing import Any

from quark_ptq_eval.base.schemes import as_spec_list, dtype_bits, is_integer
from quark_ptq_eval.validate.rewrites import SCALING, algorithms

MARGIN = 2.0  # the sweeps cover 8 families of 34: room for the others' spread
CEILING = 0.45  # the former single limit: planted scale x4 faults read >= 0.52 over 159 exports
# format -> largest healthy module error measured (docs/reliability.md, "Load-check limits per format"):
# bench/benchmarks/bench_load_check.py --no-faults over a family-matrix subset (8 families, random BF16 weights)
# and the trained tiny Llama's exports; fp4 from the 34-family sweep (experts 0.33).
HEALTHY = {"int8": 0.059, "fp8": 0.084, "int4": 0.184, "fp4": 0.33,
           "fp6": 0.33}  # fp6: one measurement only (0.071, trained Llama): held to fp4's figure
# AWQ / SmoothQuant, replayed by fold unit: int4 AWQ from the 34-family sweep (all healthy <= 0.29),
# int8 SmoothQuant from the plan matrix (bench/docgen/plan_matrix.py: phi3's fused-MLP fold unit 0.22 on
# random BF16 weights, its weights decoding within half a step; the trained tiny Llama read 0.071).
HEALTHY_SCALING = {"int8": 0.22, "int4": 0.29}


def format_of(spec: dict[str, Any]) -> str | None:
    dtype = str(spec.get("dtype") or "")
    bits = dtype_bits(dtype)
    if dtype.startswith("fp8"):
        return "fp8"
    if is_integer(dtype) and bits is not None:
        return "int8" if bits >= 8 else "int4"
    if dtype.startswith("fp6") or str(spec.get("mx_element_dtype") or "").startswith("fp6"):
        return "fp6"
    if dtype in ("fp4", "mx") or str(spec.get("mx_element_dtype") or "") == "fp4":
        return "fp4"
    return None


def weight_formats(qconfig: dict[str, Any] | None) -> set[str | None]:
    """Every weight format the export's quantization_config uses (global and per-layer)."""
    qconfig = qconfig or {}
    configs = [qconfig.get("global_quant_config")]
    for key in ("layer_quant_config", "layer_type_quant_config"):
        configs += list((qconfig.get(key) or {}).values())
    formats = set()
    for cfg in configs:
        if isinstance(cfg, dict):
            formats |= {format_of(s) for s in as_spec_list(cfg.get("weight")) if not s.get("is_scale_quant")}
    return formats


def module_error_limit(qconfig: dict[str, Any] | None, plan: dict[str, Any] | None) -> tuple[float, str]:
    """(limit, why) for the export's module replay."""
    scaling = bool(set(algorithms(qconfig, plan)) & SCALING)
    table = {**HEALTHY, **HEALTHY_SCALING} if scaling else HEALTHY
    formats = weight_formats(qconfig)
    known = {f for f in formats if f is not None}
    if not formats or len(known) < len(formats):
        return CEILING, "no measured limit for this weight format: the general limit"
    worst = max(known, key=lambda f: table[f])
    limit = min(CEILING, round(table[worst] * MARGIN, 3))
    algo = " under AWQ/SmoothQuant" if scaling and worst in HEALTHY_SCALING else ""
    capped = f", capped at {CEILING}" if limit == CEILING else ""
    return limit, f"{worst}{algo}: healthy <= {table[worst]:.3g} measured, x{MARGIN:g} margin{capped}"
