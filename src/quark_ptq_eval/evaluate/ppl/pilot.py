"""Tier 1's pilot: the first batches scored before the checkpoint, timed, and the estimate (and the
resolution warning) the user approves."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quark_ptq_eval.evaluate.context import RuntimeEstimate, TierInputs, hardware_description
from quark_ptq_eval.evaluate.ppl.kernels import score_batch, synchronize
from quark_ptq_eval.evaluate.ppl.stats import Accumulator, resolution_pct

if TYPE_CHECKING:
    import torch

    from quark_ptq_eval.runtime.loading import LoadedModel

FINISH_S = 1.0  # statistics, chart and report files after the last batch (bench/benchmarks/bench_estimates.py)


class Clock:
    """Seconds per piece of the preparation, for the estimate's breakdown."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, piece: str) -> None:
        now = time.perf_counter()
        self.parts[piece] = self.parts.get(piece, 0.0) + now - self._last
        self._last = now


@dataclass(frozen=True)
class PilotTiming:
    """What the pilot measured: batches of up to ``batch_size`` windows, ``per_batch_s`` after warm-up."""

    batch_size: int
    batches: int
    per_batch_s: float


def pilot(quantized: LoadedModel, baseline: LoadedModel | None, windows: torch.Tensor, batch_size: int,
          acc: Accumulator) -> tuple[int, float, float]:
    """Score up to two batches: batch 0 warms up (first-call allocations, kernel selection), batch 1,
    when there is one, is timed. Returns (batches, their seconds, seconds of the last)."""
    pilot_batches, pilot_s, per_batch_s = min(2, math.ceil(windows.shape[0] / batch_size)), 0.0, 0.0
    for index in range(pilot_batches):
        synchronize(quantized.device)
        started = time.perf_counter()
        score_batch(
            quantized.model,
            windows[index * batch_size : (index + 1) * batch_size].to(quantized.device),
            acc,
            baseline.model if baseline else None,
        )
        synchronize(quantized.device)
        per_batch_s = time.perf_counter() - started
        pilot_s += per_batch_s
    return pilot_batches, pilot_s, per_batch_s


def estimate(ctx: TierInputs, quantized: LoadedModel, baseline: LoadedModel | None, windows: torch.Tensor,
             timing: PilotTiming, prepared_acc: Accumulator) -> RuntimeEstimate:
    batch_size, pilot_batches, per_batch_s = timing.batch_size, timing.batches, timing.per_batch_s
    n = windows.shape[0]
    remaining_batches = math.ceil(n / batch_size) - pilot_batches
    models = "quantized + baseline" if baseline else "quantized"
    return RuntimeEstimate(
        tier="1 (ppl)",
        seconds=per_batch_s * remaining_batches,
        hardware=hardware_description(quantized.device),
        model_bytes=quantized.size_bytes + (baseline.size_bytes if baseline else 0),
        data=f"{n * windows.shape[1]:,} tokens in {n} windows of {windows.shape[1]}",
        basis=(
            f"pilot: {pilot_batches} batch(es) of up to {batch_size} window(s) on the {models} model(s), "
            f"{per_batch_s:.2f} s per batch after warm-up; {remaining_batches} batch(es) left"
        ),
        warning=resolution_warning(ctx, prepared_acc, n),
        threshold_s=ctx.options.confirm_above_s,
        finish_s=FINISH_S,
    )


def resolution_warning(ctx: TierInputs, acc: Accumulator, windows: int) -> str | None:
    """Said at the checkpoint: the pilot's spread projects an interval wider than the healthy threshold."""
    options = ctx.options
    if acc.base_window_nll:
        spread = [q - b for q, b in zip(acc.window_nll, acc.base_window_nll, strict=True)]
        what = "paired NLL differences with the baseline"
    elif options.reference:
        spread, what = acc.window_nll, "per-window NLLs (no baseline: unpaired)"
    else:
        return None  # nothing to compare with: no verdict to resolve
    half = resolution_pct(spread, windows)
    healthy = options.thresholds.healthy_pct
    if half is None or half <= healthy or not math.isfinite(half):
        return None  # inf: a spread that overflows is a broken model, not noise that hides a verdict
    needed = math.ceil(windows * (math.log1p(half / 100) / math.log1p(healthy / 100)) ** 2)
    return (
        f"{windows} windows are too few to resolve the healthy threshold: the pilot's {what} project "
        f"a 95 % interval of about ±{half:.2g} % on the perplexity, wider than --healthy-pct {healthy:g}; "
        f"about {needed:,} windows would resolve it (more --eval-data or a larger --max-windows)."
    )
