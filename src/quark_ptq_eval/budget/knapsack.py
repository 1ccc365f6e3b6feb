"""The best per-group mix of formats under a bits budget: an exact integer program, not a heuristic.

Each deployment group (plan/groups.py; a linear that vLLM does not fuse is a group of its own) takes
exactly one of the formats. Its cost is the bytes its weights take in that format, scales and zero
points included (``linear_bytes``, from Quark's own scheme table); its predicted harm is the KL the
sensitivity scan measured for its members quantized alone in that format, summed. The search
minimises the sum of the groups' KLs subject to

    effective bits = 8 x (bytes of every quantizable linear's weights) / (their weights) <= budget

(AutoRound's ``avg_bits`` and ModelOpt's ``effective_bits`` count the same way). Additivity is an
assumption: the KL of a mix is predicted as the sum of its parts, which the scan's whole-model
measurement and Tier 1 check afterwards.

The program is a multiple-choice knapsack, solved exactly by HiGHS through ``scipy.optimize.milp``
(in process, no solver binary): binaries x[g, f], one format per group, one budget row.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from quark_ptq_eval.base.schemes import as_spec_list, dtype_bits

SCALE_BYTES = 2  # Quark writes a float scale in the model's float width (BF16/F16; F32 for an F32 model) ...
MX_SCALE_BYTES = 1  # ... an MX block's scale as one E8M0 byte


def linear_bytes(spec: dict[str, Any] | None, rows: int, cols: int, scale_bytes: int = SCALE_BYTES) -> float:
    """Bytes of one ``rows x cols`` linear's weight under a scheme's weight spec, with its scales and
    zero points (a per-group zero point packed like its weight; per channel or tensor, one int32 each)."""
    spec = (as_spec_list(spec) or [{}])[0]
    bits = dtype_bits(spec.get("dtype")) or 16
    weights = rows * cols * bits / 8
    qscheme, group = spec.get("qscheme"), spec.get("group_size")
    if qscheme == "per_group" and isinstance(group, int) and group > 0:
        n = rows * math.ceil(cols / group)
    elif qscheme == "per_channel":
        n = rows
    elif qscheme == "per_tensor":
        n = 1
    else:
        return rows * cols * 2.0  # not quantized: BF16
    mx = spec.get("scale_format") == "e8m0"
    scale = MX_SCALE_BYTES if mx else scale_bytes
    zero = 0.0 if mx else (bits / 8 if qscheme == "per_group" and bits < 8 else 4.0)
    return weights + n * (scale + zero)


@dataclass(frozen=True)
class GroupCost:
    """One deployment group: its weights, and per format its bytes and predicted KL."""

    name: str
    params: int
    bytes: dict[str, float]
    kl: dict[str, float]
    # the formats this group may take (empty: any searched): an MoE layer's experts only in what the target's
    # fused-MoE kernels load (plan/targets.py expert_refusal)
    only: tuple[str, ...] = ()

    def allows(self, fmt: str) -> bool:
        return not self.only or fmt in self.only


@dataclass
class Mix:
    """A solved mix: the format of each group, its predicted KL and its effective bits."""

    choice: dict[str, str]
    predicted_kl: float
    bits: float
    budget_bits: float
    status: str = "optimal"
    lp_bound: float | None = None  # the LP relaxation's objective: no mix under the budget predicts less
    counts: dict[str, int] = field(default_factory=dict)  # groups per format
    max_kl: float | None = None  # an accuracy floor's: the fewest bits whose predicted KL stays within it

    def as_dict(self) -> dict[str, Any]:
        return {"budget_bits": self.budget_bits, "bits": round(self.bits, 4), "predicted_kl": self.predicted_kl,
                "status": self.status, "lp_bound": self.lp_bound, "groups_per_format": self.counts,
                "max_kl": self.max_kl}


def effective_bits(groups: list[GroupCost], choice: dict[str, str]) -> float:
    total = sum(g.params for g in groups) or 1
    return 8 * sum(g.bytes[choice[g.name]] for g in groups) / total


def solve(groups: list[GroupCost], formats: list[str], budget_bits: float, relax: bool = False) -> Mix:
    """The mix with the least summed KL whose effective bits are within ``budget_bits`` (exact MILP, no
    optimality gap); ``relax``: the LP relaxation instead (a lower bound, fractions rounded to the largest)."""
    import numpy as np

    total = float(sum(g.params for g in groups)) or 1.0
    cost = np.array([g.kl[f] for g in groups for f in formats], dtype=float)
    allowed = _allowed(groups, formats)
    # the budget row in half bytes, integers (int4 weights are half a byte): a mix is within it exactly or not
    units = np.array([round(2 * g.bytes[f]) for g in groups for f in formats], dtype=float)
    rhs = float(math.floor(2 * budget_bits * total / 8 + 1e-6))
    for _ in range(8):  # HiGHS may round a binary within its tolerance past the row: tighten by the excess, again
        x, fun = _milp(cost, units, len(groups), len(formats), rhs, relax, allowed)
        if x is None:
            return Mix({}, math.inf, math.inf, budget_bits, status="infeasible")
        picked = x.argmax(axis=1)
        choice = {g.name: formats[int(picked[i])] for i, g in enumerate(groups)}
        over = float(units.reshape(len(groups), -1)[np.arange(len(groups)), picked].sum()) - rhs
        if relax or over <= 0:
            break
        rhs -= over
    used = effective_bits(groups, choice)
    kl = fun if relax else float(sum(g.kl[choice[g.name]] for g in groups))
    counts = {f: sum(1 for c in choice.values() if c == f) for f in formats}
    return Mix(choice, kl, used, budget_bits, "relaxed" if relax else "optimal", counts=counts)


def _allowed(groups: list[GroupCost], formats: list[str]) -> Any:
    """Each x[group, format]'s upper bound: 0 where the group may not take the format."""
    import numpy as np

    return np.array([1.0 if g.allows(f) else 0.0 for g in groups for f in formats])


def _milp(cost: Any, units: Any, n_groups: int, n_formats: int, rhs: float, relax: bool,
          allowed: Any) -> tuple[Any, float]:
    """x[group, format] of the optimum (None: infeasible) and its objective."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    one_each = np.zeros((n_groups, len(cost)))
    for i in range(n_groups):
        one_each[i, i * n_formats:(i + 1) * n_formats] = 1.0
    res = milp(cost, constraints=[LinearConstraint(one_each, 1.0, 1.0), LinearConstraint(units[None, :], -np.inf, rhs)],
               integrality=np.zeros_like(cost) if relax else np.ones_like(cost), bounds=Bounds(0, allowed),
               options={"mip_rel_gap": 0.0})
    if res.x is None:
        return None, math.inf
    return res.x.reshape(n_groups, n_formats), float(res.fun)


def solve_floor(groups: list[GroupCost], formats: list[str], max_kl: float) -> Mix:
    """The mix with the fewest bytes whose predicted KL (the sum of its groups') is within ``max_kl``: the same
    exact program with objective and row swapped. Its ``budget_bits`` is its own bits (the bits it needs)."""
    import numpy as np

    kl = np.array([g.kl[f] for g in groups for f in formats], dtype=float)
    units = np.array([round(2 * g.bytes[f]) for g in groups for f in formats], dtype=float)
    x, _ = _milp(units, kl, len(groups), len(formats), max_kl, False, _allowed(groups, formats))
    if x is None:
        return Mix({}, math.inf, math.inf, math.inf, status="infeasible", max_kl=max_kl)
    picked = x.argmax(axis=1)
    choice = {g.name: formats[int(picked[i])] for i, g in enumerate(groups)}
    bits = effective_bits(groups, choice)
    counts = {f: sum(1 for c in choice.values() if c == f) for f in formats}
    return Mix(choice, predicted_kl(groups, choice), bits, bits, counts=counts, max_kl=max_kl)


def solve_with_bound(groups: list[GroupCost], formats: list[str], budget_bits: float) -> Mix:
    """The exact mix, with its LP relaxation's objective as the certificate that no mix does better."""
    mix = solve(groups, formats, budget_bits)
    if mix.status == "optimal":
        mix.lp_bound = solve(groups, formats, budget_bits, relax=True).predicted_kl
    return mix


def bits_range(groups: list[GroupCost], formats: list[str]) -> tuple[float, float]:
    """The effective bits of the narrowest and of the widest mix."""
    lo = {g.name: min(filter(g.allows, formats), key=g.bytes.__getitem__) for g in groups}
    hi = {g.name: max(filter(g.allows, formats), key=g.bytes.__getitem__) for g in groups}
    return effective_bits(groups, lo), effective_bits(groups, hi)


def front(groups: list[GroupCost], formats: list[str], points: int = 9) -> list[Mix]:
    """The predicted front: the optimal mix at ``points`` budgets evenly from the narrowest to the widest."""
    lo, hi = bits_range(groups, formats)
    budgets = [lo + (hi - lo) * i / (points - 1) for i in range(points)] if points > 1 else [hi]
    return [solve(groups, formats, b) for b in budgets]


BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class SidePlan:
    """A plan measured beside the search's: its label (a path-safe name), what it is, the plan's global scheme and
    overrides, and its effective bits and predicted KL by the same size model and sum of group KLs."""

    label: str
    kind: str  # "search", "search at the naive mix's bits", "uniform", "naive mix"
    scheme: str
    overrides: dict[str, str]
    bits: float
    predicted_kl: float


def predicted_kl(groups: list[GroupCost], choice: dict[str, str]) -> float:
    return float(sum(g.kl[choice[g.name]] for g in groups))


def uniform_choice(groups: list[GroupCost], fmt: str) -> dict[str, str]:
    return {g.name: fmt for g in groups}


def naive_choice(groups: list[GroupCost], formats: list[str], budget_bits: float) -> dict[str, str]:
    """The mix a user tries by hand: the narrowest format everywhere, then the first and the last blocks in the
    widest, then the second and the second to last, ... while the effective bits stay within the budget (a group
    that may not take one of them takes its nearest that it may: its narrowest, its widest)."""
    by_size = sorted(formats, key=lambda f: sum(g.bytes[f] for g in groups))

    def pick(g: GroupCost, order: list[str]) -> str:
        return next(f for f in order if g.allows(f))

    choice = {g.name: pick(g, by_size) for g in groups}
    blocks = sorted({int(m[1]) for g in groups if (m := BLOCK.search(g.name))})
    order = [b for pair in zip(blocks, reversed(blocks), strict=True) for b in pair][:len(blocks)]
    for block in dict.fromkeys(order):
        trial = {g.name: pick(g, by_size[::-1]) if (m := BLOCK.search(g.name)) and int(m[1]) == block
                 else choice[g.name] for g in groups}
        if effective_bits(groups, trial) > budget_bits + 1e-9:
            break
        choice = trial
    return choice
