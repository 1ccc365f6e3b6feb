"""Every expert replayed, not only those the probe's tokens were routed to.

A router sends each token to k of E experts: a 64-token probe reaches every expert of a tiny model,
but on DeepSeek-V3's 256 experts (top-8) about one in eight per layer gets no token, and a fault
confined to those experts would pass replay through the MoE block. The experts module is called
by its block as ``experts(hidden_states, top_k_index, top_k_weights)``, and Quark's per-expert
replacement takes the same call (where it does not, GPT-OSS's, the block judges as before), so the
source's call is repeated with the routing replaced: for each expert, a few probe tokens routed to
it alone (weight 1; the call's other slots go to other experts at weight 0), judged per expert so
that one faulty expert is not averaged away by the others (a first version, one call for all
experts, let a scale x4 in an expert with one token of 61 pass at 38 %). The source computes its output while it is loaded; the export's module is replayed on
the same call like any other unit.

It also finds what calibration missed: an expert no calibration token reached keeps the activation
scale Quark gives an observer that saw nothing (1.0), and under int8 its output is mostly zeros
(DeepSeek-V4's tiny export: 85 % away; calibration.py names the scales).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.validate.folds import ReplayUnit
from quark_ptq_eval.validate.replay import Capture, first_tensor, module_errors

if TYPE_CHECKING:
    import torch

EXPERT_KEY = " (expert "  # a forced call's capture key: "<experts module> (expert <e>)"
TOKENS_PER_EXPERT = 4  # judged per expert: one expert's fault is not averaged away by the others'


def route_every_expert(model: torch.nn.Module, captures: dict[str, Capture]) -> None:
    """Add one forced-routing capture per expert of each experts module the probe ran (``model``: the source)."""
    import torch

    modules = dict(model.named_modules())
    for name, cap in list(captures.items()):
        module = modules.get(name)
        if module is None or cap.takes_weights:
            continue
        forced = _forced_calls(module, cap) or []
        index = _index_arg(cap.args)  # never None where calls were forced
        for expert, args in forced:
            try:
                with torch.no_grad():
                    out = first_tensor(module(*args, **cap.kwargs))
            except Exception:  # noqa: BLE001 - a module whose call is not the routing one: nothing forced
                break
            if out is None:
                break
            routed = (int(cap.args[index].unique().numel()), len(forced)) if expert == 0 and index is not None else None
            captures[f"{name}{EXPERT_KEY}{expert})"] = Capture(args, cap.kwargs, out.detach().float().cpu(), cap.cls,
                                                                False, routed=routed)


def every_expert_units(captures: dict[str, Capture], exported: dict[str, Any], limit: float) -> list[ReplayUnit]:
    """Units for the forced calls. The export's module must first reproduce the probe's own call within
    ``limit``: one that Quark re-implements with another calling convention (GPT-OSS's returns another
    shape) is judged through its MoE block instead, which also catches a fault in the routed experts."""
    units, compatible = [], {}
    for key in list(captures):
        name = key.partition(EXPERT_KEY)[0]
        if name == key or name not in exported:
            continue
        if name not in compatible:
            compatible[name] = module_errors([ReplayUnit(name)], captures, exported).get(name, math.inf) <= limit
        if compatible[name]:
            units.append(ReplayUnit(name, capture=key))
    return units


def coverage(captures: dict[str, Capture]) -> tuple[int, int]:
    """(experts the probe routed a token to, experts) over every experts module with forced calls."""
    pairs = [cap.routed for cap in captures.values() if cap.routed]
    return sum(r for r, _ in pairs), sum(t for _, t in pairs)


def _index_arg(args: tuple[Any, ...]) -> int | None:
    import torch

    found = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.ndim == 2 and not a.is_floating_point()]
    return found[0] if len(found) == 1 else None


def _forced_calls(module: torch.nn.Module, cap: Capture) -> list[tuple[int, tuple[Any, ...]]] | None:
    """Per expert e, the call's positional arguments on a few probe tokens with e in every row's first
    slot at weight 1 (the other slots, distinct experts, at weight 0)."""
    import torch

    stacks = [p for p in module.parameters(recurse=False) if p.ndim == 3]
    at = _index_arg(cap.args)
    if not stacks or at is None:
        return None
    experts, index = stacks[0].shape[0], cap.args[at]
    tokens, k = index.shape
    weights = [i for i, a in enumerate(cap.args) if isinstance(a, torch.Tensor) and a.is_floating_point()
               and a.shape == index.shape]
    if len(weights) != 1 or not 0 < k <= experts or int(index.max()) >= experts:
        return None
    rows = min(tokens, TOKENS_PER_EXPERT)
    one_hot = torch.zeros(rows, k, dtype=cap.args[weights[0]].dtype)
    one_hot[:, 0] = 1
    calls = []
    for e in range(experts):
        picked = torch.arange(e * rows, (e + 1) * rows) % tokens  # different tokens for different experts
        args = [a.index_select(0, picked) if isinstance(a, torch.Tensor) and a.ndim >= 1 and a.shape[0] == tokens
                else a for a in cap.args]
        args[at] = ((torch.arange(k) + e) % experts).repeat(rows, 1).to(index.dtype)
        args[weights[0]] = one_hot
        calls.append((e, tuple(args)))
    return calls
