"""Every expert replayed, not only those the probe's tokens were routed to.

A router sends each token to k of E experts: a 64-token probe reaches every expert of a tiny model,
but on DeepSeek-V3's 256 experts (top-8) about one in eight per layer gets no token, and a fault
confined to those experts would pass replay through the MoE block. The experts module is called
by its block as ``experts(hidden_states, top_k_index, top_k_weights)``, and Quark's per-expert
replacement takes the same call (where it does not, GPT-OSS's, the block judges as before), so the
source's call is repeated with the routing replaced: token t's slots go to experts t*k .. t*k+k-1 (mod E), tokens repeated until every expert
has some. The source computes its output while it is loaded; the export's module is replayed on
the same call like any other unit.

It also finds what calibration missed: an expert no calibration token reached keeps the activation
scale Quark gives an observer that saw nothing (1.0), and under int8 its output is mostly zeros
(DeepSeek-V4's tiny export: 85 % away; calibration.py names the scales).
"""

from __future__ import annotations

import math
from typing import Any

from .folds import Unit
from .replay import Capture, first_tensor, module_errors

EVERY_EXPERT = " (every expert)"  # suffix of the forced call's capture key: "<experts module> (every expert)"


def route_every_expert(model, captures: dict[str, Capture]) -> None:
    """Add a forced-routing capture for each experts module the probe ran (``model`` is the source)."""
    import torch

    modules = dict(model.named_modules())
    for name, cap in list(captures.items()):
        module = modules.get(name)
        forced = None if module is None or cap.takes_weights else _forced_call(module, cap)
        if forced is None:
            continue
        args, routed, total = forced
        try:
            with torch.no_grad():
                out = first_tensor(module(*args, **cap.kwargs))
        except Exception:  # noqa: BLE001 - a module whose call is not the routing one: nothing forced
            continue
        if out is not None:
            captures[name + EVERY_EXPERT] = Capture(args, cap.kwargs, out.detach().float().cpu(), cap.cls, False,
                                                    routed=(routed, total))


def every_expert_units(captures: dict[str, Capture], exported: dict[str, Any], limit: float) -> list[Unit]:
    """Units for the forced calls. The export's module must first reproduce the probe's own call within
    ``limit``: one that Quark re-implements with another calling convention (GPT-OSS's returns another
    shape) is judged through its MoE block instead, which also catches a fault in the routed experts."""
    units = []
    for key in list(captures):
        name = key.removesuffix(EVERY_EXPERT)
        if name != key and name in exported and module_errors([Unit(name)], captures, exported).get(name, math.inf) <= limit:
            units.append(Unit(name, capture=key))
    return units


def coverage(captures: dict[str, Capture]) -> tuple[int, int]:
    """(experts the probe routed a token to, experts) over every experts module with a forced call."""
    pairs = [cap.routed for cap in captures.values() if cap.routed]
    return sum(r for r, _ in pairs), sum(t for _, t in pairs)


def _forced_call(module, cap: Capture) -> tuple[tuple, int, int] | None:
    """The call's positional arguments with every expert routed, the experts it had routed, and E."""
    import torch

    stacks = [p for p in module.parameters(recurse=False) if p.ndim == 3]
    indices = [i for i, a in enumerate(cap.args) if isinstance(a, torch.Tensor) and a.ndim == 2
               and not a.is_floating_point()]
    if not stacks or len(indices) != 1:
        return None
    experts, index = stacks[0].shape[0], cap.args[indices[0]]
    tokens, k = index.shape
    weights = [i for i, a in enumerate(cap.args) if isinstance(a, torch.Tensor) and a.is_floating_point()
               and a.shape == index.shape]
    if len(weights) != 1 or not 0 < k <= experts or int(index.max()) >= experts:
        return None
    rows = max(tokens, math.ceil(experts / k))
    repeat = math.ceil(rows / tokens)
    args = tuple(a.repeat(repeat, *([1] * (a.ndim - 1)))[:rows]
                 if isinstance(a, torch.Tensor) and a.ndim >= 1 and a.shape[0] == tokens else a for a in cap.args)
    forced = (torch.arange(rows * k).view(rows, k) % experts).to(index.dtype)
    args = (*args[:indices[0]], forced, *args[indices[0] + 1:])
    return args, int(index.unique().numel()), experts
