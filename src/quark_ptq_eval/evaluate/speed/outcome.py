"""The speed tier's record as its outcome (tier.py measures, this judges): each model's medians as the scores, the
throughput gain with its interval and the verdict line, what the bytes moved per token predict beside it, and the
commands recorded when no vLLM was named."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from quark_ptq_eval.evaluate.context import TierOutcome
from quark_ptq_eval.evaluate.details import TierDetails
from quark_ptq_eval.evaluate.speed import stats
from quark_ptq_eval.evaluate.speed.commands import result_dir, weight_dtype
from quark_ptq_eval.evaluate.speed.record import (
    DecodePredictionRow,
    Gain,
    Precision,
    PredictedSpeed,
    SpeedRecord,
)
from quark_ptq_eval.evaluate.speed.workload import SpeedOptions, Workload

if TYPE_CHECKING:
    from quark_ptq_eval.evaluate.speed.prepared import SpeedPrepared

TASK = "speed"  # the scores' task name


def _empty() -> SpeedRecord:
    return SpeedRecord(Workload(0, 0, 0, 0, 0, 0), {}, None, None, {}, stats.CI_METHOD)


@dataclass
class SpeedDetails(TierDetails):
    """eval_results.json's ``details.speed``: each model's medians, spread and repeats, the gain and its
    interval, the workload, the server arguments, vLLM's version and its own result files (record.py)."""

    speed: SpeedRecord = field(default_factory=_empty)

    def as_dict(self) -> dict[str, Any]:
        return {"speed": self.speed.to_dict()}


def outcome_of(prepared: SpeedPrepared, record: SpeedRecord) -> TierOutcome:
    """The measured record as the tier's outcome: the medians as scores, the gain and its verdict."""
    target = prepared.ctx.options.of(SpeedOptions).speed_target
    quantized, baseline = record.measured.get("quantized"), record.measured.get("baseline")
    notes = [*prepared.notes, *(f"The {k} model was not measured: {v}" for k, v in record.refused.items())]
    record.judged, record.target = True, target
    if quantized and baseline:
        paired = record.precision is not None  # measured alternately in pairs (precision.py)
        point, ci = (stats.paired_gain if paired else stats.gain)(quantized.throughputs(), baseline.throughputs())
        record.verdict, parts = stats.verdict_line(point, ci, target)
        if record.precision is not None:
            record.verdict = record.verdict[:-1] + "; " + precision_words(record.precision) + "."
        record.gain = Gain(point, list(ci), parts["beyond_noise"], parts["target"], parts["target_met"],
                           parts["target_met_whole_interval"])
        notes.insert(0, f"Speed: {record.verdict}")
        record.gain.predicted = predicted_speedup(prepared)
    else:
        missing = [label for label in ("quantized", "baseline") if label in record.refused]
        record.verdict = ("no throughput gain: " + ("the baseline was not asked for (--baseline)"
                          if not prepared.ctx.options.baseline else
                          f"vLLM did not serve the {' and the '.join(missing)} model"))
    medians = {label: side.medians() for label, side in (("quantized", quantized), ("baseline", baseline)) if side}
    return TierOutcome(
        quantized=({TASK: medians["quantized"]} if "quantized" in medians else {}),
        baseline=({TASK: medians["baseline"]} if "quantized" in medians and "baseline" in medians else None),
        directions={TASK: dict(stats.HIGHER_IS_BETTER)},
        informational=tuple(stats.METRICS),  # speed is judged by its own line, not the accuracy thresholds
        details=SpeedDetails(record),
        notes=notes + prepared.estimate.settings,
        artifacts={f"vLLM benchmark results ({label})": str(result_dir(prepared.ctx.workdir, label))
                   for label in record.result_files},
    )


def precision_words(p: Precision) -> str:
    """How the alternation ended, in words: within the precision asked, or stopped by the cap short of it."""
    reached = f"+-{p.reached_pct:.1f} % after {p.pairs} pairs of repeats"
    if p.stopped == "precision":
        return f"interval within the +-{p.target_pct:g} % asked ({reached})"
    return (f"stopped at its cap (--speed-max-s {p.max_s:g}) with the interval at {reached}, short of the "
            f"+-{p.target_pct:g} % asked")


def predicted_speedup(prepared: SpeedPrepared) -> PredictedSpeed:
    """What the bytes moved per generated token predict (plan/decode_speed.py) for this run's two models at
    its workload on this host, and what the plan predicted on its target: shown beside the measured gain."""
    from quark_ptq_eval.base.sizes import kv_bytes_per_token_of
    from quark_ptq_eval.plan import decode_speed
    from quark_ptq_eval.plan.targets import FAMILIES, format_family

    quantized, baseline = (next(m for m in prepared.models if m.label == k) for k in ("quantized", "baseline"))
    plan = prepared.ctx.plan or {}
    scheme = str(plan.get("global_scheme") or "") or weight_dtype(quantized.path)
    host, w = prepared.host, prepared.workload
    native = None
    if scheme and host is not None and host.cpu:  # the CPU family's native formats (a GPU's arch is not probed)
        native = format_family(scheme) in ("weight-only", *FAMILIES["x86_64"].native)
    config = json.loads((baseline.path / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config") or config  # a multimodal model's language part serves the tokens
    weights = (decode_speed.served_weight_bytes(quantized.path), decode_speed.served_weight_bytes(baseline.path))
    kv = (kv_bytes_per_token_of(config, quantized.kv_cache_dtype), kv_bytes_per_token_of(config, None))
    here = decode_speed.predict(weights, kv, w.concurrency, decode_speed.mean_context(w.input_len, w.output_len),
                                native, "this host")
    planned = (plan.get("target") or {}).get("decode_speedup")
    return {"this_run": cast(DecodePredictionRow, here.as_dict()), "plan": cast("DecodePredictionRow | None", planned)}


def deferred(prepared: SpeedPrepared, record: SpeedRecord) -> TierOutcome:
    """No vLLM on this host: each server, then its benchmark, recorded for a host that has one."""
    steps = [{"purpose": f"{what} the {m.label} model", "argv": argv} for m in prepared.models
             for what, argv in (("serve", prepared.serve[m.label]), ("benchmark", prepared.bench[m.label]))]
    record.verdict = "not measured: no vLLM on this host"
    return TierOutcome(quantized={}, details=SpeedDetails(record), deferred_commands=steps,
                       notes=["The speed tier was not run: no vLLM on this host was found (name one with --vllm-python "
                              "PYTHON of a vLLM environment, or build the checkout's own with `make vllm-env`). "
                              "Each server, then its benchmark (speed/driver.py of this "
                              "package, run by that vLLM's python), are listed below.", *prepared.notes])
