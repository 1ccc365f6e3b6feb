"""Expert groups as the streaming unit: a MoE decoder block run with its routed experts read G at a time.

A giant MoE block (DeepSeek-V3: 256 routed experts a block; Kimi-K2: 384) can exceed the host, so the block
streamer (``runtime/blocks.py``) cannot hold it whole. Here a block of a ``StreamedModel`` is loaded without
its routed experts (attention, norms, router, shared experts: through the loader's own code), then its routed
experts a group of G at a time (only that group's tensors or rows of fused tensors are read), each group
freed after use. Group size comes from a byte budget, at least one expert.

The block's output is the model's own: transformers' decoder layer runs with its routed-experts module
replaced by a stand-in. A first pass records what the layer hands its experts (the hidden states, and the
top-k indices and weights of transformers' own router); the experts module itself, holding only the group,
then computes each routed (token, slot) pair's output for the group's experts (the family's own math:
gate/up, activation or gpt-oss's clamped GLU, biases, down; Quark's quantized linears); each pair's output
is weighted and summed as the module sums them: over the slots in float32 (transformers' default
``grouped_mm`` and ``batched_mm``), or expert after expert into the module's own accumulator (its eager loop,
Quark's ``QuarkExperts``: the groups come in expert order, so the additions are the same). A second pass of
the layer gets that sum from the stand-in (shared experts, residuals: the layer's own). Supported: routed
experts held as transformers' fused experts module (3-D parameters, one row per expert: qwen3_moe,
deepseek_v3, gpt_oss, ...) through transformers' loading step, or as Quark's per-expert modules (a Quark
export's MoE through Quark's importer); other blocks stream whole.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.runtime import blocks
from quark_ptq_eval.runtime.block_pass import no_grad

if TYPE_CHECKING:
    from quark_ptq_eval.base.safetensors_io import TensorInfo
    from quark_ptq_eval.runtime.block_pass import Recorded
    from quark_ptq_eval.runtime.blocks import StreamedModel

_EXPERT_INDEX = re.compile(r"^(\d+)\.")  # a per-expert checkpoint name after the experts' prefix: "7.gate_proj..."


@dataclass
class ExpertPlan:
    """How block ``index`` of a model is split: its tensors without the routed experts, and the experts' own."""

    index: int
    module_path: str  # the routed-experts module inside the decoder layer: "mlp.experts"
    num_experts: int
    per_module: bool  # experts as submodules "0".."E-1" (Quark's), else transformers' fused 3-D parameters
    eager: bool  # the module sums expert after expert (its eager loop), else over the slots in float32
    rest: list[TensorInfo]  # everything of the block but the routed experts
    per_expert: dict[int, list[TensorInfo]]  # checkpoints storing one tensor per expert (converted on load)
    fused: list[TensorInfo]  # checkpoints storing fused tensors, dim 0 = expert
    group_size: int

    @property
    def expert_bytes(self) -> int:
        """The most bytes one expert's tensors hold (fused tensors: one row)."""
        per = max((sum(t.nbytes for t in ts) for ts in self.per_expert.values()), default=0)
        return per + sum(t.nbytes // self.num_experts for t in self.fused)

    def groups(self) -> Iterator[tuple[int, int]]:
        for start in range(0, self.num_experts, self.group_size):
            yield start, min(start + self.group_size, self.num_experts)


def routed_experts(layer: Any) -> tuple[str, Any, bool] | None:
    """The decoder layer's routed-experts module, run by ``forward(hidden, top_k_index, top_k_weights)``:
    transformers' fused kind (``num_experts``, parameters whose first dimension is the expert; False), or
    Quark's per-expert kind (submodules "0".."E-1"; True)."""
    for name, module in layer.named_modules():
        count = getattr(module, "num_experts", None)
        if not name.endswith("experts") or "shared" in name.rsplit(".", 1)[-1] or not isinstance(count, int):
            continue
        params = list(module.named_parameters(recurse=False))
        children = {child for child, _ in module.named_children()}
        if params and len(list(module.parameters())) == len(params) and all(
                p.ndim >= 2 and p.shape[0] == count for _, p in params):
            return name, module, False
        if not params and {str(e) for e in range(count)} <= children:
            return name, module, True
    return None


def _sums_eagerly(experts: Any, per_module: bool) -> bool:
    """Whether the module adds its experts' outputs one expert after another (its eager loop)."""
    return per_module or getattr(getattr(experts, "config", None), "_experts_implementation", None) == "eager"


def plan_block(streamed: StreamedModel, index: int, budget: int) -> ExpertPlan | None:
    """Block ``index`` split into its rest and groups of experts fitting ``budget`` bytes beside the rest, or
    None where the block fits the budget whole or cannot be split (no routed experts of the kind its loader
    fills, or an experts' tensor held for all experts at once)."""
    if streamed.block_bytes(index) <= budget:
        return None
    found = routed_experts(streamed.layers[index])
    if found is None or found[2] != (streamed.load_config is None):  # each loader's own kind
        return None
    module_path, experts, per_module = found
    prefix = f"{streamed.layers_path}.{index}.{module_path}."
    rest: list[TensorInfo] = []
    per_expert: dict[int, list[TensorInfo]] = defaultdict(list)
    fused: list[TensorInfo] = []
    for info in streamed.parts.get(str(index), []):
        if not info.name.startswith(prefix):
            rest.append(info)
        elif match := _EXPERT_INDEX.match(info.name[len(prefix):]):
            per_expert[int(match.group(1))].append(info)
        elif info.shape and info.shape[0] == experts.num_experts and not info.transposed and not per_module:
            fused.append(info)
        else:
            return None  # a tensor of the experts not held per expert (a shared scale): not split here
    plan = ExpertPlan(index, module_path, experts.num_experts, per_module, _sums_eagerly(experts, per_module), rest,
                      dict(per_expert), fused, 1)
    spare = budget - sum(t.nbytes for t in rest)
    plan.group_size = max(1, min(plan.num_experts, spare // max(1, plan.expert_bytes)))
    return plan


def _group_tensors(plan: ExpertPlan, prefix: str, start: int, end: int) -> list[TensorInfo]:
    """The group's tensors: for Quark's per-expert modules as stored; for transformers' fused module as its
    loader sees a checkpoint of ``end - start`` experts (per-expert names renumbered from 0, fused tensors
    cut to the group's rows: their byte range only)."""
    infos = []
    for expert in range(start, end):
        for info in plan.per_expert.get(expert, []):
            tail = info.name[len(prefix):].split(".", 1)[1]
            name = info.name if plan.per_module else f"{prefix}{expert - start}.{tail}"
            infos.append(dataclasses.replace(info, name=name))
    for info in plan.fused:
        row = info.nbytes // plan.num_experts
        infos.append(dataclasses.replace(info, shape=(end - start, *info.shape[1:]), start=info.start + start * row,
                                         end=info.start + end * row))
    return infos


def _resize(experts: Any, count: int) -> None:
    """The experts module on meta with ``count`` experts: its expert-indexed parameters' first dimension."""
    for name, param in list(experts.named_parameters(recurse=False)):
        experts._parameters[name] = torch.nn.Parameter(
            torch.empty((count, *param.shape[1:]), dtype=param.dtype, device="meta"), requires_grad=False)
    experts.num_experts = count


@dataclass
class _Routed:
    """What one forward of the layer handed its experts, and their weighted sum once the groups ran."""

    hidden: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor
    total: torch.Tensor | None = None  # the sum as the module keeps it (float32 over the slots, or its accumulator)


class _Captured(Exception):
    """Raised by the recording stand-in: the layer's pass has what its experts would be given."""


class _StandIn(torch.nn.Module):
    """The routed experts during a pass of the layer: records their inputs (``output`` None), or returns the
    groups' weighted sum."""

    def __init__(self, original: Any, sink: list[_Routed], output: torch.Tensor | None = None):
        super().__init__()
        self.sink, self.output = sink, output
        self.num_experts = original.num_experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        if self.output is None:
            self.sink.append(_Routed(hidden_states, top_k_index, top_k_weights))
            raise _Captured
        return self.output


def _with_experts(layer: Any, module_path: str, module: Any) -> Any:
    """Put ``module`` at ``module_path`` of ``layer``; returns what was there."""
    owner_path, _, leaf = module_path.rpartition(".")
    owner = layer.get_submodule(owner_path) if owner_path else layer
    previous = owner._modules[leaf]
    owner._modules[leaf] = module
    return previous


def _accumulator(experts: Any, plan: ExpertPlan, hidden: torch.Tensor) -> torch.Tensor:
    """Where the groups' outputs are summed: the module's own accumulator (Quark's; transformers' eager loop
    sums in the hidden states' dtype), or float32 as grouped_mm sums the slots."""
    if not plan.eager:
        return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    init = getattr(experts, "_init_accumulator", None)
    return init(hidden) if init is not None else torch.zeros_like(hidden)


def _add_group(experts: Any, plan: ExpertPlan, routed: _Routed, start: int, end: int) -> None:
    """The group's experts on the (token, slot) pairs routed to them: each pair's expert output from the
    experts module's own forward (one slot a row, weight 1: the output unweighted and exact), weighted as the
    module weights it (``out * weight`` in the promoted dtype), summed as it sums: each expert's rows in the
    order its loop takes them (slot, then token; grouped_mm: token, then slot), in expert order."""
    tokens_count, k = routed.index.shape
    order = routed.index.T if plan.eager else routed.index  # the pairs in the order the module visits them
    flat = order.reshape(-1)
    pairs = ((flat >= start) & (flat < end)).nonzero().squeeze(-1)
    if not pairs.numel():
        return
    tokens, slots = (pairs % tokens_count, pairs // tokens_count) if plan.eager else (pairs // k, pairs % k)
    ids = flat[pairs]
    local = ids if plan.per_module else ids - start
    weights = routed.weights[tokens, slots].unsqueeze(-1)
    weighted = experts(routed.hidden[tokens], local.unsqueeze(-1), torch.ones_like(weights)) * weights
    assert routed.total is not None
    if not plan.eager:
        routed.total.index_add_(0, tokens, weighted.float())
        return
    for expert in range(start, end):
        rows = (ids == expert).nonzero().squeeze(-1)
        if rows.numel():
            routed.total.index_add_(0, tokens[rows], weighted[rows].to(routed.total.dtype))


class _Group(torch.nn.Module):
    """The group's expert modules (Quark's per-expert kind), for Quark's post-load step over them only."""

    def __init__(self, experts: Any, start: int, end: int):
        super().__init__()
        for expert in range(start, end):
            self.add_module(str(expert), experts.get_submodule(str(expert)))


def run_block(streamed: StreamedModel, plan: ExpertPlan, jobs: list[tuple[torch.Tensor, Recorded]],
              inference: bool = True) -> list[torch.Tensor]:
    """Block ``plan.index`` applied to each ``(hidden states, layer arguments)`` of ``jobs``, its routed experts
    loaded a group at a time (each group once for all jobs); the block is loaded and freed here."""
    index = plan.index
    layer = streamed.layers[index]
    part, key = str(index), f"{index}:rest"
    prefix = f"{streamed.layers_path}.{index}.{plan.module_path}."
    experts = layer.get_submodule(plan.module_path)
    _with_experts(layer, plan.module_path, torch.nn.Module())  # the rest's post-load step leaves the experts be
    try:
        blocks.load_tensors(streamed, key, part, plan.rest)
    finally:
        _with_experts(layer, plan.module_path, experts)
    _require_loaded(streamed, layer, plan.module_path)
    sink: list[_Routed] = []
    try:
        _with_experts(layer, plan.module_path, _StandIn(experts, sink))
        for hidden, recorded in jobs:  # pass 1: the router's choices for every job
            try:
                with no_grad(inference):
                    layer(hidden, *recorded.args, **recorded.kwargs)
            except _Captured:
                pass
        _with_experts(layer, plan.module_path, experts)  # the groups load into the real module
        with no_grad(inference):
            for routed in sink:
                routed.total = _accumulator(experts, plan, routed.hidden)
            for start, end in plan.groups():
                if not plan.per_module:
                    _resize(experts, end - start)
                holder = _Group(experts, start, end) if plan.per_module else None
                blocks.load_tensors(streamed, f"{index}:experts", part, _group_tensors(plan, prefix, start, end),
                                    holder)
                _require_group(experts, plan, start, end)
                for routed in sink:
                    _add_group(experts, plan, routed, start, end)
                blocks.free(streamed, f"{index}:experts")
        outputs = []
        for (hidden, recorded), routed in zip(jobs, sink, strict=True):  # pass 2: the layer with the groups' sum
            assert routed.total is not None
            _with_experts(layer, plan.module_path, _StandIn(experts, sink, routed.total.to(routed.hidden.dtype)))
            with no_grad(inference):
                out = layer(hidden, *recorded.args, **recorded.kwargs)
            outputs.append(out[0] if isinstance(out, tuple) else out)
    finally:
        _with_experts(layer, plan.module_path, experts)
        if not plan.per_module:
            _resize(experts, plan.num_experts)
        blocks.free(streamed, key)
    return outputs


def _require_loaded(streamed: StreamedModel, layer: Any, module_path: str) -> None:
    """Every tensor of the block but the routed experts' is loaded (an incomplete checkpoint is named)."""
    missing = [n for n, t in [*layer.named_parameters(), *layer.named_buffers()]
               if t.device.type == "meta" and not n.startswith(module_path + ".")]
    if missing:
        raise QpeError(f"{streamed.path.name}: tensors {', '.join(missing[:3])} of a block are not in its files, or "
                       "not under the names its loader expects; the checkpoint is incomplete.")


def _require_group(experts: Any, plan: ExpertPlan, start: int, end: int) -> None:
    """The group's tensors filled every parameter of its experts (fused: with ``end - start`` rows)."""
    if plan.per_module:
        group = _Group(experts, start, end)
        wrong = [n for n, t in [*group.named_parameters(), *group.named_buffers()] if t.device.type == "meta"]
    else:
        wrong = [n for n, p in experts.named_parameters(recurse=False)
                 if p.device.type == "meta" or p.shape[0] != end - start]
    if wrong:
        raise QpeError(f"routed experts {start}-{end - 1} did not load into {', '.join(wrong[:3])}: the checkpoint's "
                       "expert tensors are not where or as the loader expects them.")
