"""Engine ``sequential``: Quark's quantizer, algorithms and exporter run on one decoder block at a time.

For each block in order its source tensors are read, it is calibrated on the hidden states Quark's whole-model
run would hand it, quantized with the plan's scheme, algorithm and KV-cache scheme, exported by Quark's exporter,
and freed (execute/engines/sequential.py). Its peak memory is one block plus the calibration activations and the
entry/exit parts, not the model; the plan picks it when the whole-model engine does not fit the host and
file-to-file cannot run the plan (plan/host_fit.py). A crash resumes after the last finished block.
"""

from __future__ import annotations

from quark_ptq_eval.base.catalog import SchemeInfo
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.plan.engines.fallback import MemoryFallback
from quark_ptq_eval.plan.engines.quark_api import QuarkApiEngine

CHILD_MODULE = "quark_ptq_eval.execute.engines.sequential"
STATE_DIR = ".sequential"  # under the output: finished blocks' files and the hidden states after the last one
# The algorithms whose whole-model order the engine reproduces block by block (execute/engines/block_host.py).
SEQUENTIAL_ALGORITHMS = ("smoothquant", "gptq")


def unsupported_reason(scheme_info: SchemeInfo, algorithm: str | None, kv_cache_scheme: str | None) -> str | None:
    """Why the sequential engine cannot serve this plan, or None when it can."""
    if scheme_info.get("error") or not scheme_info.get("weight_dtypes"):
        return "the installed Quark cannot build this scheme's weight quantizer"
    algorithms = [a for a in (algorithm or "").split(",") if a]
    if len(algorithms) > 1:
        return "it runs one algorithm per block; the plan chains several"
    if algorithms and algorithms[0] not in SEQUENTIAL_ALGORITHMS:
        return (f"the algorithm {algorithms[0]} is not one whose whole-model order it reproduces block by block "
                f"(it does: {', '.join(SEQUENTIAL_ALGORITHMS)})")
    return None


def refusal(why: str) -> UsageError:
    return UsageError(f"The sequential engine cannot run this plan: {why}.",
                      f"Use one of {', '.join(SEQUENTIAL_ALGORITHMS)} or none, or a host where --engine quark-api fits.")


class SequentialEngine(MemoryFallback, QuarkApiEngine):
    """The quark-api engine's command and calibration (its child's flags), run one block at a time."""

    name = "sequential"
    child_module = CHILD_MODULE

    def __init__(self) -> None:
        MemoryFallback.__init__(self, unsupported_reason, refusal)


ENGINE = SequentialEngine()
