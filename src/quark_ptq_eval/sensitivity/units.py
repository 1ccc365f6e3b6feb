"""What the scan measures one at a time: a layer, or on MoE models an expert unit.

After Quark's ``preprocess_for_quantization`` a transformers-5 MoE layer holds its routed experts
as ``<moe>.experts.<e>.{gate,up,down}_proj`` linears (hundreds of them at real size, nearly all
the parameters). Measured one by one they would cost hundreds of passes per layer and each would
move the output by almost nothing, so the default unit is the MoE layer's routed experts as one
group; ``expert`` measures each expert, ``projection`` each projection type across the experts
(``<moe>.experts.*.gate_proj``). Shared experts are one unit per layer, a router its own unit
(where the template quantizes it). Each unit carries the fnmatch pattern that names exactly its
modules: what the proposal writes into ``exclude_layers`` / ``layer_quant_config``, the syntax
Quark's config and the plan-conformance check both read.

Routing: a unit is measured with every MoE layer routing as the unquantized model did on the same
tokens (recorded in the reference pass), so a unit's KL is its own numeric effect, not a re-route
further down; whole-model and combination measurements route live, as the real model does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# A forward pre-hook with kwargs: (module, args, kwargs) -> replacement (args, kwargs), or None to keep them
PreHookWithKwargs = Callable[["torch.nn.Module", tuple[Any, ...], dict[str, Any]],
                             "tuple[tuple[Any, ...], dict[str, Any]] | None"]

EXPERT_UNITS = ("group", "expert", "projection")
ROUTED = re.compile(r"^(?P<moe>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)$")
SHARED = re.compile(r"^(?P<moe>.+\.shared_experts?)\.(?P<proj>.+)$")
ROUTER_LEAVES = ("gate", "router")  # Mixtral/Qwen/DeepSeek ``mlp.gate``, gpt-oss ``mlp.router``


@dataclass
class ScanUnit:
    name: str
    pattern: str  # fnmatch pattern matching exactly the members (the name itself for a single layer)
    kind: str  # layer | routed_experts | routed_expert | routed_projection | shared_experts | router
    members: list[str] = field(default_factory=list)


def measurement_units(names: list[str], expert_units: str = "group") -> dict[str, ScanUnit]:
    """Quantized module names grouped into the units the scan measures, in the model's order."""
    units: dict[str, ScanUnit] = {}
    for name in names:
        name_key, pattern, kind = _unit_of(name, expert_units)
        units.setdefault(name_key, ScanUnit(name_key, pattern, kind)).members.append(name)
    for unit in units.values():  # guard: a pattern must name its members and nothing else quantized
        assert all(fnmatchcase(n, unit.pattern) == (n in unit.members) for n in names), unit.name
    return units


def _unit_of(name: str, expert_units: str) -> tuple[str, str, str]:
    if m := ROUTED.match(name):
        moe = m["moe"]
        if expert_units == "expert":
            return f"{moe}.{m['expert']}", f"{moe}.{m['expert']}.*", "routed_expert"
        if expert_units == "projection":
            return f"{moe}.*.{m['proj']}", f"{moe}.*.{m['proj']}", "routed_projection"
        return moe, f"{moe}.*", "routed_experts"
    if m := SHARED.match(name):
        return m["moe"], f"{m['moe']}.*", "shared_experts"
    if name.rsplit(".", 1)[-1] in ROUTER_LEAVES:
        return name, name, "router"
    return name, name, "layer"


def module_type(unit: ScanUnit) -> str:
    """The heat map's column: the leaf for a layer, the unit kind (plus projection) for expert units."""
    if unit.kind == "layer" or unit.kind == "router":
        return unit.name.rsplit(".", 1)[-1]
    if unit.kind == "routed_projection":
        return "experts." + unit.name.rsplit(".", 1)[-1]
    return {"routed_experts": "experts", "routed_expert": "expert", "shared_experts": "shared_experts"}[unit.kind]


class Routing:
    """Each MoE experts module's (top_k_index, top_k_weights) per batch from the reference pass, replayed
    into the same module while a unit is measured (``pinned``), and the tokens each expert received."""

    def __init__(self) -> None:
        self.recorded: dict[str, list[tuple[Any, Any]]] = {}
        self.num_experts: dict[str, int] = {}
        self.pinned = False
        self.batch = 0
        self._handles: list[Any] = []

    def record(self, model: torch.nn.Module) -> None:
        """Hooks that record the routing of every experts module during the next forward passes."""
        for name, module in _experts_modules(model):
            self.recorded[name] = []
            self.num_experts[name] = int(module.num_experts)
            self._handles.append(module.register_forward_pre_hook(self._recorder(name), with_kwargs=True))

    def stop_recording(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def pin(self, model: torch.nn.Module) -> None:
        """Hooks (kept for the session) that substitute the recorded routing while ``pinned`` is set."""
        for name, module in _experts_modules(model):
            if self.recorded.get(name):
                self._handles.append(module.register_forward_pre_hook(self._substitute(name), with_kwargs=True))

    def tokens_per_expert(self) -> dict[str, list[int]]:
        """How many calibration tokens each expert of each MoE layer received in the reference pass."""
        import torch

        counts = {}
        for name, per_batch in self.recorded.items():
            n = self.num_experts[name]
            total = torch.zeros(n, dtype=torch.long)
            for index, _ in per_batch:
                total += torch.bincount(index.reshape(-1).long().clamp(max=n), minlength=n + 1)[:n]
            counts[name] = total.tolist()
        return counts

    def _recorder(self, name: str) -> Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            index, weights = _routing_args(args, kwargs)
            self.recorded[name].append((index.detach().clone(), weights.detach().clone()))
        return hook

    def _substitute(self, name: str) -> PreHookWithKwargs:
        def hook(_module: torch.nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
            if not self.pinned:
                return None
            index, weights = self.recorded[name][self.batch]
            if len(args) >= 3:
                return (args[0], index, weights, *args[3:]), kwargs
            return args, {**kwargs, "top_k_index": index, "top_k_weights": weights}
        return hook


def _experts_modules(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """Quark's per-expert replacements (``QuarkExperts``: forward(hidden, top_k_index, top_k_weights))."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "num_experts") and hasattr(m, "_apply_gate")]


def _routing_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    if len(args) >= 3:
        return args[1], args[2]
    return kwargs["top_k_index"], kwargs["top_k_weights"]
