"""The comparison's plan checkpoint: every scheme's plan in one table, with total time and disk.

Disk is the plans' own output-size estimate (plan/resources.py) plus the baseline cache. Time is
a rough count, stated as such: a fixed start-up per engine run (importing quark.torch, loading
and exporting: ~20-40 s measured on CPU here) plus forward-pass FLOPs (2 x parameters per token)
over the calibration and evaluation tokens at an assumed rate per device.
"""

from __future__ import annotations

import math
from typing import Any

from ..plan import resources
from .options import CompareOptions

ENGINE_STARTUP_S = 40.0
ASSUMED_FLOPS = {"cpu": 5e10, "cuda": 2e13}  # sustained, a conservative guess (not measured per host)
ALGORITHM_PASSES = {"awq": 3.0, "gptq": 3.0, "smoothquant": 1.5, "rotation": 1.5}
CACHE_BYTES_PER_TOKEN_PER_K = 4 + 4  # float32 log-prob + int32 token id


def _flops_rate(plan) -> float:
    return ASSUMED_FLOPS["cpu" if plan.device_strategy.get("device", "cpu") == "cpu" else "cuda"]


def _eval_tokens(opts: CompareOptions) -> int:
    if opts.max_windows:
        return opts.max_windows * opts.seq_len
    return 300_000  # wikitext-2 test is ~300k tokens for a typical tokenizer


def scheme_estimate(analysis, plan, opts: CompareOptions) -> dict[str, Any]:
    params = resources.param_count(analysis)
    calib = plan.calibration.get("num_samples", 0) * plan.calibration.get("seq_len", 0)
    passes = 1.0 + sum(ALGORITHM_PASSES.get(a, 1.0) for a in (plan.algorithm or "").split(",") if a)
    rate = _flops_rate(plan)
    quantize_s = ENGINE_STARTUP_S + 2 * params * calib * passes / rate
    eval_s = 2 * params * _eval_tokens(opts) / rate
    out = plan.resources.get("output_bytes") or 0
    info = {"weight_bits": None}
    try:
        from ..catalog import load_catalog

        info = load_catalog()["scheme_info"].get(plan.global_scheme, info)
    except Exception:  # noqa: BLE001 - the catalog is informative here, not required
        pass
    return {"quantize_s": quantize_s, "eval_s": eval_s, "output_bytes": out,
            "bits_per_weight": resources.weight_bits(plan.global_scheme, info)}


def estimate_totals(analysis, plans: dict, opts: CompareOptions) -> dict[str, Any]:
    per = {s: scheme_estimate(analysis, p, opts) for s, p in plans.items()}
    first = next(iter(plans.values()))
    baseline_s = 2 * resources.param_count(analysis) * _eval_tokens(opts) / _flops_rate(first)
    cache = _eval_tokens(opts) * opts.top_k * CACHE_BYTES_PER_TOKEN_PER_K
    seconds = sum(e["quantize_s"] + e["eval_s"] for e in per.values()) + baseline_s
    disk = sum(e["output_bytes"] for e in per.values()) + cache
    text = (f"{len(plans)} schemes: about {_duration(seconds)} in all (rough: {ENGINE_STARTUP_S:.0f} s start-up "
            f"per scheme + forward FLOPs at an assumed rate; the baseline is evaluated once) and about "
            f"{resources.gb(disk)} of disk ({resources.gb(cache)} of it the baseline cache).")
    return {"schemes": per, "baseline_s": baseline_s, "seconds": seconds, "disk_bytes": disk,
            "cache_bytes": cache, "text": text}


def combined_plan_table(plans: dict, totals: dict) -> list[tuple[str, ...]]:
    rows = []
    for scheme, plan in plans.items():
        est = totals["schemes"][scheme]
        calib = plan.calibration
        rows.append((scheme, f"{est['bits_per_weight']:.2f}", resources.gb(est["output_bytes"]),
                     _duration(est["quantize_s"] + est["eval_s"]), plan.algorithm or "-",
                     f"{calib.get('path') or calib.get('dataset')}: {calib.get('num_samples')} x "
                     f"{calib.get('seq_len')}"))
    return rows


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
