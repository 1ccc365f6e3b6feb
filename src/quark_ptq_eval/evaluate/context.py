"""Types shared by the tiers: what a tier is given, what its pilot predicts, what it returns."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .options import EvalOptions

Scores = dict[str, dict[str, float]]  # task -> metric -> value


def log(message: str) -> None:
    print(f"[quark-ptq-eval] {message}", file=sys.stderr, flush=True)


@dataclass
class TierContext:
    model_dir: Path
    options: EvalOptions
    workdir: Path
    approver: Any
    source_model: Path | None = None
    plan: dict | None = None
    log: Callable[[str], None] = log


@dataclass
class RuntimeEstimate:
    """A run-time prediction measured by a pilot on the real model (not guessed from constants)."""

    tier: str
    seconds: float | None  # None: nothing runs here (Tier 3 off ROCm, skip)
    hardware: str
    model_bytes: int
    data: str  # how much evaluation data, in words
    basis: str  # what the pilot measured
    warning: str | None = None
    threshold_s: float = 15 * 60

    @property
    def long(self) -> bool:
        return self.seconds is not None and self.seconds > self.threshold_s

    def summary(self) -> str:
        when = (
            "nothing runs on this host" if self.seconds is None else f"about {format_duration(self.seconds)}"
        )
        lines = [
            f"Tier {self.tier}: {when}",
            f"  model: {self.model_bytes / 2**20:.1f} MiB of weights; data: {self.data}",
            f"  hardware: {self.hardware}",
            f"  measured: {self.basis}",
        ]
        if self.warning:
            lines.append(f"  warning: {self.warning}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            "seconds": self.seconds,
            "hardware": self.hardware,
            "model_bytes": self.model_bytes,
            "data": self.data,
            "basis": self.basis,
            "warning": self.warning,
            "long": self.long,
        }


@dataclass
class TierOutcome:
    quantized: Scores
    baseline: Scores | None = None
    directions: dict[str, dict[str, bool]] = field(default_factory=dict)  # task -> metric -> higher is better
    details: dict[str, Any] = field(default_factory=dict)
    informational: tuple[str, ...] = ()  # metrics reported without a verdict
    deferred_commands: list[dict] = field(default_factory=list)  # Tier 3 off ROCm
    notes: list[str] = field(default_factory=list)
    artifacts: dict[str, str] = field(default_factory=dict)  # name -> path of files written


def format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def hardware_description(device: str) -> str:
    import os
    import platform

    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        kind = "ROCm" if getattr(torch.version, "hip", None) else "CUDA"
        return f"{kind} GPU {torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads (torch {torch.__version__})"
