"""The decode speed-up a scheme should give, predicted from the bytes moved per generated token.

At serving batch sizes a decode step is bound by memory traffic: it reads every weight once for the whole
batch and each sequence's KV cache. Per generated token that is
``(weights + batch x mean context x KV bytes per token) / batch``, and the predicted speed-up is the
baseline's bytes over the quantized model's. Weights count as the server holds them: float tensors in
BF16/FP16 (vLLM serves a float32 checkpoint in BF16), quantized ones at their stored width; the baseline's
KV cache is in the model dtype, the quantized model's in FP8 when the plan quantizes it. It assumes the
target computes the quantized format as fast as the baseline's (native matrix cores, or weight-only
dequantized inside the kernel); where the target has no native support the bytes only bound the gain from
above, and the prediction says so. Compute-bound prefill, scheduling and the sampler are not in it: the
speed tier's measured gain is what counts, and its report puts this prediction beside it.

The workload is the speed tier's default for the target: Quark quant_perf's 1024 prompt and 1024 output
tokens at concurrency 64 on a GPU, a small one on a CPU (the speed tier's workload.py uses these); the mean
context of a decode step is the prompt plus half the output.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.sizes import kv_bytes_per_token_of

if TYPE_CHECKING:
    from quark_ptq_eval.base.artifacts import ModelAnalysis
    from quark_ptq_eval.plan.targets import Deployment

GPU_WORKLOAD = {"input_len": 1024, "output_len": 1024, "concurrency": 64}  # Quark quant_perf's --isl/--osl/concurrency
CPU_WORKLOAD = {"input_len": 32, "output_len": 16, "concurrency": 4, "prompts": 8}  # seconds a repeat on 2 cores
SERVED_FLOAT_BYTES = 2  # a float tensor as vLLM holds it (BF16/FP16; float32 checkpoints are served in BF16)
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class DecodePrediction:
    """The predicted decode speed-up and the bytes behind it."""

    speedup: float
    quantized_bytes_per_token: float
    baseline_bytes_per_token: float
    batch: int
    mean_context: int
    native: bool | None  # the target computes the format natively (None: not known here)
    where: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"text": self.text()}

    def text(self) -> str:
        caveat = ("" if self.native else "; no native kernel for it there: an upper bound" if self.native is False
                  else "; whether the host computes the format natively is not known: at most this")
        return (f"{self.speedup:.2f}x on {self.where}: {self.baseline_bytes_per_token / 2**20:.3g} -> "
                f"{self.quantized_bytes_per_token / 2**20:.3g} MiB moved per generated token (weights once a step "
                f"for a batch of {self.batch}, plus each sequence's KV cache at a mean context of "
                f"{self.mean_context} tokens){caveat}")


def mean_context(input_len: int, output_len: int) -> int:
    """The context a decode step reads on average: the prompt and half the output."""
    return input_len + output_len // 2


def bytes_per_token(weights: float, kv_per_token: int, batch: int, context: int) -> float:
    return (weights + batch * context * kv_per_token) / batch


def predict(weights: tuple[float, float], kv_per_token: tuple[int, int], batch: int, context: int,
            native: bool | None, where: str) -> DecodePrediction:
    """``weights``, ``kv_per_token``: (quantized, baseline) bytes as served (``kv_per_token_of``)."""
    q = bytes_per_token(weights[0], kv_per_token[0], batch, context)
    b = bytes_per_token(weights[1], kv_per_token[1], batch, context)
    return DecodePrediction(b / q, q, b, batch, context, native, where)


def kv_per_token_of(config: dict[str, Any], quantized_kv: str | None) -> tuple[int, int]:
    """KV bytes per token of the quantized model (its KV scheme) and of the baseline (the model dtype)."""
    return kv_bytes_per_token_of(config, quantized_kv), kv_bytes_per_token_of(config, None)


def served_weight_bytes(model_dir: Path) -> int:
    """A checkpoint's weights as a server holds them: float tensors at two bytes, the rest as stored."""
    from quark_ptq_eval.base.safetensors_io import DTYPE_BYTES, read_model_headers

    return sum(math.prod(t.shape) * (SERVED_FLOAT_BYTES if t.dtype in FLOAT_DTYPES else DTYPE_BYTES[t.dtype])
               for t in read_model_headers(model_dir).values())


def plan_prediction(analysis: ModelAnalysis, out_bytes: int, kv: str | None, tc: Deployment,
                    scheme: str) -> DecodePrediction:
    """The plan's prediction on its target, at the speed tier's default workload there, from the export's
    estimated size and the source's parameters served in BF16."""
    from quark_ptq_eval.plan import resources
    from quark_ptq_eval.plan.targets import format_family

    fam = tc.family
    workload = CPU_WORKLOAD if fam is None or fam.accelerator == "cpu" else GPU_WORKLOAD
    kind = format_family(scheme)
    native = None if fam is None else (kind == "weight-only" or kind in fam.native)
    baseline = resources.param_count(analysis) * SERVED_FLOAT_BYTES
    return predict((out_bytes, baseline), kv_per_token_of(analysis.architecture, kv), workload["concurrency"],
                   mean_context(workload["input_len"], workload["output_len"]), native, tc.name)
