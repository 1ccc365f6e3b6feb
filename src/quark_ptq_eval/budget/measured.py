"""search_report's measured part: each side-by-side plan's export bits and Tier 1 KL beside its prediction, the
additivity check and the recommendation (the measured best within the constraint). Written after `run`'s side by
side (flows/recipe/budget_side.py) and after `compare --budget-bits` (flows/compare/budget.py)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quark_ptq_eval.budget.knapsack import SidePlan

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


@dataclass(frozen=True)
class CellRow:
    """A compared cell as comparison.json has it, the part the side by side reads (a cell not there: not run)."""

    model_dir: str | None = None
    kl_mean: float | None = None
    ppl_increase_pct: float | None = None
    validation: str | None = None
    status: str = "not run"

    @classmethod
    def of(cls, row: dict[str, Any]) -> CellRow:
        return cls(row.get("model_dir"), row.get("kl_mean"), row.get("ppl_increase_pct"), row.get("validation"),
                   str(row.get("status", "not run")))


@dataclass(frozen=True)
class Recommendation:
    """The measured best within the constraint, as search_report.json states it."""

    label: str
    kind: str
    bits: float | None
    kl: float | None
    reason: str


@dataclass(frozen=True)
class MeasuredReport:
    """The side-by-side plans as measured, and the recommendation among them (None: none validated within)."""

    measured: list[Measured]
    recommendation: Recommendation | None


def read_side_plans(workdir: Path) -> list[SidePlan]:
    """The side-by-side plans the search report in ``workdir`` names."""
    return _side_plans_of(_read(workdir))


def record_measured(workdir: Path, cells: dict[str, CellRow], model: Path, excluded: list[str]) -> MeasuredReport:
    """search_report.{json,md} in ``workdir`` with each side-by-side plan as its compared cell (by label) measured."""
    data = _read(workdir)
    measured = [_measured_row(s, cells.get(s.label, CellRow()), model, excluded) for s in _side_plans_of(data)]
    return MeasuredReport(measured, _write_measured(workdir, data, measured))


def _read(workdir: Path) -> dict[str, Any]:
    return dict(json.loads((workdir / SEARCH_JSON).read_text(encoding="utf-8")))


def _side_plans_of(data: dict[str, Any]) -> list[SidePlan]:
    return [SidePlan(**s) for s in data.get("side_by_side") or []]


def _measured_row(side: SidePlan, row: CellRow, model: Path, excluded: list[str]) -> Measured:
    """A side-by-side plan as its comparison cell has it, its export's bits read from the headers."""
    out = Path(row.model_dir) if row.model_dir else None
    bits = export_bits(model, out, excluded) if out is not None and out.is_dir() else None
    return Measured(side.label, side.kind, side.bits, bits, side.predicted_kl, row.kl_mean, row.ppl_increase_pct,
                    row.validation, row.status)


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


def _write_measured(workdir: Path, data: dict[str, Any], measured: list[Measured]) -> Recommendation | None:
    """search_report.{json,md} with the measurements, the additivity check and the recommendation."""
    budget, floor = float(data["chosen"]["budget_bits"]), data["chosen"].get("max_kl")
    best = recommended(measured, budget, floor)
    ratios = [m.ratio for m in measured if m.ratio is not None]
    data["measured"] = [{**m.__dict__, "predicted_over_measured": m.ratio} for m in measured]
    data["additivity_measured"] = {"min_ratio": min(ratios, default=None), "max_ratio": max(ratios, default=None),
                                   "statement": "a plan's KL is predicted as the sum of its groups' KLs, each group "
                                                "quantized alone (the scans); the ratio is that sum over the plan's "
                                                "Tier 1 KL measured on its export"}
    chosen = None if best is None else Recommendation(
        best.label, best.kind, best.bits, best.kl,
        f"the fewest effective bits among the validated exports whose measured Tier 1 KL is within {floor:.4g}"
        if floor is not None else f"the least measured Tier 1 KL among the validated exports within {budget:.3f} "
                                  "effective bits")
    data["recommendation"] = None if chosen is None else dataclasses.asdict(chosen)
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
                                    f"{chosen.reason}." if best and chosen else
                                    "none: no validated export within the budget was measured.")]
    md.write_text(md.read_text(encoding="utf-8") + "\n".join(lines) + "\n", encoding="utf-8")
    return chosen


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
