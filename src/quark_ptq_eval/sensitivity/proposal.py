"""The smallest set of layers to keep unquantized so that the model's KL meets a budget.

The scan's rows are units (units.py): a layer, or an MoE layer's experts. Each carries the pattern
naming its modules; the proposal keeps patterns (exact names for single layers, e.g.
``model.layers.1.mlp.experts.*`` for a layer's routed experts), which Quark's config and the
plan-conformance check read alike.

Layers are chosen in deployment units: vLLM fuses q/k/v into one qkv_proj and gate/up into one
gate_up_proj, which must share one scheme, so those are kept or quantized together. Greedy by
measured KL (largest first, then the cheaper unit); the prediction for a set is the additive
model scaled to the measured whole-model KL, and the chosen set is then re-measured as a
combination (one model pass each), adding units until the measured KL meets the budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from quark_ptq_eval.plan.groups import LEAF_TO_FUSED

FUSED = LEAF_TO_FUSED  # the plan's deployment groups (plan/groups.py): one source for what vLLM fuses
MAX_RECHECKS = 6  # combinations re-measured before the proposal gives up on the budget


def default_max_kl() -> float:
    """The KL at which the evaluation verdict stops being healthy: 100 * expm1(KL) = healthy %."""
    from quark_ptq_eval.evaluate.options import Thresholds

    return math.log1p(Thresholds().healthy_pct / 100.0)


@dataclass
class Proposal:
    max_kl: float
    exclude: list[str]  # patterns to keep unquantized (exact module names for single layers)
    units: list[str]
    whole_model_kl: float  # measured, every scanned layer quantized
    predicted_kl: float
    measured_kl: float | None  # the combination re-measured; None when nothing was excluded
    met: bool
    params_kept: int
    extra_bytes: int  # what keeping them at the source precision costs over the scheme
    extra_pct: float  # of the quantized layers' size under the scheme
    rechecks: list[dict[str, Any]] = field(default_factory=list)
    wider: dict[str, Any] | None = None  # the same layers at a wider scheme, measured (wider.py); "chosen" when used

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"layer_quant_config": self.layer_quant_config, "kept_unquantized": self.kept_unquantized}

    @property
    def layer_quant_config(self) -> dict[str, str]:
        """Layers the proposal keeps at the wider scheme (exact module names), when that was chosen."""
        return {n: self.wider["scheme"] for n in self.exclude} if self.wider and self.wider["chosen"] else {}

    @property
    def kept_unquantized(self) -> list[str]:
        return [] if self.layer_quant_config else list(self.exclude)

    @property
    def reason(self) -> str:
        if not self.exclude:
            return (f"sensitivity scan: the whole model quantized measures KL {self.whole_model_kl:.4g}, "
                    f"within the budget {self.max_kl:.4g}: no exclusion needed")
        state = "meets" if self.met else "does NOT meet"
        if self.layer_quant_config and self.wider is not None:
            w = self.wider
            return (f"sensitivity scan: keeping {len(self.exclude)} layer(s) at {w['scheme']} brings the measured KL "
                    f"from {self.whole_model_kl:.4g} to {w['measured_kl']:.4g} (budget {self.max_kl:.4g}) for "
                    f"{w['extra_bytes'] / 2**20:.2f} MiB more (+{w['extra_pct']:.1f} %); unquantized they would "
                    f"measure {self.measured_kl:.4g} for {self.extra_bytes / 2**20:.2f} MiB")
        return (f"sensitivity scan: keeping {len(self.exclude)} layer(s) unquantized brings the measured KL from "
                f"{self.whole_model_kl:.4g} to {self.measured_kl:.4g} ({state} the budget {self.max_kl:.4g}) "
                f"for {self.extra_bytes / 2**20:.2f} MiB more (+{self.extra_pct:.1f} %)" + self._wider_note())

    def _wider_note(self) -> str:
        if not self.wider:
            return ""
        if self.wider.get("refused"):  # the target does not serve it there (flows/recipe/plan_scan.py served_on_target)
            return (f"; at {self.wider['scheme']} they would measure {self.wider['measured_kl']:.4g}, but "
                    f"{self.wider['refused']}")
        return (f"; at {self.wider['scheme']} they would measure {self.wider['measured_kl']:.4g} "
                f"(+{self.wider['extra_bytes'] / 2**20:.2f} MiB): not enough")


def fusion_units(names: list[str]) -> dict[str, list[str]]:
    units: dict[str, list[str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        unit = f"{parent}.{FUSED[leaf]}" if leaf in FUSED else name
        units.setdefault(unit, []).append(name)
    return units


def propose(result: dict[str, Any], max_kl: float, measure: Callable[[set[str]], float] | None) -> Proposal:
    """Greedy on the scan, then re-measured with ``measure(excluded patterns) -> KL`` when one is given."""
    rows = {r["layer"]: r for r in result["layers"]}
    whole = float(result["whole_model_kl"])
    units = fusion_units(list(rows))
    unit_kl = {u: sum(rows[n]["kl"] for n in members) for u, members in units.items()}
    unit_params = {u: sum(rows[n]["params"] for n in members) for u, members in units.items()}
    order = sorted(units, key=lambda u: (-unit_kl[u], unit_params[u]))
    total = sum(unit_kl.values()) or 1.0
    chosen: list[str] = []
    predicted = whole
    for unit in order:
        if predicted <= max_kl:
            break
        chosen.append(unit)
        predicted = whole * (total - sum(unit_kl[u] for u in chosen)) / total

    def patterns_of(unit_names: list[str]) -> list[str]:
        return _patterns(rows, [n for u in unit_names for n in units[u]])

    measured, rechecks = _recheck(chosen, order, patterns_of, max_kl, measure, result.get("combinations", {}))
    if rechecks:
        chosen = rechecks[-1]["units"]
    kept_rows = [n for u in chosen for n in units[u]]
    return _proposal(result, max_kl, kept_rows, chosen, KlEstimates(whole, predicted, measured), rechecks)


def _patterns(rows: dict[str, Any], names: list[str]) -> list[str]:
    return sorted(rows[n].get("pattern", n) for n in names)


def _recheck(chosen: list[str], order: list[str], patterns_of: Callable[[list[str]], list[str]], max_kl: float,
             measure: Callable[[set[str]], float] | None,
             known: dict[str, Any]) -> tuple[float | None, list[dict[str, Any]]]:
    if not chosen:
        return None, []
    rechecks: list[dict[str, Any]] = []
    chosen = list(chosen)
    while True:
        names = patterns_of(chosen)
        key = "|".join(names)
        kl = known.get(key) if key in known else (measure(set(names)) if measure else None)
        if kl is None:
            return None, rechecks
        known[key] = kl
        rechecks.append({"units": list(chosen), "measured_kl": kl})
        left = [u for u in order if u not in chosen]
        if kl <= max_kl or not left or len(rechecks) >= MAX_RECHECKS:
            return kl, rechecks
        chosen.append(left[0])


@dataclass(frozen=True)
class KlEstimates:
    """The whole-model KL, the KL predicted with the chosen units kept, and as measured (None: not re-measured)."""

    whole: float
    predicted: float
    measured: float | None


def _proposal(result: dict[str, Any], max_kl: float, kept_rows: list[str], chosen: list[str], kl: KlEstimates,
              rechecks: list[dict[str, Any]]) -> Proposal:
    whole, predicted, measured = kl.whole, kl.predicted, kl.measured
    rows = {r["layer"]: r for r in result["layers"]}
    kept = sum(rows[n]["params"] for n in kept_rows)
    exclude = _patterns(rows, kept_rows)
    all_params = sum(r["params"] for r in rows.values()) or 1
    src_bits, q_bits = result.get("source_bits", 16.0), result.get("scheme_bits", 4.0)
    extra = int(kept * (src_bits - q_bits) / 8)
    quantized_bytes = all_params * q_bits / 8
    met = (measured if measured is not None else predicted if exclude else whole) <= max_kl
    return Proposal(max_kl, exclude, chosen, whole, predicted, measured, met, kept, extra,
                    100.0 * extra / quantized_bytes, rechecks)
