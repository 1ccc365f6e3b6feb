"""The comparison's plan checkpoint: every scheme's plan in one table, with total time and disk.

Disk is the plans' own output-size estimate (plan/resources.py) plus the baseline cache. Time is
built from what was measured on this host, and the text says which figure came from where:

- forward passes (calibration and evaluation): 2 x parameters FLOPs per token at the rate of a
  float32 matmul of the model's hidden size, timed here (a fraction of a second);
- an engine run (``import quark.torch``, load, quantize, export): every finished engine run of a
  comparison is recorded in ``TIMINGS_FILE`` (in the user cache, with the scheme, algorithm,
  device, parameters and calibration tokens). A scheme recorded before with the same model size
  and calibration takes its last recorded time; any other takes the cheapest recorded run on the
  device (mostly Quark's import, load and export) plus its calibration's forward FLOPs. With no
  record yet that fixed cost is ``ENGINE_STARTUP_S`` (measured on the development CPU) and the
  text says it is assumed.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from quark_ptq_eval.base.catalog import SchemeInfo
from quark_ptq_eval.base.sizes import gb
from quark_ptq_eval.flows.compare.options import CompareOptions
from quark_ptq_eval.plan import resources

ENGINE_STARTUP_S = 40.0  # fallback only: quark.torch import + load + export of a small model, dev CPU
ALGORITHM_PASSES = {"awq": 3.0, "gptq": 3.0, "smoothquant": 1.5, "rotation": 1.5}
CACHE_BYTES_PER_TOKEN_PER_K = 4 + 4  # float32 log-prob + int32 token id
CACHE_BYTES_PER_TOKEN = 8 + 8 + 8  # float64 NLL, float64 log tail mass, int64 token id
TIMINGS_FILE = "engine_timings.json"
MAX_RECORDS = 200
PILOT_S = 0.2


def _device_kind(plan) -> str:
    return "cpu" if plan.device_strategy.device == "cpu" else "cuda"


def measured_rate(analysis, device: str) -> float:
    """FLOP/s of a matmul shaped like one of the model's projections, timed on ``device`` here."""
    import torch

    hidden = resources.model_shape(analysis).hidden_size or 1024
    n = max(64, min(hidden, 4096))
    on_gpu = device == "cuda" and torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    a, b = torch.randn(256, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    a @ b  # warm-up
    reps, started = 0, time.perf_counter()
    while True:
        a @ b
        reps += 1
        if on_gpu:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        if elapsed >= PILOT_S or reps >= 10_000:
            return 2 * 256 * n * n * reps / elapsed


def _timings_path():
    from quark_ptq_eval.base.fsio import cache_dir

    return cache_dir() / TIMINGS_FILE


def engine_history() -> list[dict]:
    try:
        records = json.loads(_timings_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # none yet, or unreadable: the estimate says it assumed
    return [r for r in records if isinstance(r, dict) and isinstance(r.get("seconds"), int | float)]


def record_engine_run(analysis, plan, seconds: float) -> None:
    """Remember a finished engine run (what the next estimate scales from)."""
    from quark_ptq_eval.base.fsio import write_json

    entry = {"scheme": plan.global_scheme, "algorithm": plan.algorithm or None, "device": _device_kind(plan),
             "params": resources.param_count(analysis),
             "calib_tokens": plan.calibration.tokens,
             "seconds": round(float(seconds), 2), "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        path = _timings_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, [*engine_history(), entry][-MAX_RECORDS:])
    except OSError:
        pass  # a read-only cache only costs the next estimate its measured basis


def _eval_tokens(opts: CompareOptions) -> int:
    if opts.eval.max_windows:
        return opts.eval.max_windows * (opts.eval.seq_len or 0)
    return 300_000  # wikitext-2 test is ~300k tokens for a typical tokenizer


def _engine_seconds(analysis, plan, history: list[dict], rate: float) -> tuple[float, str]:
    """(seconds, basis) of one engine run for ``plan``, from this host's records where there are any.
    A record is reused as is only for the same scheme, algorithm, device, parameters and calibration
    tokens: scaling the small difference between two short runs by size would scale their noise."""
    params = resources.param_count(analysis)
    calib = plan.calibration.tokens
    kind = _device_kind(plan)
    on_device = [r for r in history if r.get("device") == kind]
    same = [r for r in on_device if r.get("scheme") == plan.global_scheme
            and (r.get("algorithm") or None) == (plan.algorithm or None)
            and r.get("params") == params and r.get("calib_tokens") == calib]
    if same:
        return same[-1]["seconds"], "measured"
    fixed = min((r["seconds"] for r in on_device), default=None)
    passes = 1.0 + sum(ALGORITHM_PASSES.get(a, 1.0) for a in (plan.algorithm or "").split(",") if a)
    work = 2 * params * calib * passes / rate
    return (fixed if fixed is not None else ENGINE_STARTUP_S) + work, "fixed" if fixed is not None else "assumed"


def scheme_estimate(analysis, plan, opts: CompareOptions, rate: float, history: list[dict]) -> dict[str, Any]:
    quantize_s, basis = _engine_seconds(analysis, plan, history, rate)
    eval_s = 2 * resources.param_count(analysis) * _eval_tokens(opts) / rate
    out = plan.resources.get("output_bytes") or 0
    info: SchemeInfo = {"weight_bits": None}
    try:
        from quark_ptq_eval.base.catalog import load_catalog

        info = load_catalog()["scheme_info"].get(plan.global_scheme, info)
    except Exception:  # noqa: BLE001 - the catalog is informative here, not required
        pass
    return {"quantize_s": quantize_s, "eval_s": eval_s, "output_bytes": out, "basis": basis,
            "bits_per_weight": resources.weight_bits(plan.global_scheme, info)}


def estimate_totals(analysis, plans: dict, opts: CompareOptions) -> dict[str, Any]:
    first = next(iter(plans.values()))
    rate, history = measured_rate(analysis, _device_kind(first)), engine_history()
    per = {s: scheme_estimate(analysis, p, opts, rate, history) for s, p in plans.items()}
    baseline_s = 2 * resources.param_count(analysis) * _eval_tokens(opts) / rate
    cache = _eval_tokens(opts) * (opts.top_k * CACHE_BYTES_PER_TOKEN_PER_K + CACHE_BYTES_PER_TOKEN)
    # This process imports quark.torch once to load the exports (validation's load check, Tier 1):
    # about one engine start-up, the cheapest recorded engine run on the device.
    kind = _device_kind(first)
    import_s = min((r["seconds"] for r in history if r.get("device") == kind), default=ENGINE_STARTUP_S)
    seconds = sum(e["quantize_s"] + e["eval_s"] for e in per.values()) + baseline_s + import_s
    disk = sum(e["output_bytes"] for e in per.values()) + cache
    text = (f"{len(plans)} schemes: about {_duration(seconds)} in all and about {gb(disk)} of disk "
            f"({gb(cache)} of it the baseline cache, evaluated once). {_basis_text(per, rate, history)}")
    return {"schemes": per, "baseline_s": baseline_s, "import_s": import_s, "seconds": seconds, "disk_bytes": disk,
            "cache_bytes": cache, "rate_flops": rate, "text": text}


def _basis_text(per: dict, rate: float, history: list[dict]) -> str:
    measured = [s for s, e in per.items() if e["basis"] == "measured"]
    parts = [f"Forward passes: 2 x parameters FLOPs per token at {rate / 1e9:.1f} GFLOP/s (a matmul timed here now); "
             "one Quark import here to load the exports, counted as one engine start-up."]
    if measured:
        parts.append(f"Engine runs of {', '.join(measured)}: as their last run of this model and calibration "
                     "on this host.")
    others = [s for s in per if s not in measured]
    if others:
        fixed = per[others[0]]["basis"] == "fixed"
        parts.append(f"Engine runs of {', '.join(others)}: " + (
            f"start-up as measured on this host ({len(history)} recorded runs) plus forward FLOPs."
            if fixed else f"{ENGINE_STARTUP_S:.0f} s start-up assumed (no engine run recorded on this host yet) "
                          "plus forward FLOPs."))
    return " ".join(parts)


def combined_plan_table(plans: dict, totals: dict) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for scheme, plan in plans.items():
        est = totals["schemes"][scheme]
        calib = plan.calibration
        rows.append((scheme, f"{est['bits_per_weight']:.2f}", gb(est["output_bytes"]),
                     _duration(est["quantize_s"] + est["eval_s"]), plan.algorithm or "-",
                     f"{calib.path or calib.dataset}: {calib.num_samples} x {calib.seq_len}"))
    return rows


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
