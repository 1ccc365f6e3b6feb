"""What a tier returns beyond its scores, typed: each tier's ``details`` and the evidence the verdict
reads (each metric's sampling noise, the metrics a tier must have returned).

``as_dict()`` is what eval_results.json's ``details`` holds: the fields in their order, nested
dataclasses as dicts, and a field marked :data:`OPTIONAL` left out while it is None (a key that
only some runs have). ``details[key]`` reads that document too, for code that only reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

OPTIONAL = {"optional": True}  # field metadata: the key is absent while the value is None


@dataclass
class MetricNoise:
    """One metric's sampling noise, as the tier measured it (None: not measured). Tier 1 works in
    log space (log(perplexity) is the mean NLL) and pairs the windows; Tier 2/3 give lm-eval's
    standard errors. Only the measured ones are written."""

    log_stderr: float | None = None
    baseline_log_stderr: float | None = None
    paired_log_delta: float | None = None
    paired_log_stderr: float | None = None
    stderr: float | None = None
    baseline_stderr: float | None = None

    @classmethod
    def of(cls, value: MetricNoise | Mapping[str, float] | None) -> MetricNoise | None:
        """A MetricNoise from itself or from the dict eval_results.json holds."""
        return value if value is None or isinstance(value, MetricNoise) else cls(**value)

    def get(self, key: str) -> float | None:
        value: float | None = getattr(self, key, None)
        return value

    def as_dict(self) -> dict[str, float]:
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}


Noise = dict[str, dict[str, MetricNoise]]  # task -> metric -> its noise
Required = dict[str, list[str]]  # task -> metrics the tier must have returned (absent: invalid)


def noise_of(value: Mapping[str, Mapping[str, Any]] | None) -> Noise | None:
    """Noise from typed entries or from the dicts a document holds."""
    if value is None:
        return None
    return {task: {metric: MetricNoise.of(n) or MetricNoise() for metric, n in metrics.items()}
            for task, metrics in value.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, MetricNoise | TierDetails):
        return value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@dataclass
class TierDetails:
    """The base of every tier's details: ``noise`` and ``required`` are the verdict's evidence."""

    def as_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("optional"):
                continue
            out[f.name] = _plain(value)
        return out

    def noise_evidence(self) -> Noise | None:
        """Each metric's sampling noise, for the verdict (None: not measured)."""
        noise: Noise | None = getattr(self, "noise", None)
        return noise

    def required_evidence(self) -> Required | None:
        """The metrics the tier must have returned: one missing is ``invalid``, never left out."""
        required: Required | None = getattr(self, "required", None)
        return required

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.as_dict()

    def get(self, key: str, default: Any = None) -> Any:
        return self.as_dict().get(key, default)


@dataclass
class PerplexityDetails(TierDetails):
    """Tier 1: the perplexity statistics of each model, and with a baseline the KL summary, the paired
    per-window delta, llama.cpp's KL-divergence report and the chart's distributions."""

    quantized: dict[str, float]
    seq_len: int
    batch_size: int
    loader: str
    method: str
    baseline: dict[str, float] | None = field(default=None, metadata=OPTIONAL)
    kl: dict[str, float] | None = field(default=None, metadata=OPTIONAL)
    paired: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    kld_report: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    distribution: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    noise: Noise = field(default_factory=dict)
    required: Required = field(default_factory=dict)
    hf_vs_vllm: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # --vllm-python's cross-check
    baseline_cache: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # compare's cached baseline
    # streamed Tier 1 with a baseline: per decoder block, the quantized hidden states' relative distance from the
    # baseline's after it, and what it added (evaluate/ppl/stream.py)
    per_block: list[dict[str, float]] | None = field(default=None, metadata=OPTIONAL)


@dataclass
class TaskDetails(TierDetails):
    """Tier 2: lm-eval's standard errors per model, the workload counted, and with a baseline the
    paired per-document tests."""

    stderr: dict[str, dict[str, dict[str, float]]]  # "quantized"/"baseline" -> task -> metric -> s.e.
    workload: dict[str, Any]
    loader: str
    lm_eval_version: str | None
    paired_tests: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    noise: Noise = field(default_factory=dict)
    required: Required = field(default_factory=dict)


@dataclass
class ServerDetails(TierDetails):
    """Tier 3: the host, the runtime and the sized server arguments; run: its commands and lm-eval's
    results as Tier 2 reports them; deferred: the script to run later."""

    environment: dict[str, Any]
    runtime: str
    container: str | None
    server_args: dict[str, Any]
    vllm: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # the host vLLM's distribution, version
    script: str | None = field(default=None, metadata=OPTIONAL)  # deferred
    commands: list[dict[str, Any]] | None = field(default=None, metadata=OPTIONAL)  # run
    lm_eval_version: str | None = None  # written when it ran, known or not
    stderr: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    noise: Noise | None = field(default=None, metadata=OPTIONAL)
    paired_tests: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    speed: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # --speed: measured on these servers

    def as_dict(self) -> dict[str, Any]:
        out = super().as_dict()
        if self.commands is None:  # deferred: nothing ran, no lm-eval version to record
            out.pop("lm_eval_version")
        return out


class OtherDetails(TierDetails):
    """Details given as a plain dict (a tier that declares no type of its own): kept as given, its
    ``noise`` and ``required`` read as evidence."""

    def __init__(self, values: Mapping[str, Any] | None = None) -> None:
        self.values: dict[str, Any] = dict(values or {})

    def as_dict(self) -> dict[str, Any]:
        return {k: _plain(v) for k, v in self.values.items()}

    def noise_evidence(self) -> Noise | None:
        return noise_of(self.values.get("noise"))

    def required_evidence(self) -> Required | None:
        required: Required | None = self.values.get("required")
        return required

    def __setitem__(self, key: str, value: Any) -> None:
        self.values[key] = value

    def __repr__(self) -> str:
        return f"OtherDetails({self.values!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OtherDetails) and self.values == other.values


def details_of(value: TierDetails | Mapping[str, Any] | None) -> TierDetails:
    """``TierOutcome.details`` from a tier's typed details, or from a plain dict."""
    return value if isinstance(value, TierDetails) else OtherDetails(value)
