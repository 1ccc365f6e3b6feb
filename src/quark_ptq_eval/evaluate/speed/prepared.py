"""What the speed tier prepared before it measures (``tier.prepare``): the host's vLLM, the fitted workload, each
model's server and benchmark commands, the refusals predicted, the estimate. Its own module: the tier and the
outcome (``outcome.py``) both read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quark_ptq_eval.evaluate.context import RuntimeEstimate, TierInputs
    from quark_ptq_eval.evaluate.serving.commands import ServedModel
    from quark_ptq_eval.evaluate.speed.workload import Workload
    from quark_ptq_eval.runtime.vllm_host import HostVllm
    from quark_ptq_eval.runtime.vllm_sizing import ServerSizing


@dataclass
class SpeedPrepared:
    ctx: TierInputs
    host: HostVllm | None
    workload: Workload
    models: list[ServedModel]
    sizing: dict[str, ServerSizing]
    serve: dict[str, list[str]]
    bench: dict[str, list[str]]
    predicted_refusals: dict[str, str]
    estimate: RuntimeEstimate
    notes: list[str] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)  # each model's server port
    alternate: bool = False  # both servers up at once, measured alternately until a precision (precision.py)
