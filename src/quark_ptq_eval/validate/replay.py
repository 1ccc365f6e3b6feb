"""Module replay: the source's own inputs fed to the loaded export's modules, one module at a time.

Comparing whole-model logits cannot tell a loader fault from quantization noise on a model whose
logits are flat (a random-weight tiny model amplifies a 4 % weight error into a different greedy
token at half the positions). One module given the source's exact input can: its output differs
from the source module's by the scheme's rounding (at most 29 % relative, fp8 to mxfp4, over 159
real exports of 34 families), where a scale read 4x measured 52 % to 300 % and weights left at
random ~150 % (bench/benchmarks/bench_load_check.py). Errors do not compound from module to module.

(Not ``sensitivity/replay.py``: that one re-runs one model's decoder from a block onwards.)

A module is replayed where the call means the same in both models: the same class (the model's
own code calls it the same way), or a source ``nn.Linear``/``nn.Embedding`` the export replaced
with its quantized counterpart. Otherwise (a fused-experts module Quark re-implements, a module
the parent hands its weights to) the nearest ancestor that qualifies is replayed instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

from quark_ptq_eval.validate.folds import ReplayUnit

T = TypeVar("T")
MAX_CLIMB = 3  # the owner, its parent (an MoE block for fused experts), grandparent (DBRX: experts.mlp -> ffn)


@dataclass
class Capture:
    """One source module's first call on the probe, kept on the CPU."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any  # the first tensor of what it returned
    cls: type
    takes_weights: bool  # an argument is (a view of) a model parameter: the parent owns the weights
    routed: tuple[int, int] | None = None  # an every-expert call: (experts the probe routed, experts)


def weight_owners(model: torch.nn.Module) -> list[str]:
    """Modules that hold a matrix (or expert stack) of their own: what a loader can get wrong."""
    return [name for name, module in model.named_modules()
            if name and any(p.ndim >= 2 for p in module.parameters(recurse=False))]


def capture(model: torch.nn.Module, ids: torch.Tensor) -> tuple[dict[str, Capture], list[str], torch.Tensor]:
    """Run ``model`` once on ``ids`` recording the inputs and output of every module holding parameters
    and of the weight owners' ancestors; returns the captures, the owners' names and the logits."""
    captures, owners, logits = capture_during(model, lambda: run_probe(model, ids))
    return captures, owners, logits


def capture_during(model: torch.nn.Module, run: Callable[[], T], inside: Callable[[str], bool] = lambda _: True,
                   ) -> tuple[dict[str, Capture], list[str], T]:
    """``capture`` around any call of ``model``'s modules: ``run()``'s result with the captures. Only the
    modules ``inside`` names are watched: a streamed model runs one part at a time, and a module holding
    parts not loaded (the decoder stack around one block) is no unit (``validate/load_stream.py``)."""
    import torch

    owners = [name for name in weight_owners(model) if inside(name)]
    wanted = {".".join(owner.split(".")[:depth]) for owner in owners for depth in range(1, owner.count(".") + 2)}
    modules = dict(model.named_modules())
    # norms too: where an algorithm folded scales into one, it is replayed ahead of its consumer (folds.py)
    wanted |= {name for name, module in modules.items() if name and any(True for _ in module.parameters(recurse=False))}
    wanted = {name for name in wanted if inside(name)}
    storages = {p.untyped_storage().data_ptr() for p in model.parameters() if p.device.type != "meta"}
    captures: dict[str, Capture] = {}

    def hook(name: str) -> Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        def record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            out = first_tensor(output)
            if name in captures or out is None:
                return
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            takes = any(t.untyped_storage().data_ptr() in storages for t in tensors)
            captures[name] = Capture(_to(args, "cpu", copy=True), _to(kwargs, "cpu", copy=True), out.detach().float().cpu(),
                                     type(module), takes)
        return record

    handles = [modules[name].register_forward_hook(hook(name), with_kwargs=True)
               for name in sorted(wanted) if name in modules and _callable(modules[name])]
    try:
        result = run()
    finally:
        for handle in handles:
            handle.remove()
    return captures, owners, result


def run_probe(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits on ``ids`` without a KV cache (a cache object would be mutated by replays)."""
    import torch

    with torch.no_grad():
        try:
            out = model(ids.to(_device(model)), use_cache=False)
        except TypeError:  # a remote-code forward without use_cache
            out = model(ids.to(_device(model)))
    logits: torch.Tensor = out.logits.float().cpu()
    return logits


def replay_targets(owners: list[str], captures: dict[str, Capture], exported: dict[str, Any]) -> list[str]:
    """For each owner the probe ran, itself or its nearest ancestor (at most ``MAX_CLIMB`` levels up: a
    whole decoder layer compounds its modules' rounding) whose call means the same in the export."""
    targets: list[str] = []
    for owner in owners:
        if owner not in captures:
            continue  # not run by a text probe (a vision tower): nothing to compare
        name = owner
        for _ in range(MAX_CLIMB):
            if replayable(captures.get(name), exported.get(name)):
                if name not in targets:
                    targets.append(name)
                break
            name = name.rpartition(".")[0]
            if not name:
                break
    return targets


def is_leaf(cap: Capture | None) -> bool:
    """A single linear or embedding: what the export's emulation computes as its files say (emulate.py)."""
    import torch

    return cap is not None and issubclass(cap.cls, torch.nn.Linear | torch.nn.Embedding)


def unit_outputs(units: list[ReplayUnit], captures: dict[str, Capture], modules: dict[str, Any],
                 dtype: torch.dtype | None = None) -> dict[ReplayUnit, torch.Tensor]:
    """Each unit's output (float32, CPU) computed by ``modules`` (a loaded export, or the export's
    emulation) on the source's captured input (its floats cast to ``dtype`` when given); a call that
    raises, or a unit without an output, is left out. A unit with a ``norm`` runs that model's norm
    first, on the norm's own input."""
    import torch

    outputs: dict[ReplayUnit, torch.Tensor] = {}
    with torch.no_grad():
        for unit in units:
            try:
                got = _run_unit(unit, captures, modules, dtype)
            except Exception:  # noqa: BLE001 - a call the export's module cannot take is not a verdict on it
                continue
            if got is not None:
                outputs[unit] = got.detach().float().cpu()
    return outputs


def unit_error(unit: ReplayUnit, got: torch.Tensor, want: torch.Tensor, cap: Capture) -> float:
    """Relative error ||got - want|| / ||want|| (inf where ``got`` is not finite, has another shape, or
    ``want`` is zero and ``got`` is not). A ``residual`` unit (a decoder layer, whose output carries its
    input along) is measured against what the layer adds: ||got - want|| / ||want - input||."""
    if got.shape != want.shape:
        return float("inf")
    scale = float((want - _layer_input(cap)).norm() if unit.residual else want.norm())
    return _relative(float((got - want).norm()), scale)


def module_errors(units: list[ReplayUnit], captures: dict[str, Capture], exported: dict[str, Any]) -> dict[str, float]:
    """Each unit's relative error (``unit_error``) against the source's own output, keyed by capture."""
    outputs = unit_outputs(units, captures, exported)
    return {unit.key: unit_error(unit, got, captures[unit.key].output, captures[unit.key])
            for unit, got in outputs.items()}


def _relative(diff: float, scale: float) -> float:
    if math.isnan(diff):  # NaN where the export's output is: an error, never a pass
        return float("inf")
    if scale > 0:
        return diff / scale
    return 0.0 if diff == 0 else float("inf")


def _run_unit(unit: ReplayUnit, captures: dict[str, Capture], exported: dict[str, Any],
              dtype: torch.dtype | None = None) -> torch.Tensor | None:
    cap, module = captures[unit.key], exported[unit.module]
    device = _device(module)
    args, kwargs = _to(cap.args, device, dtype=dtype), _to(cap.kwargs, device, dtype=dtype)
    if unit.norm:
        norm_cap = captures[unit.norm]
        hidden = first_tensor(exported[unit.norm](*_to(norm_cap.args, device, dtype=dtype),
                                                  **_to(norm_cap.kwargs, device, dtype=dtype)))
        swapped = None if hidden is None else _with_hidden(args, kwargs, hidden)
        if swapped is None:
            return None
        args, kwargs = swapped
    return first_tensor(module(*args, **kwargs))


def _hidden_state(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A module call's hidden state: its first positional tensor, else ``hidden_states=``."""
    import torch

    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    current = kwargs.get("hidden_states")
    return current if isinstance(current, torch.Tensor) else None


def _with_hidden(args: tuple[Any, ...], kwargs: dict[str, Any],
                 hidden: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The call's arguments with its hidden state replaced; None when it has none of that shape."""
    current = _hidden_state(args, kwargs)
    if current is None or current.shape != hidden.shape:
        return None
    if args and args[0] is current:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _layer_input(cap: Capture) -> torch.Tensor | float:
    hidden = _hidden_state(cap.args, cap.kwargs)
    return hidden.float() if hidden is not None and hidden.shape == cap.output.shape else 0.0


def first_tensor(value: Any) -> torch.Tensor | None:  # a tensor, or the first inside a (nested) tuple/list/dict
    import torch

    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, tuple | list) else ()
    for item in items:
        if (found := first_tensor(item)) is not None:
            return found
    return None


def replayable(cap: Capture | None, module: torch.nn.Module | None) -> bool:
    import torch

    if cap is None or module is None or cap.takes_weights:
        return False
    return type(module) is cap.cls or issubclass(cap.cls, torch.nn.Linear | torch.nn.Embedding)


def _callable(module: torch.nn.Module) -> bool:
    import torch

    return not isinstance(module, torch.nn.ModuleList | torch.nn.ModuleDict)


def _device(module: torch.nn.Module) -> torch.device | str:
    for p in module.parameters():
        return p.device
    return "cpu"


def _to(value: Any, device: torch.device | str, copy: bool = False, dtype: torch.dtype | None = None) -> Any:
    """Tensors inside tuples/lists/dicts moved to ``device`` (copied: a later in-place op cannot reach
    them); floating-point ones cast to ``dtype`` when given."""
    import torch

    if isinstance(value, torch.Tensor):
        cast = dtype if dtype is not None and value.is_floating_point() else None
        return value.detach().to(device, dtype=cast, copy=copy)
    if isinstance(value, tuple | list):
        return type(value)(_to(v, device, copy, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device, copy, dtype) for k, v in value.items()}
    return value
