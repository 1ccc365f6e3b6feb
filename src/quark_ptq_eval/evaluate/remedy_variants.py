"""Remedies as plan variants, measured: which to try for a hurt model, and what their measurements say.

``remedies.py`` lists advice; each item is a hypothesis (int8 + SmoothQuant can be the harm itself: smoothing moves
scale into the weights and a per-tensor weight scale rounds rows to nothing). Here the top N become plans that
differ from the run's in one thing, ranked by what this run measured:

- the plan's scaling algorithm removed, first where validation found rows a fold crushed (the decode check's
  ``quantization_damage``) or a unit holding folded scales far from the source (the load check);
- the block the evidence names (the damage, else the load check's worst module) kept unquantized;
- no algorithm in the plan: the one its scheme calls for added (SmoothQuant for W8A8, GPTQ weight-only);
- more calibration data; a wider format.

Nothing the plan already does is proposed. ``judge`` then sets each measured variant beside the original on the
same windows against the same baseline: ΔNLL (the per-token NLL increase over the baseline, with its paired 95 %
interval) beyond the original's interval either way is helped or worse beyond noise; a variant measured worse than
the original, or not validated, is never recommended.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from quark_ptq_eval.evaluate.remedies import MIN_CALIBRATION, plan_algorithms
from quark_ptq_eval.validate.rewrites import ALIASES, SCALING

LAYER_BLOCK = "model.layers."
CALIBRATION_FACTOR = 4
HELPED, WITHIN, WORSE, FAILED = "helped beyond noise", "within noise", "rejected: worse", "rejected: not usable"
WIDER = {"int8": "fp8"}  # a wider format a W8A8 scheme falls back to


@dataclass(frozen=True)
class Variant:
    """One remedy as a plan: the run's plan with ``request`` over its options."""

    label: str  # the comparison cell's name
    kind: str  # algorithm_removed, algorithm_added, block_kept, calibration, wider_format
    changed: str  # what differs from the run's plan, in words
    why: str  # the evidence that proposed it
    scheme: str
    request: dict[str, Any] = field(default_factory=dict)  # plan options over the run's (PlanRequest fields)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def propose(plan: dict[str, Any], validation: dict[str, Any] | None, count: int) -> list[Variant]:
    """The ``count`` most promising variants of ``plan`` (quant_plan.json's content), given validation_report.json's
    content (None: no evidence but the plan)."""
    scheme = str(plan.get("global_scheme") or "")
    algos = plan_algorithms(plan)
    excluded = list(plan.get("exclude_layers") or [])
    damage, worst = _evidence(validation)
    ranked: list[tuple[float, Variant]] = []
    scaling = sorted(a for a in algos if ALIASES.get(a, a) in SCALING)
    if scaling:
        rest = ",".join(sorted(algos - set(scaling)))
        why = (f"validation found rows of {', '.join(damage)} that the fold left (nearly) no codes (quantization "
               "damage)" if damage else f"{', '.join(scaling)} moves scale into the weights")
        ranked.append((0.0 if damage or _folded(worst) else 2.0, Variant(
            f"{scheme}-without-{'-'.join(scaling)}", "algorithm_removed", f"{', '.join(scaling)} removed", why, scheme,
            {"algorithm": rest})))
    block = _block(damage[0] if damage else (worst or {}).get("module"))
    if block is not None and not any(p.startswith(f"{LAYER_BLOCK}{block}.") for p in excluded):
        source = ("the rows the fold crushed are" if damage
                  else f"the load check's largest error ({(worst or {}).get('module')}) is")
        ranked.append((1.0, Variant(f"{scheme}-keep-block-{block}", "block_kept",
                                    f"block {block} kept unquantized", f"{source} in block {block}", scheme,
                                    {"exclude_layers": [*excluded, f"{LAYER_BLOCK}{block}.*"]})))
    if not algos:
        added = "gptq" if "_wo" in scheme else "smoothquant" if scheme.startswith("int8") else None
        if added:
            ranked.append((1.5, Variant(f"{scheme}-with-{added}", "algorithm_added", f"{added} added",
                                        "the plan ran no accuracy-recovering algorithm", scheme, {"algorithm": added})))
    samples = int((plan.get("calibration") or {}).get("num_samples") or 0)
    if 0 < samples < MIN_CALIBRATION:
        more = min(MIN_CALIBRATION, CALIBRATION_FACTOR * samples)
        ranked.append((3.0, Variant(f"{scheme}-calib-{more}", "calibration", f"calibration {samples} -> {more} samples",
                                    f"{samples} calibration samples", scheme, {"num_calib_samples": more})))
    wider = next((w for k, w in WIDER.items() if scheme.startswith(k)), None)
    if wider:
        ranked.append((4.0, Variant(f"{wider}", "wider_format", f"{scheme} -> {wider}", "a wider format", wider, {})))
    return [v for _, v in sorted(ranked, key=lambda r: r[0])][:max(0, count)]


def _evidence(validation: dict[str, Any] | None) -> tuple[list[str], dict[str, Any] | None]:
    """(weights with rows a fold crushed, the load check's worst module) from validation_report.json."""
    checks = (validation or {}).get("checks") or {}
    damage = [d["weight"] for d in ((checks.get("decode") or {}).get("stats") or {}).get("quantization_damage") or []
              if isinstance(d, dict) and d.get("weight")]
    errors = ((checks.get("load") or {}).get("stats") or {}).get("quantization_error") or []
    return damage, errors[0] if errors and isinstance(errors[0], dict) else None


def _folded(worst: dict[str, Any] | None) -> bool:
    return worst is not None and "folded scales" in str(worst.get("cause")) and (worst.get("error") or 0) > 0.1


def _block(name: str | None) -> int | None:
    if not name or not name.startswith(LAYER_BLOCK):
        return None
    head = name[len(LAYER_BLOCK):].split(".")[0]
    return int(head) if head.isdigit() else None


@dataclass
class Judged:
    rows: list[dict[str, Any]]  # one per variant: its measurements, outcome and what changed
    recommendation: dict[str, Any] | None
    cause: str | None


def judge(original: dict[str, Any], variants: list[Variant], measured: dict[str, dict[str, Any]],
          original_verdict: str | None) -> Judged:
    """Each variant's comparison row (``measured``, by label) set beside the original's."""
    rows = []
    for v in variants:
        row = {**measured.get(v.label, {"status": "not run"}), **v.as_json()}
        row["outcome"], row["outcome_detail"] = _outcome(row, original)
        rows.append(row)
    eligible = [r for r in rows if r["outcome"] == HELPED]
    eligible.sort(key=lambda r: (r.get("verdict") != "healthy", _num(r.get("kl_mean")), _num(r.get("size_bytes"))))
    best = eligible[0] if eligible else None
    return Judged(rows, None if best is None else {"label": best["label"], "changed": best["changed"],
                                                   "verdict": best.get("verdict"), "kl_mean": best.get("kl_mean"),
                                                   "model_dir": best.get("model_dir")},
                  _cause(rows, original, original_verdict))


def _cause(rows: list[dict[str, Any]], original: dict[str, Any], verdict: str | None) -> str | None:
    """What the measurements name as the harm: the algorithm, where the plan without it helped beyond noise; else
    the block, where keeping it unquantized did (saying that removing the algorithm did not)."""
    if verdict == "healthy":
        return None
    by_kind = {r["kind"]: r for r in rows}
    removed, kept = by_kind.get("algorithm_removed"), by_kind.get("block_kept")
    if removed is not None and removed["outcome"] == HELPED:
        return (f"{removed['changed'].replace(' removed', '')} is the cause: the same plan without it is "
                f"{removed.get('verdict')} (KL {_fmt(removed.get('kl_mean'))} against the original's "
                f"{_fmt(original.get('kl_mean'))})")
    if kept is not None and kept["outcome"] == HELPED:
        cleared = "" if removed is None else (
            f"; without {removed['changed'].replace(' removed', '')} it is {removed.get('verdict')} "
            f"(KL {_fmt(removed.get('kl_mean'))}, {removed['outcome']}): not the algorithm")
        return (f"{kept['changed'].replace(' kept unquantized', '')} carries the harm: kept unquantized the model is "
                f"{kept.get('verdict')} (KL {_fmt(kept.get('kl_mean'))} against the original's "
                f"{_fmt(original.get('kl_mean'))}){cleared}")
    return None


def _outcome(row: dict[str, Any], original: dict[str, Any]) -> tuple[str, str]:
    if row.get("status") != "evaluated" or row.get("validation") in (None, "failed"):
        where = row.get("failed_step") or row.get("status")
        return FAILED, f"{where}: {row.get('error') or 'validation ' + str(row.get('validation'))}"
    lo, hi = _interval(row)
    olo, ohi = _interval(original)
    d, od = row.get("delta_nll"), original.get("delta_nll")
    said = f"ΔNLL {_fmt(d)} [{_fmt(lo)}, {_fmt(hi)}] against the original's {_fmt(od)} [{_fmt(olo)}, {_fmt(ohi)}]"
    if hi < olo:
        return HELPED, said
    if lo > ohi:
        return f"{WORSE} beyond noise", said
    if _num(d) > _num(od) or _num(row.get("kl_mean")) > _num(original.get("kl_mean")):
        return f"{WORSE} (within noise)", said
    return WITHIN, said


def _interval(row: dict[str, Any]) -> tuple[float, float]:
    ci = row.get("delta_nll_ci95") or [None, None]
    lo, hi = ci[0], ci[1]
    return (lo if _finite(lo) else math.inf), (hi if _finite(hi) else math.inf)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def _num(x: Any) -> float:
    return float(x) if _finite(x) else math.inf


def _fmt(x: Any, digits: int = 4) -> str:
    return f"{x:.{digits}g}" if _finite(x) else "-"


def table_markdown(original: dict[str, Any], judged: Judged, command: str | None) -> str:
    """The remedies section of eval_report.md."""
    head = ("| variant | what changed | bits/weight | size | KL | ΔPPL % | ΔNLL [95 % CI] | top-1 | validation | "
            "verdict | outcome |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = [_line("original (this run)", "-", original, "-"), *(_line(r["label"], r["changed"], r, r["outcome"])
                                                                   for r in judged.rows)]
    text = ["## Remedies, measured", "",
            "Each variant differs from this run's plan in one thing; each was quantized, validated and scored on the "
            "same Tier 1 windows against the same baseline. Helped (or worse) beyond noise: its ΔNLL interval lies "
            "wholly below (above) the original's.", "", head + "\n".join(lines), ""]
    text += [f"- {r['label']}: {r['why']}; {r['outcome_detail']}" for r in judged.rows]
    if judged.cause:
        text += ["", f"**Cause:** {judged.cause}."]
    rec = judged.recommendation
    text += ["", f"**Recommendation:** {rec['label']} ({rec['changed']}; {rec['verdict']}, KL {_fmt(rec['kl_mean'])})"
             + (f", reproduced by `{command}`" if command else "") + "." if rec else
             "**Recommendation:** none: no variant helped beyond noise; none is better than the original."]
    return "\n".join(text) + "\n"


def _line(label: str, changed: str, r: dict[str, Any], outcome: str) -> str:
    size = _num(r.get("size_bytes"))
    cells = [label, changed, _fmt(r.get("bits_per_weight"), 3), f"{size / 2**20:.2f} MiB" if math.isfinite(size) else "-",
             _fmt(r.get("kl_mean")), _fmt(r.get("ppl_increase_pct"), 3),
             f"{_fmt(r.get('delta_nll'))} [{', '.join(_fmt(x) for x in r.get('delta_nll_ci95') or [None, None])}]",
             _fmt(r.get("top1_agreement"), 3), str(r.get("validation") or "-"), str(r.get("verdict") or "-"), outcome]
    return "| " + " | ".join(cells) + " |"
