"""The decode check: every quantized weight, decoded as the format defines it, gives back its source.

An export holds everything needed to judge each weight exactly: its codes, scales and zero points
decoded with Quark's packing (``decode_formats.py``) must land within the scheme's rounding of the
source weight (``decode_weights.py``), element by element. A flipped row, dead rows, a scale read
25 % off, a zero point one step off, two swapped nibbles or an MX exponent one too high all break
that while headers, shapes and bytes elsewhere are right, and the module replay may read them as
noise. Tensor by tensor, a tile at a time read through the file (``decode_blocks.py``: memory
follows the tile, not the tensor): no model is loaded, so it runs with ``--no-load-check`` on
models too large for the host. Which weights it decodes: ``decode_targets.py``; verdicts:
``decode_judge.py``; folds undone: ``decode_folds.py``.

Bounds, by algorithm (``bench/benchmarks/bench_decode.py`` measures the statistical ones on healthy exports):

- round-to-nearest: half a step of the grid around each source value (beyond the grid's ends,
  where the quantizer clamps, the end itself), plus ``RTN_SLACK`` steps of float rounding. Exact.
- GPTQ moves codes to compensate earlier errors: each code within ``GPTQ_STEPS`` steps of where the
  source falls; each row's gain (least squares of the decoded row on the source's) within
  ``GPTQ_GAIN`` of 1; each row's error within ``GPTQ_ERROR_RATIO`` times round-to-nearest's with the
  same scales.
- AWQ / SmoothQuant fold a per-channel scale: undone before comparing (``scaling_layers`` in the
  export: a norm's ratio source / export, exact; a linear's, from that linear's own rows, with the
  estimate's standard error added to the bound). A row whose own codes cannot certify that scale
  (the scheme rounded it to nearly nothing) is judged again with the scale its consumer's columns
  certify; passing, it is quantization damage, recorded, not a finding (``decode_damage.py``).
- rotation: not checked (each weight is the source's times a rotation the export does not store).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UnsafeInputError
from quark_ptq_eval.base.safetensors_io import TensorInfo, read_model_headers
from quark_ptq_eval.validate import decode_damage as damage
from quark_ptq_eval.validate import decode_formats as fmt
from quark_ptq_eval.validate.byte_identity import default_workers
from quark_ptq_eval.validate.decode_blocks import DecodeTarget
from quark_ptq_eval.validate.decode_folds import FoldFinder
from quark_ptq_eval.validate.decode_judge import MAX_ROWS_LISTED, Bound, bound_for, judge
from quark_ptq_eval.validate.decode_targets import find_targets
from quark_ptq_eval.validate.decode_weights import Fold, RowErrors, compare
from quark_ptq_eval.validate.registry import CheckInputs, read_config_or_empty, unreadable_headers
from quark_ptq_eval.validate.report import CheckResult, Finding
from quark_ptq_eval.validate.rewrites import ROTATING, SCALING, algorithms


def decode_export(source: Path, quantized: Path, plan: dict[str, Any] | None = None,
                  weights_source: Path | None = None, workers: int | None = None) -> CheckResult:
    """The decode check alone on one export (``weights_source``: read source weights there instead,
    e.g. a dequantized BF16 copy of an FP8 release; ``workers``: threads, default as ``validate``'s);
    never raises on a mismatch."""
    ctx = CheckInputs(Path(source), Path(quantized), plan, weights_source=weights_source, workers=workers)
    ctx.src_config, ctx.out_config = read_config_or_empty(ctx.source), read_config_or_empty(ctx.quantized)
    ctx.read_headers()
    return check_decode(ctx)


def check_decode(ctx: CheckInputs) -> CheckResult:
    if (bad := unreadable_headers(ctx, "decode")) is not None:
        return bad
    result = CheckResult("decode")
    source = _source_tensors(ctx, result)
    if source is None:
        return result
    algos = set(algorithms(ctx.qconfig, ctx.plan))
    targets, unchecked = find_targets(ctx.readable("output"), source, ctx.qconfig or {})
    result.stats.update(quantized_weights=len(targets) + len(unchecked))
    if algos & ROTATING:
        result.notes.append(f"not checked: rotation ({', '.join(sorted(algos & ROTATING))}): each weight is the "
                            "source's rotated, and the export does not store the rotation")
        result.stats["checked"] = 0
        return result
    for name, why in unchecked[:MAX_ROWS_LISTED]:
        result.notes.append(f"not checked: {name} ({why})")
    decode_targets(targets, ctx, result, algos)
    return result


def _source_tensors(ctx: CheckInputs, result: CheckResult) -> dict[str, TensorInfo] | None:
    """The source weights: the source's own, or ``ctx.weights_source``'s (an FP8 release's dequantized copy)."""
    alternative = getattr(ctx, "weights_source", None)
    if alternative is None:
        return ctx.readable("source")
    try:
        headers = read_model_headers(Path(alternative))
    except UnsafeInputError as exc:
        result.findings.append(Finding("weights source", exc.message, side="environment"))
        return None
    result.notes.append(f"source weights read from {alternative}")
    return headers


def decode_targets(targets: list[DecodeTarget], ctx: CheckInputs, result: CheckResult, algos: set[str]) -> None:
    bound = bound_for(algos)
    t0, done, total = time.perf_counter(), 0, sum(t.source.nbytes for t in targets)
    worst: tuple[float, str] = (0.0, "")
    for target, fold, outcome in _outcomes(targets, ctx, result, algos, bound):
        if isinstance(outcome, Exception):
            result.notes.append(f"not checked: {target.weight.name} ({outcome})")
            continue
        result.findings += judge(target, outcome, bound, fold)
        worst = max(worst, (float(outcome.worst_steps.max()) if outcome.rows else 0.0, target.weight.name))
        done += target.source.nbytes
        if ctx.progress:
            ctx.progress("decode", done, total)
    result.stats.update(checked=len(targets), bound=bound.describe(), worst_steps=round(worst[0], 4),
                        worst_tensor=worst[1], decode_seconds=round(time.perf_counter() - t0, 3))
    if targets:
        result.notes.append(f"{len(targets)} quantized weights decoded against the source: worst {worst[0]:.4g} step "
                            f"({worst[1]}); bound {bound.describe()}")


Outcome = tuple[DecodeTarget, Fold | None, RowErrors | Exception]


def _outcomes(targets: list[DecodeTarget], ctx: CheckInputs, result: CheckResult, algos: set[str],
              bound: Bound) -> Iterator[Outcome]:
    """(target, fold, comparison or the exception that stopped it), in order. Without folds the tensors
    are independent: a thread pool overlaps one tensor's reads with another's arithmetic (numpy releases
    the GIL); with folds a pair's first linear must come first, so they run in turn."""
    def one(target: DecodeTarget, fold: Fold | None, row_stats: bool = False) -> Outcome:
        try:
            return target, fold, compare(target, bound.steps, fold, rtn_reference=bound.gain is not None,
                                         clipped="awq" in algos, row_stats=row_stats)
        except (fmt.UnsupportedFormat, OSError, ValueError) as exc:
            return target, fold, exc

    if algos & SCALING:
        yield from _folded(FoldFinder(ctx, targets), result, one)
        return
    order = sorted(targets, key=lambda t: (str(t.source.file), t.source.start))  # the files front to back
    workers = ctx.workers or default_workers()

    def prefetching(i: int) -> tuple[DecodeTarget, Fold | None, RowErrors | Exception]:
        if i + workers < len(order):  # the tensor this thread takes next: read while this one is compared
            fmt.prefetch(order[i + workers].tensors())
        return one(order[i], None)

    fmt.prefetch([p for t in order[:workers] for p in t.tensors()])
    with ThreadPoolExecutor(max_workers=workers) as pool:
        yield from pool.map(prefetching, range(len(order)))


def _folded(folds: FoldFinder, result: CheckResult, one: Callable[..., Outcome]) -> Iterator[Outcome]:
    """Each weight after undoing its folds, in turn (a pair's first linear first); rows that fail for
    want of a certified scale judged again with the one their consumer's columns took (decode_damage.py)."""
    for target in folds.ordered():
        try:
            fold = folds.fold_for(target, result)
        except (fmt.UnsupportedFormat, OSError, ValueError) as exc:
            yield target, None, exc
            continue
        target, fold, outcome = one(target, fold)
        if isinstance(outcome, RowErrors) and (refold := folds.refold(target, fold, outcome, result)) is not None:
            again = one(target, refold, row_stats=True)
            if isinstance(again[2], RowErrors):
                folds.settle(target, refold, again[2])
                target, fold, outcome = again
        if isinstance(outcome, RowErrors):
            fold, outcome = folds.certify(target, fold, outcome)
        result.findings += folds.unfoldable(target, fold)
        yield target, fold, outcome
    damage.record(result, folds.damage)
