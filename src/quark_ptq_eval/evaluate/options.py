"""What an evaluation run is asked to do: one dataclass shared by the CLI, the pipeline and the API."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError

LONG_RUN_S = 15 * 60  # above this the user is asked again before the tier starts


@dataclass
class Thresholds:
    """Relative degradation (percent, direction-aware) that separates the verdicts."""

    healthy_pct: float = 2.0  # at most this much worse: healthy
    hurt_pct: float = 5.0  # more than this much worse: quantization hurt the model

    def __post_init__(self) -> None:
        if not 0 <= self.healthy_pct <= self.hurt_pct:
            raise UsageError(
                f"Thresholds must satisfy 0 <= healthy ({self.healthy_pct}) <= hurt ({self.hurt_pct}) percent."
            )


@dataclass
class EvalOptions:
    tier: str = "ppl"
    eval_data: Path | None = None  # None: wikitext-2 test split through `datasets`
    eval_text_limit: int | None = None  # keep at most this many documents of eval_data
    max_windows: int | None = None  # Tier 1: score at most this many windows
    seq_len: int = 2048
    batch_size: int | None = None  # None: chosen from the model's vocabulary and seq_len
    device: str = "auto"  # "auto": cuda/rocm when present, else cpu
    baseline: Path | None = None  # the unquantized source: evaluated only when set (explicit opt-in)
    reference: dict[str, dict[str, float]] = field(default_factory=dict)  # task -> metric -> value
    tasks: list[str] = field(default_factory=list)  # Tier 2/3 lm-eval task names
    num_fewshot: int | None = None
    limit: float | None = None  # lm-eval --limit: docs per task (or a fraction below 1)
    include_path: Path | None = None  # directory of local lm-eval task YAMLs
    thresholds: Thresholds = field(default_factory=Thresholds)
    max_gen_toks: int | None = None  # None: task default, or a large budget for reasoning models
    trust_remote_code: bool = False
    confirm_above_s: float = LONG_RUN_S  # ask the "eval" gate again when the estimate exceeds this
    vllm_runtime: str = "auto"  # Tier 3: "docker", "host" or "auto"
    vllm_image: str = "vllm/vllm-openai-rocm:latest"
    vllm_container: str | None = None  # Tier 3: reuse this running container instead of creating one
    vllm_port: int = 8080

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise UsageError(f"--seq-len must be at least 2 tokens, not {self.seq_len}.")
        if self.batch_size is not None and self.batch_size < 1:
            raise UsageError(f"--batch-size must be a positive integer, not {self.batch_size}.")
        if self.eval_data is not None:
            self.eval_data = Path(self.eval_data)
        if self.baseline is not None:
            self.baseline = Path(self.baseline)
        if self.include_path is not None:
            self.include_path = Path(self.include_path)
        for task, metrics in self.reference.items():
            for metric, value in metrics.items():
                if not isinstance(value, int | float) or not math.isfinite(value):
                    raise UsageError(
                        f"The reference {task}:{metric}={value} is not a finite number: give the published score."
                    )
