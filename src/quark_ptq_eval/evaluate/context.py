"""Types shared by the tiers: what a tier is given, what its pilot predicts, what it returns."""

from __future__ import annotations

import importlib
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from quark_ptq_eval.base.artifacts import PlanJson
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.registry import InvalidEntry
from quark_ptq_eval.evaluate.details import TierDetails, details_of
from quark_ptq_eval.evaluate.options import EvalOptions
from quark_ptq_eval.evaluate.tiers import Tier

if TYPE_CHECKING:
    from quark_ptq_eval.runtime.loading import LoadedModel

Scores = dict[str, dict[str, float]]  # task -> metric -> value


def log(message: str) -> None:
    print(f"[quark-ptq-eval] {message}", file=sys.stderr, flush=True)


@dataclass
class TierInputs:
    model_dir: Path
    options: EvalOptions
    workdir: Path
    approver: Any
    source_model: Path | None = None
    plan: PlanJson | None = None
    log: Callable[[str], None] = log
    # (work, done, total) -> a bar with an ETA on a terminal, milestone lines elsewhere (ui.Reporter.progress)
    progress: Callable[[str, int, int], None] | None = None
    started: float = field(default_factory=time.perf_counter)  # the approval: where the timed span begins


SPAN = "from the tier's approval to the report written"


@dataclass
class RuntimeEstimate:
    """A run-time prediction measured by a pilot on the real model (not guessed from constants).

    It covers the same span the report's actual time measures (:data:`SPAN`): ``elapsed_s`` is
    what was already spent when it is announced (data, model loading, the pilot: measured, broken
    down in ``parts``), ``seconds`` the pilot's prediction of the rest of the run and ``finish_s``
    of writing the report. ``total_s`` is their sum: the figure announced and reported.
    """

    tier: str
    seconds: float | None  # what is left after the pilot; None: nothing runs here (Tier 3 off ROCm, skip)
    hardware: str
    model_bytes: int
    data: str  # how much evaluation data, in words
    basis: str  # what the pilot measured
    warning: str | None = None
    threshold_s: float = 15 * 60
    elapsed_s: float = 0.0  # measured, from the approval to this estimate
    finish_s: float = 0.0  # predicted: statistics, chart and report files
    parts: dict[str, float] = field(default_factory=dict)  # measured pieces of elapsed_s
    settings: list[str] = field(default_factory=list)  # chosen for this run, each with its reason (Tier 3's server)

    @property
    def long(self) -> bool:
        return self.seconds is not None and self.seconds > self.threshold_s  # what approving would cost

    @property
    def total_s(self) -> float | None:
        return None if self.seconds is None else self.elapsed_s + self.seconds + self.finish_s

    def summary(self) -> str:
        total = self.total_s
        if total is None or self.seconds is None:
            when = "nothing runs on this host"
        else:
            spent = ", ".join(f"{k} {v:.1f} s" for k, v in self.parts.items() if v >= 0.05)
            when = (
                f"about {format_duration(total)} from approval to report ({self.elapsed_s:.1f} s spent"
                + (f": {spent}" if spent else "")
                + f"; about {format_duration(self.seconds + self.finish_s)} left)"
            )
        lines = [
            f"Tier {self.tier}: {when}",
            f"  model: {self.model_bytes / 2**20:.1f} MiB of weights; data: {self.data}",
            f"  hardware: {self.hardware}",
            f"  measured: {self.basis}",
        ]
        lines += [f"  {line}" for line in self.settings]
        if self.warning:
            lines.append(f"  warning: {self.warning}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "total_s": self.total_s,
            "elapsed_s": self.elapsed_s,
            "finish_s": self.finish_s,
            "parts": dict(self.parts),
            "span": SPAN,
            "hardware": self.hardware,
            "model_bytes": self.model_bytes,
            "data": self.data,
            "basis": self.basis,
            "warning": self.warning,
            "settings": list(self.settings),
            "long": self.long,
        }


@dataclass
class TierOutcome:
    quantized: Scores
    baseline: Scores | None = None
    directions: dict[str, dict[str, bool]] = field(default_factory=dict)  # task -> metric -> higher is better
    details: TierDetails = field(default_factory=TierDetails)  # the tier's own type (details.py); a dict is kept as given
    informational: tuple[str, ...] = ()  # metrics reported without a verdict
    deferred_commands: list[dict[str, Any]] = field(default_factory=list)  # Tier 3 off ROCm
    notes: list[str] = field(default_factory=list)
    artifacts: dict[str, str] = field(default_factory=dict)  # name -> path of files written

    def __post_init__(self) -> None:
        self.details = details_of(self.details)


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


@dataclass(frozen=True)
class ScoredText:
    """A text scored window by window, as the text tier turns it into its outcome (``text_outcome``):
    its statistics, the window and batch, how each model was loaded and what compare adds (the
    cached baseline's KL bounds and the cache it read)."""

    acc: Any  # the text tier's accumulator (new_accumulator()), filled batch by batch
    seq_len: int
    batch_size: int
    loader: str  # the quantized model's loader, with its reason
    baseline_loader: str | None = None  # None: no baseline
    window_note: str | None = None  # why the default window was clamped
    kl_extra: dict[str, float] = field(default_factory=dict)  # added to the KL summary
    baseline_cache: dict[str, Any] | None = None


class TierRunner(ABC):
    """A tier: its module subclasses this (or TextScorer / TaskScorer below) and its registry row names the
    subclass (``Tier.runner``). ``prepare`` measures a pilot and asks nothing; ``score`` runs the rest;
    ``section`` renders the tier's details as the report's lines (report.py adds the generic parts)."""

    @abstractmethod
    def prepare(self, ctx: TierInputs) -> Prepared: ...

    @abstractmethod
    def score(self, prepared: Any) -> TierOutcome: ...

    @abstractmethod
    def section(self, report: Any) -> list[str]: ...  # an eval_report.EvalReport (which imports this module)


class TextScorer(TierRunner):
    """The tier that scores a text, as compare and the calibration-overlap check score through it."""

    @abstractmethod
    def eval_texts(self, eval_data: Path | None, limit: int | None = None) -> list[str]: ...

    @abstractmethod
    def token_windows(self, tokenizer: Any, texts: list[str], seq_len: int, max_windows: int | None) -> Any: ...

    @abstractmethod
    def auto_batch_size(self, seq_len: int, vocab: int, device: str) -> int: ...

    @abstractmethod
    def new_accumulator(self) -> Any: ...

    @abstractmethod
    def text_outcome(self, scored: ScoredText) -> TierOutcome: ...


class TaskScorer(TierRunner):
    """The tier that scores lm-eval tasks in this process, as compare scores through it: the tasks checked
    before any model loads, a run on a loaded model (results and per-document scores, written under
    ``ctx.workdir``), where a run's per-document scores are kept, the results read back as scores, and the paired
    per-document tests against a baseline's."""

    @abstractmethod
    def task_manager(self, include_path: Path | None) -> Any: ...

    @abstractmethod
    def check_tasks(self, manager: Any, tasks: list[str]) -> list[str]: ...

    @abstractmethod
    def evaluate_tasks(self, loaded: LoadedModel, ctx: TierInputs, task_names: list[str],
                       label: str) -> dict[str, Any]: ...

    @abstractmethod
    def samples_path(self, workdir: Path, label: str) -> Path: ...

    @abstractmethod
    def scores_from(self, results: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]: ...

    @abstractmethod
    def paired_tests(self, baseline: dict[str, Any], quantized: dict[str, Any],
                     directions: dict[str, Any] | None = None) -> dict[str, dict[str, dict[str, Any]]]: ...


class Prepared(Protocol):
    """What a tier's ``prepare`` returns: whatever its ``score`` needs, and the pilot's estimate."""

    @property
    def estimate(self) -> RuntimeEstimate: ...


def tier_runner(tier: Tier) -> TierRunner:
    """The runner of ``tier`` (its module imported only now: its dependencies are heavy), held to the base class
    its row promises: a TextScorer where it scores a text, a TaskScorer where it scores tasks in this process."""
    if tier.runner is None:
        raise UsageError(f"Tier {tier.name!r} runs nothing.")
    module, _, name = tier.runner.partition(":")
    cls = getattr(importlib.import_module(module), name, None)
    base = TextScorer if tier.scores_text else TaskScorer if tier.scores_tasks and tier.loads_model else TierRunner
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise InvalidEntry(f"Tier {tier.name!r}: {tier.runner} is no subclass of {base.__name__} "
                           f"(evaluate/context.py).")
    try:
        return cls()
    except TypeError as exc:  # an abstract method left undefined
        raise InvalidEntry(f"Tier {tier.name!r}: {tier.runner} does not keep the tier contract: {exc}.") from None


def text_scorer() -> TextScorer:
    """The runner of the tier that scores a text (tiers.text_tier()), as compare scores through it."""
    from quark_ptq_eval.evaluate.tiers import text_tier

    scorer = tier_runner(text_tier())
    assert isinstance(scorer, TextScorer)  # tier_runner held it to the class its row promises
    return scorer


def task_scorer() -> TaskScorer:
    """The runner of the tier that scores lm-eval tasks in this process (tiers.task_tier()), as compare scores
    through it."""
    from quark_ptq_eval.evaluate.tiers import task_tier

    scorer = tier_runner(task_tier())
    assert isinstance(scorer, TaskScorer)  # tier_runner held it to the class its row promises
    return scorer
