"""The budget search's groups and what a mix of them becomes: vLLM's fused groups (plan/groups.py) and the scan's
units (an MoE layer's experts) merged into search groups with their bytes and KL per format; a solved mix as a
global scheme with overrides; the plans measured beside the search's mix."""

from __future__ import annotations

from fnmatch import fnmatchcase

from quark_ptq_eval.budget.knapsack import (
    GroupCost,
    Mix,
    SidePlan,
    effective_bits,
    linear_bytes,
    naive_choice,
    predicted_kl,
    solve,
    uniform_choice,
)
from quark_ptq_eval.plan.groups import LEAF_TO_FUSED, ROUTED, compact_patterns
from quark_ptq_eval.sensitivity.scan import ScanResult, UnitKL


def search_groups(shapes: dict[str, tuple[int, int]], scans: dict[str, ScanResult], formats: list[str],
                  scale_bytes: int = 2, refused: dict[str, str] | None = None) -> tuple[list[GroupCost], dict[str, list[str]]]:
    """(groups with their bytes and KL per format, each group's scan units' patterns): vLLM's fused groups
    and the scan's units (an MoE layer's experts) merged, so that no group splits either. An MoE layer's experts
    may take only the formats not ``refused`` for experts (request.py ``experts_refused``)."""
    from quark_ptq_eval.base.schemes import load_scheme_table

    experts_only = tuple(f for f in formats if f not in refused) if refused else ()
    table = load_scheme_table() or {"schemes": {}}
    rows = {f: {r.layer: r for r in scans[f].layers} for f in formats}
    units = rows[formats[0]]
    key_of = {n: _group_key(n, units) for n in shapes}
    groups, members = [], {}
    for key in dict.fromkeys(key_of.values()):
        linears = [n for n, k in key_of.items() if k == key]
        unit_names = list(dict.fromkeys(_unit_of(n, units) for n in linears))
        kl = {f: sum(rows[f][u].kl for u in unit_names if u in rows[f]) for f in formats}
        size = {f: sum(linear_bytes(table["schemes"].get(f, {}).get("weight"), *shapes[n], scale_bytes)
                       for n in linears) for f in formats}
        experts = any(ROUTED.match(n) for n in linears)
        groups.append(GroupCost(key, sum(r * c for r, c in (shapes[n] for n in linears)), size, kl,
                                experts_only if experts else ()))
        members[key] = [experts_pattern(key)] if experts else \
            [units[u].pattern if u in units else u for u in unit_names]
    return groups, members


def experts_pattern(moe: str) -> str:
    """The override pattern of an MoE layer's routed experts that Quark and vLLM both read: Quark matches it against
    the per-expert linears (``model.layers.0.mlp.experts.3.gate_proj``), vLLM against its fused-MoE module's own name
    (``model.layers.0.mlp.experts``; quark.py ``_find_matched_config``, fnmatch), which the scan unit's
    ``...experts.*`` does not match: vLLM then reads the experts under the global scheme (measured:
    bench/benchmarks/bench_moe_expert_serving.py, int4 experts over an int8 global refused with "shape '[]' is invalid")."""
    return f"{moe}*"


def _unit_of(name: str, units: dict[str, UnitKL]) -> str:
    if name in units:
        return name
    return next((u for u, r in units.items() if fnmatchcase(name, r.pattern)), name)


def _group_key(name: str, units: dict[str, UnitKL]) -> str:
    """A linear's search group: its routed experts' layer, its fused sibling set, its scan unit, or itself."""
    if m := ROUTED.match(name):
        return m["moe"]
    parent, _, leaf = name.rpartition(".")
    if leaf in LEAF_TO_FUSED:
        return f"{parent}.{LEAF_TO_FUSED[leaf]}"
    return _unit_of(name, units)


def mix_config(mix: Mix, groups: list[GroupCost], members: dict[str, list[str]],
               names: list[str]) -> tuple[str, dict[str, str]]:
    """(global scheme: the format holding most weights, overrides naming the other groups' members)."""
    weight: dict[str, int] = {}
    for g in groups:
        weight[mix.choice[g.name]] = weight.get(mix.choice[g.name], 0) + g.params
    scheme = max(weight, key=lambda f: weight[f])
    overrides: dict[str, str] = {}
    for fmt in (f for f in weight if f != scheme):
        picked = [p for g in groups if mix.choice[g.name] == fmt for p in members[g.name]]
        overrides |= {p: fmt for p in compact_patterns(picked, names)}
    return scheme, overrides


def side_plans(mix: Mix, groups: list[GroupCost], members: dict[str, list[str]], names: list[str],
               formats: list[str]) -> list[SidePlan]:
    """The plans measured beside the search's mix (flows/recipe/budget_side.py): the mix, each uniform format within the
    budget, the naive mix (first and last blocks in the widest format) and the search again at the naive mix's
    bits, so that the search is also judged at no more bits than the naive mix."""
    def side(label: str, kind: str, choice: dict[str, str]) -> SidePlan:
        m = Mix(choice, predicted_kl(groups, choice), effective_bits(groups, choice), mix.budget_bits)
        scheme, overrides = mix_config(m, groups, members, names)
        return SidePlan(label, kind, scheme, overrides, round(m.bits, 4), m.predicted_kl)

    sides = [side("search", "search", mix.choice)]
    sides += [side(f"uniform-{f}", "uniform", uniform_choice(groups, f)) for f in formats
              if all(g.allows(f) for g in groups) and effective_bits(groups, uniform_choice(groups, f)) <= mix.budget_bits]
    naive = naive_choice(groups, formats, mix.budget_bits)
    if naive != mix.choice and len(set(naive.values())) > 1:
        sides.append(side("naive-mix", "naive mix", naive))
        again = solve(groups, formats, effective_bits(groups, naive))
        if again.status == "optimal" and again.choice not in (mix.choice, naive):
            sides.append(side("search-at-naive-bits", "search at the naive mix's bits", again.choice))
    return sides
