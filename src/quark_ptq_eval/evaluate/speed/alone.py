"""One model served alone and measured exactly as the speed tier does (compare's cells and its baseline, each
once): ``measure_alone`` starts its own server; a cell whose serving check starts the server hands it over instead
(``prepare_alone``, then ``measured_on`` on the running server, or ``refused_alone`` when it never served).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.evaluate.serving.commands import shell_line
from quark_ptq_eval.evaluate.speed.measured import measured_from
from quark_ptq_eval.evaluate.speed.outcome import SpeedDetails
from quark_ptq_eval.evaluate.speed.record import ModelSpeed
from quark_ptq_eval.evaluate.speed.tier import (
    SpeedPrepared,
    ask_to_run,
    bench_or_refusal,
    new_record,
    prepare,
    score,
    start_bench,
)

if TYPE_CHECKING:
    from quark_ptq_eval.evaluate.context import TierInputs
    from quark_ptq_eval.runtime.vllm_server import VllmServer

__all__ = ["ModelSpeed", "SpeedPrepared", "measure_alone", "measured_on", "prepare_alone", "refused_alone"]


def prepare_alone(ctx: TierInputs, label: str, ask: bool = False) -> SpeedPrepared:
    """``ctx.model_dir`` (no baseline) to be measured under ``label``: its estimate said first (vLLM's refusal
    known before the gate among it); ``ask``: then the ``eval`` gate for its exact commands, and its server's
    command said. Raises UsageError without a named vLLM, CheckpointPending at a gate still to answer."""
    prepared = prepare(ctx, label)
    if prepared.host is None:
        raise UsageError("Measuring serving speed needs a vLLM on this host: name its interpreter with "
                         "--vllm-python (e.g. .venv-vllm/bin/python from `make vllm-env`).")
    ctx.log(prepared.estimate.summary())
    if ask:
        ask_to_run(prepared)
        ctx.log(f"serve the {label} model: {shell_line(prepared.serve[label])} (a server started for another use "
                "first, then handed to the speed measurement)")
    return prepared


def measure_alone(ctx: TierInputs, label: str) -> ModelSpeed:
    """Served and measured exactly as the tier does: the estimate, the ``eval`` gate for its exact commands, one
    server, then stopped."""
    prepared = prepare_alone(ctx, label)
    details = score(prepared).details
    assert isinstance(details, SpeedDetails)
    return ModelSpeed.of(details.speed, label, prepared.predicted_refusals.get(label))


def measured_on(prepared: SpeedPrepared, label: str, server: VllmServer) -> ModelSpeed:
    """The benchmark on ``server``, healthy and started with ``prepared.serve[label]`` by someone else (the
    cell's serving check): the tier's measurement without a server of its own."""
    record = new_record(prepared)
    prepared.ctx.log(f"benchmark the {label} model on its running server: {shell_line(prepared.bench[label])}")
    bench = start_bench(prepared, label)
    try:
        measured = bench_or_refusal(bench, server.log_path)
    finally:
        bench.cancel()
    if isinstance(measured, str):
        record.refused[label] = measured
        prepared.ctx.log(f"speed: the {label} model was not measured: {measured}")
    else:
        record.result_files[label] = [str(p) for p in measured[0]]
        record.measured[label] = measured_from(*measured)
    return ModelSpeed.of(record, label, prepared.predicted_refusals.get(label))


def refused_alone(prepared: SpeedPrepared, label: str, refusal: str) -> ModelSpeed:
    """vLLM's refusal of ``label``'s server, started by someone else, as the tier words it."""
    record = new_record(prepared)
    record.refused[label] = refusal
    prepared.ctx.log(f"speed: the {label} model was not measured: {refusal}")
    return ModelSpeed.of(record, label, prepared.predicted_refusals.get(label))
