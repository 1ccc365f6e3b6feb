"""Remedies as plan variants, measured: which to try for a hurt model, and what their measurements say.

``remedies.py`` lists advice; each item is a hypothesis (int8 + SmoothQuant can be the harm itself: smoothing moves
scale into the weights and a per-tensor weight scale rounds rows to nothing). Here the top N become plans that
differ from the run's in one thing, ranked by what this run measured:

- the plan's scaling algorithm removed, first where validation found rows a fold crushed (a check's
  ``quantization_damage``) or a unit holding folded scales far from the source (``quantization_error``);
- the linears whose error the load check traced to an input outlier channel kept unquantized (with the linears
  vLLM fuses them with), and the block the evidence names (the damage, else the load check's worst module);
- no algorithm in the plan: the one its scheme calls for added (SmoothQuant for W8A8, GPTQ weight-only);
- more calibration data; a wider format.

Nothing the plan already does is proposed. ``judge`` then sets each measured variant beside the original on the
same windows against the same baseline: ΔNLL (the per-token NLL increase over the baseline, with its paired 95 %
interval) beyond the original's interval either way is helped or worse beyond noise; a variant measured worse than
the original, or not validated, is never recommended.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from quark_ptq_eval.base.artifacts import PlanJson
from quark_ptq_eval.evaluate.remedies import MIN_CALIBRATION, plan_algorithms
from quark_ptq_eval.plan.choices import SCALING_ALGORITHMS
from quark_ptq_eval.plan.groups import FUSED_LEAVES, LEAF_TO_FUSED
from quark_ptq_eval.plan.request import PlanChange

LAYER_BLOCK = "model.layers."
CALIBRATION_FACTOR = 4
HELPED, WITHIN, WORSE, FAILED = "helped beyond noise", "within noise", "rejected: worse", "rejected: not usable"
WIDER = {"int8": "fp8"}  # a wider format a W8A8 scheme falls back to


@dataclass(frozen=True)
class Variant:
    """One remedy as a plan: the run's plan with ``request`` over its options."""

    label: str  # the comparison cell's name
    kind: str  # algorithm_removed, algorithm_added, outliers_kept (both: algorithm_added_outliers_kept), block_kept,
    # calibration, wider_format
    changed: str  # what differs from the run's plan, in words
    why: str  # the evidence that proposed it
    scheme: str
    request: PlanChange = field(default_factory=PlanChange)

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "request": self.request.overrides()}


@dataclass(frozen=True)
class Evidence:
    """What validation measured that names a remedy: weights with rows a fold crushed (quantization damage) and
    the module with the largest quantization error (its cause and size)."""

    damaged: tuple[str, ...] = ()
    worst_module: str | None = None
    worst_cause: str = ""
    worst_error: float = 0.0
    outliers: tuple[str, ...] = ()  # modules whose error the load check traced to an input outlier channel

    @classmethod
    def of(cls, report: Mapping[str, object] | None) -> Evidence:
        """From validation_report.json's content, whichever check recorded it (None: no report)."""
        checks = (report or {}).get("checks")
        damaged: list[str] = []
        errors: list[Mapping[str, object]] = []
        for check in (checks.values() if isinstance(checks, Mapping) else []):
            stats = check.get("stats") if isinstance(check, Mapping) else None
            if not isinstance(stats, Mapping):
                continue
            damaged += [str(d["weight"]) for d in _records(stats.get("quantization_damage")) if d.get("weight")]
            errors += _records(stats.get("quantization_error"))
        worst = max(errors, key=lambda e: _num(e.get("error"), -math.inf), default=None)
        if worst is None:
            return cls(tuple(damaged))
        outliers = tuple(str(e["module"]) for e in errors if e.get("module") and e.get("input_outlier") is True)
        return cls(tuple(damaged), str(worst.get("module") or "") or None, str(worst.get("cause") or ""),
                   _num(worst.get("error"), 0.0), outliers)

    @property
    def folded(self) -> bool:
        """The largest error sits in a unit holding folded scales, and is large."""
        return "folded scales" in self.worst_cause and self.worst_error > 0.1


def _outlier_patterns(modules: tuple[str, ...]) -> tuple[str, ...]:
    """What to keep unquantized for the outlier modules the load check listed (its largest errors: a sample): a
    role listed in several layers (``down_proj``, where LLMs' massive activations enter) in every layer, the others
    by name; each with the linears vLLM fuses it with (q/k/v, gate/up), so that no fused group is split."""
    from collections import Counter

    roles = Counter(m.rpartition(".")[2] for m in modules)
    kept: list[str] = []
    for module in modules:
        parent, _, leaf = module.rpartition(".")
        fused = LEAF_TO_FUSED.get(leaf)
        leaves = FUSED_LEAVES[fused] if fused else (leaf,)
        names = [f"*{x}" for x in leaves] if roles[leaf] > 1 else [f"{parent}.{x}" for x in leaves]
        kept += [n for n in names if n not in kept]
    return tuple(kept)


def _records(value: object) -> list[Mapping[str, object]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def propose(plan: PlanJson, evidence: Evidence, count: int, calibration_room: int | None = None,
            offered: tuple[str, ...] = ()) -> list[Variant]:
    """The ``count`` most promising variants of ``plan`` (quant_plan.json's content), given validation's evidence;
    ``calibration_room``: the samples of the plan's length its calibration text holds (None: not counted), so
    that no variant asks for more text than there is; ``offered``: the algorithms Quark's template for the model
    offers (empty: not known)."""
    scheme = str(plan.get("global_scheme") or "")
    algos = plan_algorithms(plan)
    excluded = tuple(plan.get("exclude_layers") or [])
    damage = list(evidence.damaged)
    ranked: list[tuple[float, Variant]] = []
    scaling = sorted(a for a in algos if a in SCALING_ALGORITHMS)
    if scaling:
        rest = ",".join(sorted(algos - set(scaling)))
        why = (f"validation found rows of {', '.join(damage)} that the fold left (nearly) no codes (quantization "
               "damage)" if damage else f"{', '.join(scaling)} moves scale into the weights")
        ranked.append((0.0 if damage or evidence.folded else 2.0, Variant(
            f"{scheme}-without-{'-'.join(scaling)}", "algorithm_removed", f"{', '.join(scaling)} removed", why, scheme,
            PlanChange(algorithm=rest))))
    block = _block(damage[0] if damage else evidence.worst_module)
    if block is not None and not any(p.startswith(f"{LAYER_BLOCK}{block}.") for p in excluded):
        source = ("the rows the fold crushed are" if damage
                  else f"the load check's largest error ({evidence.worst_module}) is")
        ranked.append((1.0, Variant(f"{scheme}-keep-block-{block}", "block_kept",
                                    f"block {block} kept unquantized", f"{source} in block {block}", scheme,
                                    PlanChange(exclude_layers=(*excluded, f"{LAYER_BLOCK}{block}.*")))))
    # under a scaling algorithm the outliers are its to move: removing it is the hypothesis above
    outliers = () if scaling else tuple(p for p in _outlier_patterns(evidence.outliers) if p not in excluded)
    if outliers:
        ranked.append((0.5, Variant(f"{scheme}-keep-outlier-inputs", "outliers_kept",
                                    f"{', '.join(outliers)} kept unquantized", "the load check traced their "
                                    "error to an input channel far above its median", scheme,
                                    PlanChange(exclude_layers=(*excluded, *outliers)))))
    if evidence.outliers and not algos and "autosmoothquant" in offered and scheme.startswith("int8"):
        why = ("input outlier channels under per-tensor activations: Quark's AutoSmoothQuant searches each layer's "
               "migration strength instead of the template's fixed one")
        ranked.append((0.6, Variant(f"{scheme}-with-autosmoothquant", "algorithm_added", "autosmoothquant added", why,
                                    scheme, PlanChange(algorithm="autosmoothquant"))))
        # the two together first: smoothing where it can, the worst inputs kept where it cannot (on a real model
        # with massive activations each alone stayed hurt and the pair reached watch: docs/real_model.md)
        if outliers:
            ranked.append((0.4, Variant(
                f"{scheme}-with-autosmoothquant-keep-outlier-inputs", "algorithm_added_outliers_kept",
                f"autosmoothquant added, {', '.join(outliers)} kept unquantized", why, scheme,
                PlanChange(algorithm="autosmoothquant", exclude_layers=(*excluded, *outliers)))))
    if not algos:
        added = "gptq" if "_wo" in scheme else "smoothquant" if scheme.startswith("int8") else None
        if added:
            ranked.append((1.5, Variant(f"{scheme}-with-{added}", "algorithm_added", f"{added} added",
                                        "the plan ran no accuracy-recovering algorithm", scheme,
                                        PlanChange(algorithm=added))))
    samples = int(_num((plan.get("calibration") or {}).get("num_samples"), 0))
    more = min(MIN_CALIBRATION, CALIBRATION_FACTOR * samples, calibration_room or MIN_CALIBRATION)
    if 0 < samples < more:
        ranked.append((3.0, Variant(f"{scheme}-calib-{more}", "calibration", f"calibration {samples} -> {more} samples",
                                    f"{samples} calibration samples", scheme, PlanChange(num_calib_samples=more))))
    wider = next((w for k, w in WIDER.items() if scheme.startswith(k)), None)
    if wider:
        ranked.append((4.0, Variant(f"{wider}", "wider_format", f"{scheme} -> {wider}", "a wider format", wider)))
    return [v for _, v in sorted(ranked, key=lambda r: r[0])][:max(0, count)]


def _block(name: str | None) -> int | None:
    if not name or not name.startswith(LAYER_BLOCK):
        return None
    head = name[len(LAYER_BLOCK):].split(".")[0]
    return int(head) if head.isdigit() else None


@dataclass(frozen=True)
class Scored:
    """One export's Tier 1 beside the baseline, as a comparison row (or the run's own results) records it."""

    status: str = "not run"
    validation: str | None = None
    verdict: str | None = None
    kl_mean: float | None = None
    delta_nll: float | None = None
    delta_nll_ci95: tuple[float | None, float | None] = (None, None)
    ppl_increase_pct: float | None = None
    top1_agreement: float | None = None
    size_bytes: float | None = None
    bits_per_weight: float | None = None
    model_dir: str | None = None
    failed_step: str | None = None
    error: str | None = None
    on_target: str | None = None  # "native on <target>" / "emulated on <target>" (flows/recipe/remedies_side.on_target)

    @classmethod
    def of(cls, row: Mapping[str, object]) -> Scored:
        """The fields it holds from a comparison row (or eval_results' export row); the rest left unknown."""
        known = {f.name for f in fields(cls)}
        picked: dict[str, Any] = {k: v for k, v in row.items() if k in known and v is not None}
        ci = picked.pop("delta_nll_ci95", None)
        if isinstance(ci, list | tuple) and len(ci) == 2:
            picked["delta_nll_ci95"] = (ci[0], ci[1])
        return cls(**picked)

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "delta_nll_ci95": list(self.delta_nll_ci95)}


@dataclass(frozen=True)
class RemedyRow:
    """One variant measured and set beside the original."""

    variant: Variant
    scored: Scored
    outcome: str
    outcome_detail: str

    def as_json(self) -> dict[str, Any]:
        return {**self.scored.as_json(), **self.variant.as_json(), "outcome": self.outcome,
                "outcome_detail": self.outcome_detail}


@dataclass
class Judged:
    rows: list[RemedyRow]
    recommendation: RemedyRow | None
    cause: str | None


def judge(original: Scored, variants: list[Variant], measured: Mapping[str, Scored],
          original_verdict: str | None) -> Judged:
    """Each variant's measurement (``measured``, by label) set beside the original's."""
    rows = []
    for v in variants:
        scored = measured.get(v.label, Scored())
        rows.append(RemedyRow(v, scored, *_outcome(scored, original)))
    eligible = [r for r in rows if r.outcome == HELPED]
    eligible.sort(key=lambda r: (r.scored.verdict != "healthy", str(r.scored.on_target).startswith("emulated"),
                                 _num(r.scored.kl_mean), _num(r.scored.size_bytes)))
    return Judged(rows, eligible[0] if eligible else None, _cause(rows, original, original_verdict))


def shortfall(judged: Judged) -> str | None:
    """One sentence where no variant measured reached healthy or watch: which came closest and what it measured."""
    if any(r.outcome == HELPED and r.scored.verdict in ("healthy", "watch") for r in judged.rows):
        return None
    measured = [r for r in judged.rows if r.outcome != FAILED and r.scored.kl_mean is not None]
    if not measured:
        return (f"none of the {len(judged.rows)} variants could be measured"
                + (f" (first: {judged.rows[0].variant.label}, {judged.rows[0].outcome_detail})" if judged.rows else ""))
    close = min(measured, key=lambda r: _num(r.scored.kl_mean))
    return (f"none of the {len(judged.rows)} variants measured reached healthy or watch: the closest, "
            f"{close.variant.label} ({close.variant.changed}), measured {close.scored.verdict} at KL "
            f"{fmt(close.scored.kl_mean)}")


def _cause(rows: list[RemedyRow], original: Scored, verdict: str | None) -> str | None:
    """What the measurements name as the harm: the algorithm, where the plan without it helped beyond noise; else
    the block, where keeping it unquantized did (saying that removing the algorithm did not)."""
    if verdict == "healthy":
        return None
    by_kind = {r.variant.kind: r for r in rows}
    removed, kept = by_kind.get("algorithm_removed"), by_kind.get("block_kept")
    outliers = by_kind.get("outliers_kept")
    if (removed is None or removed.outcome != HELPED) and outliers is not None and outliers.outcome == HELPED:
        return (f"the outlier input channels carry the harm: with {outliers.variant.changed} the model is "
                f"{outliers.scored.verdict} (KL {fmt(outliers.scored.kl_mean)} against the original's "
                f"{fmt(original.kl_mean)})")
    if removed is not None and removed.outcome == HELPED:
        return (f"{removed.variant.changed.replace(' removed', '')} is the cause: the same plan without it measured "
                f"{removed.scored.verdict} (KL {fmt(removed.scored.kl_mean)} against the original's "
                f"{fmt(original.kl_mean)})")
    if kept is not None and kept.outcome == HELPED:
        cleared = "" if removed is None else (
            f"; without {removed.variant.changed.replace(' removed', '')} it is {removed.scored.verdict} "
            f"(KL {fmt(removed.scored.kl_mean)}, {removed.outcome}): not the algorithm")
        return (f"{kept.variant.changed.replace(' kept unquantized', '')} carries the harm: kept unquantized the model "
                f"is {kept.scored.verdict} (KL {fmt(kept.scored.kl_mean)} against the original's "
                f"{fmt(original.kl_mean)}){cleared}")
    return None


def _outcome(row: Scored, original: Scored) -> tuple[str, str]:
    if row.status != "evaluated" or row.validation in (None, "failed"):
        where = row.failed_step or row.status
        return FAILED, f"{where}: {row.error or 'validation ' + str(row.validation)}"
    lo, hi = _interval(row)
    olo, ohi = _interval(original)
    d, od = row.delta_nll, original.delta_nll
    said = f"ΔNLL {fmt(d)} [{fmt(lo)}, {fmt(hi)}] against the original's {fmt(od)} [{fmt(olo)}, {fmt(ohi)}]"
    if hi < olo:
        return HELPED, said
    if lo > ohi:
        return f"{WORSE} beyond noise", said
    if _num(d) > _num(od) or _num(row.kl_mean) > _num(original.kl_mean):
        return f"{WORSE} (within noise)", said
    return WITHIN, said


def _interval(row: Scored) -> tuple[float, float]:
    lo, hi = row.delta_nll_ci95
    return _num(lo), _num(hi)


def _num(x: object, default: float = math.inf) -> float:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else default


def fmt(x: object, digits: int = 4) -> str:
    """A measured number as the remedies' table and card show it ('-' where unknown)."""
    return f"{x:.{digits}g}" if isinstance(x, int | float) and math.isfinite(x) else "-"


def table_markdown(original: Scored, judged: Judged, command: str | None) -> str:
    """The remedies section of eval_report.md."""
    head = ("| variant | what changed | bits/weight | size | KL | ΔPPL % | ΔNLL [95 % CI] | top-1 | validation | "
            "served | verdict | outcome |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = [_line("original (this run)", "-", original, "-"),
             *(_line(r.variant.label, r.variant.changed, r.scored, r.outcome) for r in judged.rows)]
    text = ["## Remedies, measured", "",
            "Each variant differs from this run's plan in one thing; each was quantized, validated and scored on the "
            "same Tier 1 windows against the same baseline. Helped (or worse) beyond noise: its ΔNLL interval lies "
            "wholly below (above) the original's.", "", head + "\n".join(lines), ""]
    text += [f"- {r.variant.label}: {r.variant.why}; {r.outcome_detail}" for r in judged.rows]
    if judged.cause:
        text += ["", f"**Cause:** {judged.cause}."]
    rec = judged.recommendation
    text += ["", f"**Recommendation:** {rec.variant.label} ({rec.variant.changed}; {rec.scored.verdict}, KL "
             f"{fmt(rec.scored.kl_mean)})" + (f", reproduced by `{command}`" if command else "") + "." if rec else
             "**Recommendation:** none: no variant helped beyond noise; none is better than the original."]
    return "\n".join(text) + "\n"


def _line(label: str, changed: str, r: Scored, outcome: str) -> str:
    size = _num(r.size_bytes)
    cells = [label, changed, fmt(r.bits_per_weight, 3), f"{size / 2**20:.2f} MiB" if math.isfinite(size) else "-",
             fmt(r.kl_mean), fmt(r.ppl_increase_pct, 3),
             f"{fmt(r.delta_nll)} [{', '.join(fmt(x) for x in r.delta_nll_ci95)}]",
             fmt(r.top1_agreement, 3), str(r.validation or "-"), r.on_target or "-", str(r.verdict or "-"), outcome]
    return "| " + " | ".join(cells) + " |"
