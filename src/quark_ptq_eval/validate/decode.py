"""The decode check: every quantized weight, decoded as the format defines it, gives back its source.

An export holds everything needed to judge each weight exactly: its codes, scales and zero points
decoded with Quark's packing (``decode_formats.py``) must land within the scheme's rounding of the
source weight (``decode_weights.py``), element by element. A flipped row, dead rows, a scale read
25 % off, a zero point one step off, two swapped nibbles or an MX exponent one too high all break
that while headers, shapes and bytes elsewhere are right, and the module replay may read them as
noise. Tensor by tensor, a row chunk at a time: no model is loaded, so it runs with
``--no-load-check`` on models too large for the host.

Bounds, by algorithm (``bench/bench_decode.py`` measures the statistical ones on healthy exports):

- round-to-nearest: half a step of the grid around each source value (beyond the grid's ends,
  where the quantizer clamps, the end itself), plus ``RTN_SLACK`` steps of float rounding. Exact.
- GPTQ moves codes to compensate earlier errors: each code within ``GPTQ_STEPS`` steps of where the
  source falls; each row's gain (least squares of the decoded row on the source's) within
  ``GPTQ_GAIN`` of 1; each row's error within ``GPTQ_ERROR_RATIO`` times round-to-nearest's with the
  same scales.
- AWQ / SmoothQuant fold a per-channel scale: undone before comparing (``scaling_layers`` in the
  export: a norm's ratio source / export, exact; a linear's, from that linear's own rows, with the
  estimate's standard error added to the bound).
- rotation: not checked (each weight is the source's times a rotation the export does not store).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.errors import UnsafeInputError
from quark_ptq_eval.base.safetensors_io import TensorInfo, read_model_headers
from quark_ptq_eval.base.schemes import as_spec_list
from quark_ptq_eval.validate import decode_formats as fmt
from quark_ptq_eval.validate.byte_identity import default_workers
from quark_ptq_eval.validate.decode_weights import Fold, RowErrors, Target, compare
from quark_ptq_eval.validate.expectations import module_config
from quark_ptq_eval.validate.folds import fold_groups, per_expert_folds
from quark_ptq_eval.validate.registry import ValidationContext, read_config, unreadable_headers
from quark_ptq_eval.validate.report import CheckResult, Finding
from quark_ptq_eval.validate.rewrites import LAYER, ROTATING, SCALING, algorithms

if TYPE_CHECKING:
    import numpy as np

RTN_SLACK = 1e-3  # steps: float32 rounding of w / scale (+ zero point); measured worst 0.5000005
# GPTQ, measured on healthy exports (bench/bench_decode.py): codes <= 2.9 steps off, |gain - 1| <= 0.031,
# row error <= 2.0x round-to-nearest's (tiny Llama int4_wo_128): each limit holds a margin of >= 1.4x.
GPTQ_STEPS = 4.0
GPTQ_GAIN = 0.1
GPTQ_ERROR_RATIO = 3.0
FOLD_SIGMAS = 8.0  # a scale estimated from a linear's rows: this many standard errors (healthy AWQ: 4 fail, 5 pass)
MAX_ROWS_LISTED = 8


@dataclass(frozen=True)
class Bound:
    kind: str  # "round-to-nearest" or "gptq"
    steps: float
    gain: float | None = None
    error_ratio: float | None = None

    def describe(self) -> str:
        text = f"{self.steps:g} step per element ({self.kind})"
        if self.gain is not None:
            text += f", row gain 1 +- {self.gain:g}, row error <= {self.error_ratio:g}x round-to-nearest's"
        return text


def decode_export(source: Path, quantized: Path, plan: dict[str, Any] | None = None,
                  weights_source: Path | None = None) -> CheckResult:
    """The decode check alone on one export (``weights_source``: read source weights there instead,
    e.g. a dequantized BF16 copy of an FP8 release); never raises on a mismatch."""
    ctx = ValidationContext(Path(source), Path(quantized), plan, weights_source=weights_source)
    ctx.src_config, ctx.out_config = read_config(ctx.source), read_config(ctx.quantized)
    ctx.read_headers()
    return check_decode(ctx)


def check_decode(ctx: ValidationContext) -> CheckResult:
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


def _source_tensors(ctx: ValidationContext, result: CheckResult) -> dict[str, TensorInfo] | None:
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


def find_targets(output: dict[str, TensorInfo], source: dict[str, TensorInfo],
                 qconfig: dict[str, Any]) -> tuple[list[Target], list[tuple[str, str]]]:
    """Every weight with a ``weight_scale`` in the export, with what decodes it; and those that cannot be."""
    reorder = ((qconfig.get("export") or {}).get("pack_method") or "reorder") == "reorder"
    targets, unchecked = [], []
    for name in sorted(output):
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is None or f"{module}.weight_scale" not in output:
            continue
        config = module_config(qconfig, module)
        specs = as_spec_list(config.weight if config else None)
        why = _cannot_decode(name, specs, output, source)
        if why:
            unchecked.append((name, why))
            continue
        targets.append(Target(module, output[name], output[f"{module}.weight_scale"],
                              output.get(f"{module}.weight_zero_point"), source[name], specs[0], reorder))
    return targets, unchecked


def _cannot_decode(name: str, specs: list[dict[str, Any]], output: dict[str, TensorInfo],
                   source: dict[str, TensorInfo]) -> str | None:
    if len(specs) != 1:
        return "two-level scales" if len(specs) > 1 else "no weight spec in quantization_config"
    if name not in source:
        return "no source tensor of that name"
    if len(source[name].shape) != 2:
        return f"a {len(source[name].shape)}-D weight"
    if specs[0].get("qscheme") not in ("per_tensor", "per_channel", "per_group"):
        return f"qscheme {specs[0].get('qscheme')}"
    if f"{name[: -len('.weight')]}.weight_scale_2" in output:
        return "two-level scales"
    return None


def bound_for(algos: set[str]) -> Bound:
    if "gptq" in algos:
        return Bound("gptq", GPTQ_STEPS, GPTQ_GAIN, GPTQ_ERROR_RATIO)
    return Bound("round-to-nearest", 0.5 + RTN_SLACK)


def decode_targets(targets: list[Target], ctx: ValidationContext, result: CheckResult, algos: set[str]) -> None:
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


def _outcomes(targets: list[Target], ctx: ValidationContext, result: CheckResult, algos: set[str],
              bound: Bound) -> Iterator[tuple[Target, Fold | None, RowErrors | Exception]]:
    """(target, fold, comparison or the exception that stopped it), in order. Without folds the tensors
    are independent: a thread pool overlaps one tensor's reads with another's arithmetic (numpy releases
    the GIL); with folds a pair's first linear must come first, so they run in turn."""
    def one(target: Target, fold: Fold | None) -> tuple[Target, Fold | None, RowErrors | Exception]:
        try:
            return target, fold, compare(target, bound.steps, fold, rtn_reference=bound.gain is not None,
                                         clipped="awq" in algos)
        except (fmt.UnsupportedFormat, OSError, ValueError) as exc:
            return target, fold, exc

    if algos & SCALING:
        folds = FoldFinder(ctx, targets)
        for target in folds.ordered():
            try:
                fold = folds.fold_for(target, result)
            except (fmt.UnsupportedFormat, OSError, ValueError) as exc:
                yield target, None, exc
                continue
            yield one(target, fold)
        return
    order = sorted(targets, key=lambda t: (str(t.source.file), t.source.start))  # the files front to back
    workers = ctx.workers or default_workers()

    def prefetching(i: int) -> tuple[Target, Fold | None, RowErrors | Exception]:
        if i + workers < len(order):  # the tensor this thread takes next: read while this one is compared
            fmt.prefetch(order[i + workers].tensors())
        return one(order[i], None)

    fmt.prefetch([p for t in order[:workers] for p in t.tensors()])
    with ThreadPoolExecutor(max_workers=workers) as pool:
        yield from pool.map(prefetching, range(len(order)))


def judge(target: Target, c: RowErrors, bound: Bound, fold: Fold | None) -> list[Finding]:
    """Findings for one tensor: rows with elements over the bound, and (GPTQ) rows off in gain or error."""
    import numpy as np

    findings = []
    name = target.weight.name
    folded = f" after undoing the scale folded from {fold.origin}" if fold is not None else ""
    if c.over:
        rows = sorted(c.over)
        row = max(rows, key=lambda r: c.worst_steps[r])
        where = _groups(target, c.over) if target.grouped else ""
        findings.append(Finding(
            name, f"decodes{folded} to more than {bound.steps:g} step from the source weight in {len(rows)} of "
                  f"{c.rows} output rows ({_ranges(rows)}){where}.", side="quark",
            evidence=f"bound: {bound.describe()}; worst: {float(c.worst_steps[row]):.3g} steps at row {row}, column "
                     f"{int(c.worst_col[row])}; decoded with {_format(target)}"))
    if bound.gain is not None and c.gain is not None and c.rtn_error is not None and c.rel_error is not None:
        with np.errstate(invalid="ignore"):
            gain_off = np.nonzero(~(np.abs(c.gain - 1) <= bound.gain) & (c.rtn_error > 0) | ~np.isfinite(c.gain))[0]
            ratio = np.where(c.rtn_error > 0, c.rel_error / c.rtn_error, 0.0)
        off = sorted(set(gain_off.tolist()) | set(np.nonzero(~(ratio <= bound.error_ratio))[0].tolist()))
        if off:
            row = off[0]
            findings.append(Finding(
                name, f"decodes{folded} to rows off the source's beyond GPTQ's error compensation in {len(off)} of "
                      f"{c.rows} output rows ({_ranges(off)}).", side="quark",
                evidence=f"bound: {bound.describe()}; row {row}: gain {float(c.gain[row]):.3g}, error "
                         f"{float(ratio[row]):.3g}x round-to-nearest's; decoded with {_format(target)}"))
    return findings


def _groups(target: Target, over: dict[int, list[int]]) -> str:
    groups = sorted({g for gs in over.values() for g in gs})
    size = target.group_size
    return f", groups {_ranges(groups)} of {size} columns" if size else ""


def _format(t: Target) -> str:
    text = f"{t.dtype} {t.spec.get('qscheme')}"
    if t.group_size:
        text += f" group {t.group_size}"
    if t.spec.get("scale_format"):
        text += f" ({t.spec['scale_format']} scales)"
    return text + (" and zero points" if t.zero_point is not None else "")


def _ranges(values: list[int]) -> str:
    """``3, 7-9, 12 ...``: at most ``MAX_ROWS_LISTED`` runs."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:MAX_ROWS_LISTED])
    return text + (" ..." if len(runs) > MAX_ROWS_LISTED else "")


class FoldFinder:
    """The scale an AWQ/SmoothQuant fold moved into each weight, from the export's ``scaling_layers``."""

    def __init__(self, ctx: ValidationContext, targets: list[Target]):
        self.ctx, self.targets = ctx, {t.module: t for t in targets}
        self.groups = fold_groups(ctx.qconfig)
        self.row_scales: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # prev linear -> (s, relative standard error)

    def ordered(self) -> list[Target]:
        """Linears another linear's fold comes from go first: their rows give that scale."""
        prevs = {prev for t in self.targets.values() for prev in self._folds_into(t)}
        return sorted(self.targets.values(), key=lambda t: (t.module not in prevs, t.module))

    def fold_for(self, target: Target, result: CheckResult) -> Fold | None:
        import numpy as np

        cols, col_tol, origins = None, None, []
        for name in self._folds_into(target):
            if name in self.targets:
                s, se = (_to_columns(a, target.source.shape[1], self.ctx.src_config) for a in self._row_scale(name))
                cols = s if cols is None else cols * s
                col_tol = se if col_tol is None else col_tol + se
                origins.append(f"{name} (estimated from its rows: the fault may be in either)")
            else:
                ratio = self._norm_ratio(name)
                if ratio is None:
                    result.notes.append(f"{target.weight.name}: the fold from {name} could not be read; compared as is")
                    continue
                cols = ratio if cols is None else cols * ratio
                origins.append(name)
        rows, row_tol = None, None
        if self._feeds_a_fold(target, self.targets):
            rows, row_tol = self._row_scale(target.module, cols)
            result.findings += _unfoldable_rows(target, rows)
            origins.append("its own rows")
        if cols is None and rows is None:
            return None
        tol = np.zeros((target.source.shape[0], 1), np.float32) if row_tol is None else row_tol[:, None]
        if col_tol is not None:
            tol = tol + col_tol[None, :]
        return Fold(cols, rows, FOLD_SIGMAS * tol + _float_slack(self.ctx, target), " and ".join(origins))

    def _local(self, module: str) -> tuple[str, str, list[tuple[str, list[str]]]] | None:
        """(decoder layer, name relative to it, the folds that hold there): the export's
        ``scaling_layers`` plus Quark's per-expert entries placed under the module's expert (folds.py)."""
        match = LAYER.match(module)
        if not match:
            return None
        layer, rel = match.group(1), match.group(2)
        groups = list(self.groups)  # a per-expert entry may restate a layer-level one: each fold counts once
        groups += [g for g in per_expert_folds(rel, self.groups) if g not in groups]
        return layer, rel, groups

    def _folds_into(self, target: Target) -> list[str]:
        """The modules (absolute names) whose scale was folded into this linear's input columns."""
        local = self._local(target.module)
        if local is None:
            return []
        layer, rel, groups = local
        return [f"{layer}.{prev}" for prev, layers in groups if rel in layers]

    def _feeds_a_fold(self, target: Target, targets: dict[str, Target]) -> bool:
        """The linear's rows were divided by a scale its consumer took: one whose inputs are these rows."""
        local = self._local(target.module)
        if local is None:
            return False
        layer, rel, groups = local
        return any(f"{layer}.{x}" in targets for prev, layers in groups if prev == rel for x in layers)

    def _norm_ratio(self, norm: str) -> np.ndarray | None:
        """source / export of a norm's weight: the scale each input channel of its linears was multiplied by."""
        import numpy as np

        name = f"{norm}.weight"
        src, out = self.ctx.tensors("source") or {}, self.ctx.tensors("output") or {}
        if name not in src or name not in out or src[name].shape != out[name].shape:
            return None
        c = _norm_offset(self.ctx.src_config)  # Quark folds s into (w + c) / s - c
        a = fmt.as_float(src[name], fmt.read_array(src[name])) + c
        b = fmt.as_float(out[name], fmt.read_array(out[name])) + c
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(b != 0, a / b, 1.0).astype(np.float32)

    def _row_scale(self, module: str, cols: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """s per output row of a linear whose rows were divided by s: 1 / its rows' gain on the source's."""
        import numpy as np

        if module not in self.row_scales:
            target = self.targets[module]
            c = compare(target, math.inf, Fold(cols) if cols is not None else None, row_stats=True)
            assert c.gain is not None and c.rel_error is not None  # row_stats=True computes both
            with np.errstate(divide="ignore", invalid="ignore"):
                s = (1.0 / c.gain).astype(np.float32)
                # decoded = gain * source + residual: the gain's relative standard error over the row
                residual = np.sqrt(np.maximum(c.rel_error ** 2 - (1 - c.gain) ** 2, 0))
                se = (residual / (np.sqrt(max(c.cols - 1, 1)) * np.abs(c.gain))).astype(np.float32)
            self.row_scales[module] = (s, se)
        return self.row_scales[module]


# Model types whose RMSNorm scales by (1 + weight): Quark's UNIT_OFFSET_NORM_CLASSES by model type.
UNIT_OFFSET_NORM_TYPES = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "recurrent_gemma", "vaultgemma",
                                    "t5gemma", "t5gemma2", "qwen3_5", "qwen3_5_moe", "qwen3_5_text"})


def _norm_offset(config: dict[str, Any]) -> float:
    types = {str(config.get("model_type", ""))}
    if isinstance(config.get("text_config"), dict):
        types.add(str(config["text_config"].get("model_type", "")))
    return 1.0 if types & UNIT_OFFSET_NORM_TYPES else 0.0


def _to_columns(per_row: np.ndarray, columns: int, config: dict[str, Any]) -> np.ndarray:
    """A prev linear's per-row scale on its consumer's columns: under grouped-query attention each of
    v_proj's heads feeds ``heads / kv_heads`` of o_proj's, which took the same scale."""
    import numpy as np

    if len(per_row) == columns:
        return per_row
    cfg: dict[str, Any] = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    heads = int(cfg.get("num_attention_heads") or 0)
    head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads if heads else 0))
    if not head_dim or columns % len(per_row) or columns != heads * head_dim:
        raise fmt.UnsupportedFormat(f"a fold of {len(per_row)} channels into {columns} columns")
    c = np.arange(columns)
    spread: np.ndarray = per_row[(c // head_dim) // (columns // len(per_row)) * head_dim + c % head_dim]
    return spread


def _unfoldable_rows(target: Target, scale: np.ndarray) -> list[Finding]:
    """A folded scale is positive and finite: a row decoding to a negative, zero or no multiple of the source's is broken."""
    import numpy as np

    bad = np.nonzero(~(scale > 0) | ~np.isfinite(scale))[0].tolist()
    if not bad:
        return []
    row = bad[0]
    return [Finding(target.weight.name, f"decodes to rows that are no positive multiple of the source's in {len(bad)} of "
                                        f"{len(scale)} output rows ({_ranges(bad)}): a folded scale cannot explain "
                                        "them.", side="quark",
                    evidence=f"expected: a positive gain per row (the scale the algorithm divided the row by); "
                             f"found {1 / float(scale[row]) if scale[row] else 0.0:.3g} at row {row}; decoded with "
                             f"{_format(target)}")]


def _float_slack(ctx: ValidationContext, target: Target) -> float:
    """Per unit |x|: in a BF16 model a fold passes through up to three roundings of 2^-9 each (the
    scale, the scaled weight, the divided norm; F16 2^-12, F32 2^-25): 2^-6 leaves a margin of 2.7x
    (healthy random-weight BF16 SmoothQuant exports read up to 0.62 step with 2^-8). The model's float
    dtype is read from its 1-D tensors (norms and biases, whatever their names: GPT-J's are ``ln_1``)."""
    dtypes = {t.dtype for n, t in (ctx.tensors("output") or {}).items()
              if len(t.shape) == 1 and "scale" not in n and "zero_point" not in n}
    return 2.0 ** -6 if "BF16" in dtypes else 2.0 ** -9 if "F16" in dtypes else 2.0 ** -22
