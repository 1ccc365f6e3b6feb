"""search_report's measured part: each side-by-side plan's export bits and Tier 1 KL beside its prediction, the
additivity check and the recommendation (the measured best within the constraint). Written after `run`'s side by
side (flows/budget_side.py) and after `compare --budget-bits` (flows/compare/budget.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quark_ptq_eval.plan.budget import SidePlan

SEARCH_JSON = "search_report.json"


@dataclass(frozen=True)
class Measured:
    """One side-by-side plan as measured: its export's effective bits, Tier 1 KL against the cached baseline."""

    label: str
    kind: str
    predicted_bits: float
    bits: float | None
    predicted_kl: float
    kl: float | None
    ppl_increase_pct: float | None
    validation: str | None
    status: str

    @property
    def ratio(self) -> float | None:
        """Predicted over measured KL: 1 where the groups' KLs add up exactly."""
        return self.predicted_kl / self.kl if self.kl else None


def side_plans_of(data: dict[str, Any]) -> list[SidePlan]:
    """The side-by-side plans search_report.json names."""
    return [SidePlan(**s) for s in data.get("side_by_side") or []]


def measured_row(side: SidePlan, row: dict[str, Any], model: Path, excluded: list[str]) -> Measured:
    """A side-by-side plan as its comparison row has it (comparison.json), its export's bits read from the headers."""
    out = Path(row["model_dir"]) if row.get("model_dir") else None
    bits = export_bits(model, out, excluded) if out is not None and out.is_dir() else None
    return Measured(side.label, side.kind, side.bits, bits, side.predicted_kl, row.get("kl_mean"),
                    row.get("ppl_increase_pct"), row.get("validation"), str(row.get("status", "not run")))


def export_bits(model: Path, out: Path, excluded: list[str]) -> float:
    """8 x bytes of the quantized linears' tensors in an export (weights, scales, zero points, input scales)
    / their weights: the effective bits as the budget counts them, read from the export's headers."""
    from quark_ptq_eval.base.safetensors_io import read_model_headers
    from quark_ptq_eval.plan.scheme_fit import linear_shapes

    shapes = linear_shapes(str(model), excluded)
    written = sum(i.nbytes for t, i in read_model_headers(str(out)).items() if t.rpartition(".")[0] in shapes)
    return round(8 * written / (sum(r * c for r, c in shapes.values()) or 1), 4)


def recommended(measured: list[Measured], budget_bits: float, max_kl: float | None = None) -> Measured | None:
    """The measured best within the constraint among the validated exports: under a bits budget the least Tier 1
    KL within it; under an accuracy floor the fewest bits whose measured KL is within the floor."""
    done = [m for m in measured if m.kl is not None and m.bits is not None and m.validation == "success"]
    if max_kl is not None:
        return min((m for m in done if (m.kl or 0.0) <= max_kl), key=lambda m: (m.bits or 0.0, m.kl or 0.0), default=None)
    return min((m for m in done if (m.bits or 0.0) <= budget_bits + 1e-9), key=lambda m: m.kl or 0.0, default=None)


def write_measured(workdir: Path, data: dict[str, Any], measured: list[Measured]) -> None:
    """search_report.{json,md} with the measurements, the additivity check and the recommendation."""
    budget, floor = float(data["chosen"]["budget_bits"]), data["chosen"].get("max_kl")
    best = recommended(measured, budget, floor)
    ratios = [m.ratio for m in measured if m.ratio is not None]
    data["measured"] = [{**m.__dict__, "predicted_over_measured": m.ratio} for m in measured]
    data["additivity_measured"] = {"min_ratio": min(ratios, default=None), "max_ratio": max(ratios, default=None),
                                   "statement": "a plan's KL is predicted as the sum of its groups' KLs, each group "
                                                "quantized alone (the scans); the ratio is that sum over the plan's "
                                                "Tier 1 KL measured on its export"}
    data["recommendation"] = None if best is None else {
        "label": best.label, "kind": best.kind, "bits": best.bits, "kl": best.kl,
        "reason": f"the fewest effective bits among the validated exports whose measured Tier 1 KL is within {floor:.4g}"
        if floor is not None else f"the least measured Tier 1 KL among the validated exports within {budget:.3f} "
                                  "effective bits"}
    (workdir / SEARCH_JSON).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    md = workdir / "search_report.md"
    lines = ["", "## Measured side by side (same windows, one cached baseline)", "",
             "| plan | kind | predicted bits | export bits | predicted KL | measured KL | predicted / measured "
             "| validation |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {m.label} | {m.kind} | {m.predicted_bits:.3f} | {_f(m.bits, '.3f')} | {m.predicted_kl:.4g} | "
              f"{_f(m.kl, '.4g')} | {_f(m.ratio, '.3f')} | {m.validation or m.status} |" for m in measured]
    lines += ["", f"Additivity: {data['additivity_measured']['statement']}; ratio "
                  f"{_f(min(ratios, default=None), '.3f')} to {_f(max(ratios, default=None), '.3f')} here.", "",
              "Recommendation: " + (f"**{best.label}** ({best.kind}), measured KL {best.kl:.4g} at {best.bits} bits: "
                                    f"{data['recommendation']['reason']}." if best else
                                    "none: no validated export within the budget was measured.")]
    md.write_text(md.read_text(encoding="utf-8") + "\n".join(lines) + "\n", encoding="utf-8")


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
