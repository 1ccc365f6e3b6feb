"""Engine ``file2file``: Quark's file-to-file quantization (``ModelQuantizer.direct_quantize_checkpoint``).

It reads the checkpoint one safetensors shard at a time, quantizes that shard's linear weights
and writes it out, so the host never holds the model: its peak memory follows the largest shard,
not the model (measured in docs/planning.md). The price is calibration: nothing runs the model,
so only schemes with no static activation scales, no KV-cache scales and no algorithm qualify.
The plan picks it when the whole-model engine does not fit the host (plan/host_fit.py).

The child process it runs is ``python -m quark_ptq_eval.execute.engines.file2file``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.catalog import SchemeInfo
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.plan.engines.fallback import MemoryFallback
from quark_ptq_eval.plan.engines.flags import tail_flags

CHILD_MODULE = "quark_ptq_eval.execute.engines.file2file"


def unsupported_reason(scheme_info: SchemeInfo, algorithm: str | None, kv_cache_scheme: str | None) -> str | None:
    """Why file-to-file cannot serve this plan (it never runs the model), or None when it can."""
    if scheme_info.get("error") or not scheme_info.get("weight_dtypes"):
        return "the installed Quark cannot build this scheme's weight quantizer"
    if any(d.startswith(("int", "uint")) for d in scheme_info["weight_dtypes"]):
        # Measured on 0.13 (docs/planning.md): its integer export keeps scales as [out, in/group], drops
        # the zero points and skips the nibble reorder its config announces; Quark's own importer refuses it.
        return ("Quark 0.13's file-to-file export of integer weights does not load with Quark's importer "
                "(scales transposed, zero points missing)")
    if scheme_info.get("static_activations"):
        return "the scheme has static activation scales, which only a calibration pass over the model can measure"
    if algorithm:
        return f"the algorithm {algorithm} needs the model and calibration data; file-to-file runs neither"
    if kv_cache_scheme:
        return "KV-cache scales are calibrated on the model's attention outputs; file-to-file never runs the model"
    return None


def refusal(why: str) -> UsageError:
    return UsageError(f"The file2file engine cannot run this plan: {why}.",
                      "Choose a weight-only or dynamic-activation FP8/MX scheme (ptpc_fp8, mxfp4, mxfp6_e2m3) "
                      "with no algorithm and no KV-cache scheme, or another --engine.")


class File2FileEngine(MemoryFallback):
    name = "file2file"

    def __init__(self) -> None:
        super().__init__(unsupported_reason, refusal)

    def argv(self, plan: Any, model_dir: Path, out: Path) -> list[str]:
        # No calibration flags: this engine reads weights only.
        argv = [sys.executable, "-m", CHILD_MODULE, "--model_dir", str(model_dir), "--output_dir", str(out),
                "--quant_scheme", plan.global_scheme, "--device", plan.device_strategy.device]
        if plan.device_strategy.multi_device:
            argv.append("--multi_device")
        return [*argv, *tail_flags(plan)]

    def env(self, plan: Any, workdir: Path) -> dict[str, str]:
        return {}

    def prepare_calibration(self, manifest: Any) -> None:
        return None  # calibration-free

    def version(self) -> str:
        from quark_ptq_eval.base.catalog import quark_version

        return quark_version()


ENGINE = File2FileEngine()
