"""What the export says each module computes, computed from its files alone, without the loader.

The load check used to hold the loader's output to the *source's*, within a per-format limit measured
on models without outlier channels: on a trained model with one massive channel, per-tensor int8
activations are ~11 % from the source by design, and a correct export failed as a "loader" fault.
Quantization error is the scheme's, not the loader's; telling the two apart needs a third computation.

Here the source model, once its inputs are captured, becomes the export's emulation in place, in
float32:

- each quantized weight decoded from its codes, scales and zero points as the files hold them
  (``decode_blocks.TileReader``: Quark's packing, the same reader the decode check uses);
- every other tensor the export stores, as stored (a norm a scaling algorithm folded, an excluded
  layer);
- each quantized module's input and output fake-quantized as the export's ``quantization_config``
  says, with the export's own static scale tensors (``quantizers.py``).

The loader's module must then agree with the emulation within floating-point rounding, while the
emulation's distance from the source is the quantization error: evidence for Phase 3, never a load
failure. A module that cannot be emulated (a weight format or activation spec not read here, a weight
the model holds under another name) is named in ``skipped`` and judged the old way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.schemes import as_spec_list
from quark_ptq_eval.validate import decode_formats as fmt
from quark_ptq_eval.validate import replay
from quark_ptq_eval.validate.decode_blocks import DecodeTarget, TileReader
from quark_ptq_eval.validate.decode_targets import find_targets
from quark_ptq_eval.validate.decode_weights import values_of
from quark_ptq_eval.validate.expectations import kv_cache_output, module_config
from quark_ptq_eval.validate.folds import ReplayUnit
from quark_ptq_eval.validate.quantizers import ActivationQuantizer, UnsupportedSpec, quantizer_for

if TYPE_CHECKING:
    import numpy as np
    import torch

    from quark_ptq_eval.base.safetensors_io import TensorInfo
    from quark_ptq_eval.validate.registry import CheckInputs
    from quark_ptq_eval.validate.replay import Capture


@dataclass
class Emulation:
    """Which modules the emulated model computes as the export says, and why the others do not."""

    quantized: set[str] = field(default_factory=set)  # weights decoded (and activations quantized)
    skipped: dict[str, str] = field(default_factory=dict)  # quantized module -> why it is not emulated
    activation: dict[str, ActivationQuantizer] = field(default_factory=dict)  # module -> its input quantizer
    output: dict[str, ActivationQuantizer] = field(default_factory=dict)  # module -> its output quantizer
    handles: list[Any] = field(default_factory=list)

    def close(self) -> None:
        """Remove the quantizing hooks (the model is freed next, or reused as the source)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def activations_off(self) -> _Switch:
        """A context in which the activation quantizers pass their input through (weights alone)."""
        return _Switch([*self.activation.values(), *self.output.values()])

    def outputs_off(self) -> _Switch:
        """A context in which only the output quantizers (a KV cache's) pass their input through."""
        return _Switch(list(self.output.values()))


class _Switch:
    def __init__(self, quantizers: list[ActivationQuantizer]):
        self.quantizers = quantizers

    def __enter__(self) -> None:
        for q in self.quantizers:
            q.enabled = False

    def __exit__(self, *exc: object) -> None:
        for q in self.quantizers:
            q.enabled = True


def emulate_export(model: torch.nn.Module, output: dict[str, TensorInfo], source: dict[str, TensorInfo],
                   qconfig: dict[str, Any], roots: list[str] | None = None) -> Emulation:
    """Turn ``model`` (the source, already captured) into the export's emulation, in place, in float32. With
    ``roots`` only the modules under them (a streamed model's loaded part) become the emulation."""
    import torch

    runtime = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    for root in roots if roots is not None else [""]:
        model.get_submodule(root).float()
    emulation = Emulation()
    targets, unchecked = find_targets(output, source, qconfig)
    by_module = {t.module: t for t in targets if _under(t.module, roots)}
    emulation.skipped.update({module: why for name, why in unchecked if _under(module := name.rpartition(".")[0], roots)})
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, param in model.named_parameters():
            module = name.rpartition(".")[0]
            if param.device.type == "meta" or not _under(module, roots):
                continue  # a part the streamed model has not loaded
            if module in by_module and name == f"{module}.weight":
                _set(param, _decode(by_module[module], emulation, module))
            elif name in output and tuple(output[name].shape) == tuple(param.shape) and module not in by_module:
                _set_stored(param, output[name])
    for module in sorted(by_module):
        if module in emulation.skipped or module not in modules:
            emulation.skipped.setdefault(module, "the model holds this weight under another name")
            continue
        try:
            _quantize_activations(modules[module], module, output, qconfig, emulation, runtime)
        except UnsupportedSpec as exc:
            emulation.skipped[module] = str(exc)
            continue
        emulation.quantized.add(module)
    return emulation


def _under(module: str, roots: list[str] | None) -> bool:
    return roots is None or any(module == r or module.startswith(r + ".") or not r for r in roots)


STORED_CHUNK_BYTES = 64 * 2**20  # float32 bytes a stored tensor is copied in at a time


def _set_stored(param: torch.Tensor, info: TensorInfo) -> None:
    """``param`` (float32) set to a tensor as the export stores it, a slice of rows at a time: a 128 k-row BF16
    embedding read whole, then widened, held three copies of itself at once (15 GiB at Llama-3-70B's)."""
    import torch

    flat = param.view(-1)
    row = max(1, flat.numel() // max(1, info.shape[0] if info.shape else 1))
    step = max(1, STORED_CHUNK_BYTES // (4 * row))
    rows = info.shape[0] if info.shape else 1
    for first in range(0, rows, step):
        end = min(rows, first + step)
        values = fmt.as_float(info, fmt.read_rows(info, first, end)).reshape(-1)
        flat[first * row : end * row].copy_(torch.from_numpy(values))


def _set(param: torch.Tensor, values: np.ndarray | None) -> None:
    import torch

    if values is not None and tuple(values.shape) == tuple(param.shape):
        param.copy_(torch.from_numpy(values))


def _decode(t: DecodeTarget, emulation: Emulation, module: str) -> np.ndarray | None:
    """The weight as the export defines it: ``(codes - zero point) * scale``, ``[out, in]`` float32."""
    import numpy as np

    try:
        reader = TileReader(t)
    except fmt.UnsupportedFormat as exc:
        emulation.skipped[module] = str(exc)
        return None
    weight = np.empty((reader.rows, reader.cols), np.float32)
    for tile in reader.tiles():
        rows, groups = tile.scale.shape
        values = values_of(t, tile.codes).reshape(rows, groups, -1)
        weight[tile.r0:tile.r1, tile.c0:tile.c1] = ((values - tile.zero[:, :, None])
                                                     * tile.scale[:, :, None]).reshape(rows, -1)
    return weight


def _quantize_activations(module: torch.nn.Module, name: str, output: dict[str, TensorInfo],
                          qconfig: dict[str, Any], emulation: Emulation, runtime: torch.dtype) -> None:
    """Hooks quantizing the module's input and output as its config and the export's scales say, dividing by
    a static scale in ``runtime``, the dtype the loaded model computes in (the source's)."""
    config = module_config(qconfig, name)
    inputs = as_spec_list(config.input_tensors if config else None)
    outputs = as_spec_list((config.output_tensors if config else None) or kv_cache_output(qconfig, name))
    if len(inputs) > 1 or len(outputs) > 1:
        raise UnsupportedSpec("two-level activation scales")
    pre = quantizer_for(inputs[0], output, f"{name}.input", runtime) if inputs else None
    post = quantizer_for(outputs[0], output, f"{name}.output", runtime) if outputs else None
    if pre is not None:
        emulation.activation[name] = pre
        emulation.handles.append(module.register_forward_pre_hook(_on_input(pre)))
    if post is not None:
        emulation.output[name] = post
        emulation.handles.append(module.register_forward_hook(_on_output(post)))


def _on_input(q: ActivationQuantizer) -> Callable[..., Any]:
    def hook(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (q(args[0]), *args[1:]) if args else args
    return hook


def _on_output(q: ActivationQuantizer) -> Callable[..., Any]:
    def hook(_module: torch.nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
        return q(out) if hasattr(out, "dtype") else out
    return hook


@dataclass
class EmulatedOutputs:
    """What the export says each candidate unit outputs on the probe, with and without its activations
    quantized; keyed by ``unit_key`` (the residual flag only changes how an error is measured)."""

    emulation: Emulation
    outputs: dict[tuple[str, str, str | None], torch.Tensor] = field(default_factory=dict)
    weights_only: dict[tuple[str, str, str | None], torch.Tensor] = field(default_factory=dict)
    # units whose module quantizes its output (a KV cache's k/v projections): the output before that
    # quantizer, where a value within rounding of a grid boundary may land on either side (load_judge.py)
    before_output: dict[tuple[str, str, str | None], torch.Tensor] = field(default_factory=dict)
    # fold units holding several modules (an MLP between its norm and down_proj, under SmoothQuant or AWQ):
    # the emulation's output, with and without activations quantized; a second opinion, never the first
    # (load_judge.py: a composite may compute inside what the emulation does not)
    composite: dict[tuple[str, str, str | None], torch.Tensor] = field(default_factory=dict)
    composite_weights_only: dict[tuple[str, str, str | None], torch.Tensor] = field(default_factory=dict)
    note: str = ""

    def covers(self, unit: ReplayUnit) -> bool:
        """The unit's output is emulated and every quantized module inside it is."""
        inside = unit.module + "."
        return unit_key(unit) in self.outputs and not any(
            name == unit.module or name.startswith(inside) for name in self.emulation.skipped)


def unit_key(unit: ReplayUnit) -> tuple[str, str, str | None]:
    return unit.key, unit.module, unit.norm


def emulate_outputs(ctx: CheckInputs, model: torch.nn.Module, owners: list[str],
                    captures: dict[str, Capture], roots: list[str] | None = None) -> EmulatedOutputs:
    """Turn the source ``model`` into the export's emulation and run every unit the replay may pick on
    it; the model stays the emulation (its hooks installed) until ``emulation.close()``. Before the export
    is loaded its classes are unknown: the candidates are every weight owner and fold unit that is a single
    linear or embedding (``_candidates``)."""
    import torch

    from quark_ptq_eval.validate.rewrites import ROTATING, algorithms

    qconfig, output, source = ctx.qconfig or {}, ctx.tensors("output"), ctx.tensors("source")
    if output is None or source is None:
        return EmulatedOutputs(Emulation(), note="the headers were not read: nothing emulated")
    if set(algorithms(qconfig, ctx.plan)) & ROTATING:
        return EmulatedOutputs(Emulation(), note="a rotation: no module is emulated alone")
    emulation = emulate_export(model, output, source, qconfig, roots)
    modules = dict(model.named_modules())
    units, composites = _candidates(owners, captures, modules, qconfig)
    result = EmulatedOutputs(emulation)
    for unit, out in replay.unit_outputs(composites, captures, modules, torch.float32).items():
        result.composite[unit_key(unit)] = out
    with emulation.activations_off():
        for unit, out in replay.unit_outputs(composites, captures, modules, torch.float32).items():
            result.composite_weights_only[unit_key(unit)] = out
    for unit, out in replay.unit_outputs(units, captures, modules, torch.float32).items():
        result.outputs[unit_key(unit)] = out
    with emulation.activations_off():
        for unit, out in replay.unit_outputs(units, captures, modules, torch.float32).items():
            result.weights_only[unit_key(unit)] = out
    quantizing = [u for u in units if u.module in emulation.output]
    with emulation.outputs_off():
        for unit, out in replay.unit_outputs(quantizing, captures, modules, torch.float32).items():
            result.before_output[unit_key(unit)] = out
    return result


def _candidates(owners: list[str], captures: dict[str, Capture], modules: dict[str, Any],
                qconfig: dict[str, Any]) -> tuple[list[ReplayUnit], list[ReplayUnit]]:
    """(leaves, composites). Leaves: single linears and embeddings (each weight owner, or its fold unit: a
    norm then the linear), held to the emulation. A composite (an attention block, a decoder layer, an
    experts module, DeepSeek-V4's indexer) may compute inside what the emulation does not (the indexer read
    9 %): it is held to the source (load_judge.py); a scaling algorithm's composite fold units are emulated
    too, for the second opinion on one the scheme took far from the source."""
    from quark_ptq_eval.validate.folds import fold_groups, fold_units

    def runs_alone(name: str) -> bool:
        return replay.replayable(captures.get(name), modules.get(name))

    def leaf(unit: ReplayUnit) -> bool:
        return replay.is_leaf(captures.get(unit.key))

    units = [ReplayUnit(owner) for owner in owners if runs_alone(owner)]
    targets = replay.replay_targets(owners, captures, modules)
    groups = fold_groups(qconfig)
    folded = fold_units(targets, groups, set(owners), runs_alone)
    units += [u for u in folded if u not in units]
    # without recorded folds fold_units names every decoder layer: nothing the loader's replay would pick
    composites = [u for u in folded if groups and not leaf(u) and u.key in captures]
    return [u for u in units if leaf(u)], composites
