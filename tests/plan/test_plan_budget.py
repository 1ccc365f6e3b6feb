"""Issue 41: the budget search's solver is exact, at 70 B scale.

The program (budget/knapsack.py) minimises the summed per-group KL under an effective-bits budget. Its
answers are checked independently: against brute force over every mix of a small instance, and on a
70 B-shaped plan against the LP relaxation's bound (a multiple-choice knapsack's relaxation has at
most one fractional group, so the exact optimum lies within one group's KL spread of the bound).
"""

from __future__ import annotations

import itertools
import random
import resource

import pytest

from quark_ptq_eval.base.schemes import load_scheme_table
from quark_ptq_eval.budget.knapsack import (
    GroupCost,
    bits_range,
    effective_bits,
    front,
    linear_bytes,
    solve,
    solve_with_bound,
)

FORMATS = ["int4_wo_32", "int4_wo_128", "int8"]
# Llama-3-70B: hidden 8192, MLP 28672, 64 heads of 128, 8 KV heads; 80 blocks
HIDDEN, MLP, KV = 8192, 28672, 8 * 128
BLOCK = {"qkv_proj": [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN)], "o_proj": [(HIDDEN, HIDDEN)],
         "gate_up_proj": [(MLP, HIDDEN), (MLP, HIDDEN)], "down_proj": [(HIDDEN, MLP)]}


@pytest.fixture(scope="module")
def specs():
    table = load_scheme_table()
    if table is None:
        pytest.skip("no Quark scheme table")
    return {f: table["schemes"][f]["weight"] for f in FORMATS}


def _groups(specs, blocks: int, seed: int) -> list[GroupCost]:
    """Deployment groups of a Llama-70B shape, each with a synthetic KL per format (wider: less KL)."""
    rng = random.Random(seed)
    groups = []
    for b in range(blocks):
        for name, shapes in BLOCK.items():
            base = rng.lognormvariate(-9, 1.5) * (3 if b in (0, blocks - 1) else 1)
            kl = {"int4_wo_32": base, "int4_wo_128": base * rng.uniform(1.2, 2.0), "int8": base * rng.uniform(0.02, 0.2)}
            groups.append(GroupCost(f"model.layers.{b}.{name}", sum(r * c for r, c in shapes),
                                    {f: sum(linear_bytes(specs[f], r, c) for r, c in shapes) for f in FORMATS}, kl))
    return groups


def test_bytes_count_scales_and_zero_points(specs):
    # int4 per group of 32: 4 bits + a BF16 scale and a packed 4-bit zero point per 32 weights = 4.625 bits
    assert 8 * linear_bytes(specs["int4_wo_32"], 4096, 4096) / 4096**2 == pytest.approx(4 + 16 / 32 + 4 / 32)
    assert 8 * linear_bytes(specs["int4_wo_128"], 4096, 4096) / 4096**2 == pytest.approx(4 + 20 / 128)
    assert 8 * linear_bytes(specs["int8"], 4096, 4096) / 4096**2 == pytest.approx(8, abs=1e-5)  # per tensor


def test_the_exact_mix_equals_brute_force_on_a_small_instance(specs):
    groups = _groups(specs, 2, seed=3)  # 8 groups x 3 formats: 6561 mixes
    lo, hi = bits_range(groups, FORMATS)
    for budget in (lo, lo + 0.3 * (hi - lo), 6.0, hi - 0.5):
        best = min((sum(g.kl[f] for g, f in zip(groups, mix, strict=True)), mix)
                   for mix in itertools.product(FORMATS, repeat=len(groups))
                   if effective_bits(groups, {g.name: f for g, f in zip(groups, mix, strict=True)}) <= budget + 1e-9)
        mix = solve(groups, FORMATS, budget)
        assert mix.bits <= budget + 1e-9
        assert mix.predicted_kl == pytest.approx(best[0], rel=1e-9), budget


def test_a_70b_shaped_plan_is_solved_exactly_and_its_memory_is_small(specs):
    groups = _groups(specs, 80, seed=0)  # 320 groups x 3 formats: 960 binaries
    assert sum(g.params for g in groups) == pytest.approx(68.5e9, rel=0.01)  # Llama-70B's decoder linears
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mix = solve_with_bound(groups, FORMATS, 6.0)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert mix.status == "optimal" and mix.bits <= 6.0 and mix.bits > 5.9  # the budget is used
    assert set(mix.counts) == set(FORMATS) and mix.counts["int8"] > 0 and mix.counts["int4_wo_32"] > 0
    spread = max(max(g.kl.values()) - min(g.kl.values()) for g in groups)
    assert mix.lp_bound <= mix.predicted_kl + 1e-12 <= mix.lp_bound + spread
    assert grown_mib < 200, f"the solve grew the process by {grown_mib:.0f} MiB"
    # the uniform narrow format is within the budget, so the optimum can only predict less
    narrow = sum(g.kl["int4_wo_32"] for g in groups)
    assert mix.predicted_kl < narrow


def test_the_front_descends_as_the_budget_grows(specs):
    points = front(_groups(specs, 8, seed=1), FORMATS, points=5)
    kls = [p.predicted_kl for p in points]
    assert all(a >= b - 1e-15 for a, b in zip(kls, kls[1:], strict=False)) and kls[0] > kls[-1]
    assert all(p.bits <= p.budget_bits + 1e-9 for p in points)
