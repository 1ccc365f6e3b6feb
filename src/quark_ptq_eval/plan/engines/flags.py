"""The flag vocabulary both engines share (quark-cli's): what every engine command starts and ends with."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def head_flags(plan: Any, model_dir: Path, out: Path) -> list[str]:
    cal = plan.calibration
    return ["--model_dir", str(model_dir), "--output_dir", str(out),
            "--quant_scheme", plan.global_scheme, "--device", plan.device_strategy.device,
            "--seq_len", str(cal.seq_len), "--batch_size", str(cal.batch_size),
            "--num_calib_data", str(cal.num_samples)]


def tail_flags(plan: Any, loaded_names: list[str] | None = None) -> list[str]:
    """``loaded_names``: exclusions added in the loaded model's names (base/legacy_exclusions.py)."""
    argv: list[str] = []
    for pattern, scheme in plan.layer_quant_config.items():
        argv += ["--layer_quant_scheme", pattern, scheme]
    if plan.kv_cache_scheme:
        argv += ["--kv_cache_dtype", plan.kv_cache_scheme]
    if plan.algorithm:
        argv += ["--quant_algo", plan.algorithm]
    if plan.exclude_layers or plan.exclude_source == "user":
        # Always spelled out, so the command is exactly the plan (also a hand-corrected one).
        # An empty list disables all exclusions: the plan only allows that with --no-exclusions.
        argv += ["--exclude_layers", *plan.exclude_layers, *(loaded_names or [])]
    return argv
