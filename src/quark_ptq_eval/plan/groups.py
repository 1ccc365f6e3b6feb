"""Deployment groups: the linears vLLM runs as one kernel, which must therefore share one scheme.

vLLM fuses q/k/v into one ``qkv_proj``, gate/up into one ``gate_up_proj`` (DeepSeek's MLA also
``q_a_proj`` with ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``), and runs an MoE layer's routed
experts as one fused-MoE kernel. Its Quark loader refuses an export whose members of one group carry
different quantization configs ("vLLM requires all to use the same scheme"), and refuses a group
only partly excluded. Quark itself exports such a split without complaint, so the plan is where it
is caught: ``settle_groups`` refuses a split naming the group, or, when the user asked for it
(``--widen-groups``), widens the override or exclusion to the whole group and says so.

Checkpoints that store a group already fused (phi3's ``qkv_proj`` / ``gate_up_proj``) have one
linear per group and nothing to split.

The scheme a module gets is read as Quark's config applies it (quark/torch/quantization/
model_transformation.py): an exclusion first, then an exact-name override, then the first override
pattern that matches, else the global scheme.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from quark_ptq_eval.base.errors import UsageError

# fused linear -> the checkpoint's linears vLLM loads into it (its models' packed_modules_mapping)
FUSED_LEAVES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
LEAF_TO_FUSED = {leaf: fused for fused, leaves in FUSED_LEAVES.items() for leaf in leaves}
ROUTED = re.compile(r"^(?P<moe>.+\.experts)\.\d+\.[^.]+$")  # Quark's per-expert linears, as units.py names them
UNQUANTIZED = None  # a member's scheme when an exclusion keeps it at the source precision


@dataclass(frozen=True)
class Group:
    name: str  # the fused module vLLM builds, e.g. model.layers.0.self_attn.qkv_proj / model.layers.0.mlp.experts
    label: str  # "q/k/v", "gate/up", "routed experts"
    members: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.label} of {self.name.rpartition('.')[0] if self.label != 'routed experts' else self.name}"


@dataclass
class Settled:
    """The overrides and exclusions after the group check, and what widening changed (empty: nothing)."""

    overrides: dict[str, str]
    excludes: list[str]
    widened: list[str] = field(default_factory=list)  # one line per widened group


def deployment_groups(names: list[str]) -> list[Group]:
    """The groups of more than one linear among ``names`` (the quantizable linears), in the model's order."""
    found: dict[str, tuple[str, list[str]]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        if m := ROUTED.match(name):
            key, label = m["moe"], "routed experts"
        elif leaf in LEAF_TO_FUSED:
            fused = LEAF_TO_FUSED[leaf]
            key, label = f"{parent}.{fused}", "/".join(s.removesuffix("_proj") for s in FUSED_LEAVES[fused])
        else:
            continue
        found.setdefault(key, (label, []))[1].append(name)
    return [Group(k, label, tuple(members)) for k, (label, members) in found.items() if len(members) > 1]


def scheme_of(name: str, scheme: str, overrides: dict[str, str], excludes: list[str]) -> str | None:
    """The scheme Quark gives ``name``: None when excluded."""
    if any(name == p or fnmatchcase(name, p) for p in excludes):
        return UNQUANTIZED
    if name in overrides:
        return overrides[name]
    return next((s for p, s in overrides.items() if fnmatchcase(name, p)), scheme)


def _shown(s: str | None) -> str:
    return "unquantized" if s is UNQUANTIZED else s


def _short(group: Group, member: str) -> str:
    return member.removeprefix(group.name + ".") if group.label == "routed experts" else member.rpartition(".")[2]


def _split_text(group: Group, schemes: dict[str, str | None], scheme: str) -> str:
    """``q/k/v of model.layers.0.self_attn (q_proj int4_wo_128; k_proj, v_proj int8)``: the global scheme last."""
    by_scheme: dict[str | None, list[str]] = {}
    for member, s in sorted(schemes.items(), key=lambda kv: kv[1] == scheme):
        by_scheme.setdefault(s, []).append(_short(group, member))
    parts = [f"{', '.join(ms[:4])}{' ...' if len(ms) > 4 else ''} {_shown(s)}" for s, ms in by_scheme.items()]
    return f"{group.describe()} ({'; '.join(parts)})"


def settle_groups(names: list[str], scheme: str, overrides: dict[str, str], excludes: list[str],
                  widen: bool) -> Settled:
    """Refuse an override or exclusion that splits a deployment group, or widen it to the group (``widen``)."""
    splits = [(g, s) for g in deployment_groups(names)
              if len(set((s := {m: scheme_of(m, scheme, overrides, excludes) for m in g.members}).values())) > 1]
    if not splits:
        return Settled(dict(overrides), list(excludes))
    if not widen:
        group, schemes = splits[0]
        more = f" (and {len(splits) - 1} more group(s))" if len(splits) > 1 else ""
        rest = sorted({_short(group, m) for m, s in schemes.items() if s == scheme}) or ["the others"]
        raise UsageError(
            f"The plan splits a group vLLM runs as one fused layer: {_split_text(group, schemes, scheme)}{more}; "
            "vLLM refuses an export whose fused members differ in scheme.",
            f"Give the whole group one scheme (override or exclude {', '.join(rest[:4])} alike, or none of the "
            "group), or pass --widen-groups to widen the override or exclusion to the whole group.")
    return _widen(names, scheme, overrides, excludes, splits)


def _widen(names: list[str], scheme: str, overrides: dict[str, str], excludes: list[str],
           splits: list[tuple[Group, dict[str, str | None]]]) -> Settled:
    """Each split group takes its members' one non-global choice: an exclusion wins over an override
    (the wider precision); two different overrides in one group cannot be widened."""
    new_excludes: list[str] = []
    new_overrides: dict[str, str] = {}
    widened: list[str] = []
    for group, schemes in splits:
        chosen = set(schemes.values()) - {scheme}
        target: str | None = UNQUANTIZED if UNQUANTIZED in chosen else chosen.pop() if len(chosen) == 1 else "?"
        if target == "?":
            raise UsageError(f"Two overrides split one fused group: {_split_text(group, schemes, scheme)}; "
                             "widening cannot pick between them.",
                             f"Give every member of {group.label} the same --layer-quant-scheme.")
        # a layer's experts by their group's pattern (one line, not one per expert); fused siblings by name
        added = [f"{group.name}.*"] if group.label == "routed experts" else [m for m, s in schemes.items() if s != target]
        if target is UNQUANTIZED:
            new_excludes += added
        else:
            new_overrides |= {m: target for m in added}
        widened.append(f"{_split_text(group, schemes, scheme)} -> all {_shown(target)}")
    excl = [*excludes, *compact_patterns(new_excludes, names)]
    # widened names first: Quark (and vLLM) take the first matching pattern
    ovr = {p: s for s in dict.fromkeys(new_overrides.values())
           for p in compact_patterns([m for m, t in new_overrides.items() if t == s], names)} | overrides
    return Settled(ovr, excl, widened)


def compact_patterns(members: list[str], names: list[str]) -> list[str]:
    """Patterns naming exactly ``members`` among ``names``: layer indices as ``*`` where that names no
    other linear, else the exact names."""
    want, out = set(members), []
    for member in members:
        if "*" in member:  # already a group's pattern
            out.append(member)
            continue
        pattern = re.sub(r"\.\d+(?=\.)", ".*", member)
        hits = {n for n in names if fnmatchcase(n, pattern)}
        out += [pattern] if hits <= want else [member]
    return list(dict.fromkeys(out))
