"""AWQ / SmoothQuant folds for the decode check: the per-channel scale each weight took, undone before comparing.

Read from the export's ``scaling_layers``: a norm's ratio source / export (exact); a linear's,
from that linear's own rows (the estimate's standard error joins the bound, ``FOLD_SIGMAS`` of it); where
those rows cannot certify it (the scheme crushed them), from the columns their consumer took it in
(``decode_damage.py``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.validate import decode_damage as damage
from quark_ptq_eval.validate import decode_formats as fmt
from quark_ptq_eval.validate.decode_blocks import DecodeTarget
from quark_ptq_eval.validate.decode_judge import format_of, ranges
from quark_ptq_eval.validate.decode_weights import Fold, RowErrors, Tolerance, compare
from quark_ptq_eval.validate.folds import fold_groups, per_expert_folds
from quark_ptq_eval.validate.registry import CheckInputs
from quark_ptq_eval.validate.report import CheckResult, Finding
from quark_ptq_eval.validate.rewrites import LAYER

if TYPE_CHECKING:
    import numpy as np

FOLD_SIGMAS = 8.0  # a scale estimated from a linear's rows: this many standard errors (healthy AWQ: 4 fail, 5 pass)


class FoldFinder:
    """The scale an AWQ/SmoothQuant fold moved into each weight, from the export's ``scaling_layers``."""

    def __init__(self, ctx: CheckInputs, targets: list[DecodeTarget]):
        self.ctx, self.targets = ctx, {t.module: t for t in targets}
        self.groups = fold_groups(ctx.qconfig)
        self.row_scales: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # prev linear -> (s, relative standard error)
        self.row_bounds: dict[str, np.ndarray] = {}  # prev linear -> the worst case its rows certify (decode_damage.py)
        self.rejudged: dict[str, tuple[list[int], str, np.ndarray]] = {}  # rows, certifying consumer, its bound
        self.damage: list[damage.Damage] = []

    def ordered(self) -> list[DecodeTarget]:
        """Linears another linear's fold comes from go first: their rows give that scale."""
        prevs = {prev for t in self.targets.values() for prev in self._folds_into(t)}
        return sorted(self.targets.values(), key=lambda t: (t.module not in prevs, t.module))

    def fold_for(self, target: DecodeTarget, result: CheckResult) -> Fold | None:
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
            origins.append("its own rows")
        if cols is None and rows is None:
            return None
        tolerance = Tolerance(row_tol, col_tol, FOLD_SIGMAS, _float_slack(self.ctx, target))
        return Fold(cols, rows, tolerance, " and ".join(origins))

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

    def _folds_into(self, target: DecodeTarget) -> list[str]:
        """The modules (absolute names) whose scale was folded into this linear's input columns."""
        local = self._local(target.module)
        if local is None:
            return []
        layer, rel, groups = local
        return [f"{layer}.{prev}" for prev, layers in groups if rel in layers]

    def _feeds_a_fold(self, target: DecodeTarget, targets: dict[str, DecodeTarget]) -> bool:
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
            self.row_bounds[module] = c.gain_bound if c.gain_bound is not None else np.zeros_like(s)
        return self.row_scales[module]

    def refold(self, target: DecodeTarget, fold: Fold | None, c: RowErrors, result: CheckResult) -> Fold | None:
        """``fold`` with the scale of each row that failed for want of a certified estimate read from the
        consumer's columns instead (``decode_damage.py``); None where no row needs it or none can get it."""
        tol = fold.tolerance if fold is not None else None
        if fold is None or fold.rows is None or tol is None or tol.rows is None:
            return None
        rows = damage.uncertified(c, fold.rows, self.row_bounds[target.module], tol.sigmas * tol.rows + tol.slack)
        try:
            column = self._consumer_scale(target) if rows else None
        except (fmt.UnsupportedFormat, OSError, ValueError) as exc:
            result.notes.append(f"{target.weight.name}: its consumer's columns could not be read ({exc})")
            return None
        if column is None:
            return None
        s, bound, consumer = column
        scale, row_tol = fold.rows.copy(), tol.rows.copy()
        scale[rows], row_tol[rows] = s[rows], (bound[rows] + tol.slack) / tol.sigmas
        self.rejudged[target.module] = (rows, consumer, bound)
        origin = f"{fold.origin} (rows {ranges(rows)}: the scale {consumer} took in its columns)"
        return Fold(fold.cols, scale, Tolerance(row_tol, tol.cols, tol.sigmas, tol.slack), origin)

    def settle(self, target: DecodeTarget, fold: Fold, c: RowErrors) -> None:
        """Re-judged rows that decode within the bound are damage, and their certified scale is the one
        the consumer's check uses."""
        rows, consumer, bound = self.rejudged.pop(target.module)
        ok = damage.settled(c, rows)
        if not ok or fold.rows is None or fold.tolerance is None or fold.tolerance.rows is None:
            return
        s, se = self.row_scales[target.module]
        s[ok], se[ok] = fold.rows[ok], fold.tolerance.rows[ok]
        assert c.nonzero is not None and c.peak is not None  # re-judged with row_stats
        self.damage.append(damage.Damage(target.weight.name, ok, [int(c.nonzero[r]) for r in ok],
                                         [float(c.peak[r]) for r in ok], c.cols, consumer,
                                         float(max(bound[r] for r in ok))))

    def certify(self, target: DecodeTarget, fold: Fold | None, c: RowErrors) -> tuple[Fold | None, RowErrors]:
        """Rows still failing for want of a scale, certified by round-to-nearest's own arithmetic instead: the
        scales the row's codes allow intersected with those its consumer's column allows
        (``decode_damage.scale_intervals``). Where the intersection holds a scale, the pair is what the fold
        and the scheme make of the source (damage, recorded); where it is empty, the finding stands."""
        import numpy as np

        if fold is None or fold.rows is None or not self._feeds_a_fold(target, self.targets):
            return fold, c
        with np.errstate(invalid="ignore"):
            failing = sorted(set(c.over) | set(np.flatnonzero(~(fold.rows > 0) | ~np.isfinite(fold.rows)).tolist()))
        consumers = self._sole_consumers(target) if failing else None  # a healthy pair is not read again
        if consumers is None:
            return fold, c
        slack = _float_slack(self.ctx, target)
        own = damage.scale_intervals(target, fold.cols, True, slack)
        lo, hi = own.lo.copy(), own.hi.copy()
        for consumer in consumers:
            theirs = damage.scale_intervals(consumer, None, False, slack)
            index = _to_columns(np.arange(len(lo)), len(theirs.lo), self.ctx.src_config).astype(np.int64)
            np.maximum.at(lo, index, theirs.lo)
            np.minimum.at(hi, index, theirs.hi)
        with np.errstate(invalid="ignore"):
            exact = (lo > 0) & (lo <= hi) & (hi < np.inf)
        # the consumer is judged with the exact scale where the pair allows one: its columns magnify any estimate's error
        scale, s_err = self._row_scale(target.module)
        scale[exact] = np.sqrt(lo[exact] * hi[exact])
        s_err[exact] = (np.sqrt(hi[exact] / lo[exact]) - 1) / FOLD_SIGMAS
        ok = [r for r in failing if exact[r]]
        if not ok:
            return fold, c
        rows = fold.rows.copy()
        rows[ok] = scale[ok]
        for r in ok:
            c.over.pop(r, None)
            c.worst_steps[r] = 0.5
        names = " and ".join(t.module for t in consumers)
        self.damage.append(damage.Damage(target.weight.name, ok, [int(own.nonzero[r]) for r in ok],
                                         [float(own.peak[r]) for r in ok], c.cols,
                                         f"{names} (round-to-nearest's arithmetic on both)",
                                         float(np.max(np.sqrt(hi[ok] / lo[ok]) - 1))))
        return Fold(fold.cols, rows, fold.tolerance, fold.origin), c

    def _sole_consumers(self, target: DecodeTarget) -> list[DecodeTarget] | None:
        """The linears whose columns took ``target``'s row scale and no other scale; None where one carries more."""
        local = self._local(target.module)
        assert local is not None  # target feeds a fold
        layer, rel, groups = local
        names = [f"{layer}.{x}" for prev, layers in groups if prev == rel for x in layers]
        consumers = [self.targets[n] for n in dict.fromkeys(names) if n in self.targets]
        if any(self._folds_into(t) != [target.module] or self._feeds_a_fold(t, self.targets) for t in consumers):
            return None
        return consumers or None

    def unfoldable(self, target: DecodeTarget, fold: Fold | None) -> list[Finding]:
        return _unfoldable_rows(target, fold.rows) if fold is not None and fold.rows is not None else []

    def _consumer_scale(self, target: DecodeTarget) -> tuple[np.ndarray, np.ndarray, str] | None:
        """``s`` per row of ``target`` as its consumers' columns took it, with its certified relative error;
        None where a consumer carries other scales too (another fold into its columns, or its rows folded)."""
        import numpy as np

        consumers = self._sole_consumers(target)
        if consumers is None:
            return None
        rows = len(self.row_scales[target.module][0])
        sums = np.zeros((3, rows), np.float64)
        for consumer in consumers:
            col_sums = compare(consumer, math.inf, col_stats=True).col_sums
            assert col_sums is not None  # col_stats=True computes them
            index = _to_columns(np.arange(rows, dtype=np.float64), col_sums.shape[1], self.ctx.src_config)
            for k in range(3):
                sums[k] += np.bincount(index.astype(np.int64), weights=col_sums[k], minlength=rows)
        s, bound = damage.column_scale(sums)
        return s, bound, " and ".join(c.module for c in consumers)


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


def _unfoldable_rows(target: DecodeTarget, scale: np.ndarray) -> list[Finding]:
    """A folded scale is positive and finite: a row decoding to a negative, zero or no multiple of the source's is broken."""
    import numpy as np

    bad = np.nonzero(~(scale > 0) | ~np.isfinite(scale))[0].tolist()
    if not bad:
        return []
    row = bad[0]
    return [Finding(target.weight.name, f"decodes to rows that are no positive multiple of the source's in {len(bad)} of "
                                        f"{len(scale)} output rows ({ranges(bad)}): a folded scale cannot explain "
                                        "them.", side="quark",
                    evidence=f"expected: a positive gain per row (the scale the algorithm divided the row by); "
                             f"found {1 / float(scale[row]) if scale[row] else 0.0:.3g} at row {row}; decoded with "
                             f"{format_of(target)}")]


def _float_slack(ctx: CheckInputs, target: DecodeTarget) -> float:
    """Per unit |x|: in a BF16 model a fold passes through up to three roundings of 2^-9 each (the
    scale, the scaled weight, the divided norm; F16 2^-12, F32 2^-25): 2^-6 leaves a margin of 2.7x
    (healthy random-weight BF16 SmoothQuant exports read up to 0.62 step with 2^-8). The model's float
    dtype is read from its 1-D tensors (norms and biases, whatever their names: GPT-J's are ``ln_1``)."""
    dtypes = {t.dtype for n, t in (ctx.tensors("output") or {}).items()
              if len(t.shape) == 1 and "scale" not in n and "zero_point" not in n}
    return 2.0 ** -6 if "BF16" in dtypes else 2.0 ** -9 if "F16" in dtypes else 2.0 ** -22
