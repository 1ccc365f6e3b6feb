"""Replay units for exports whose algorithm folded scales between modules (AWQ, SmoothQuant).

Such an algorithm divides the output channels of one op (a norm, or a linear such as ``v_proj``)
by s and multiplies the input channels of the linears it feeds by s: together they compute what
the source did, each alone does not. So a module is replayed as the smallest unit that holds every
fold it takes part in, read from the export's ``algo_config.scaling_layers``:

- a linear whose input a norm scaled (``q_proj`` after ``input_layernorm``): the export's norm,
  then the linear, on the norm's input from the source;
- a linear whose output was scaled for the next (``up_proj`` for ``down_proj``): their smallest
  common ancestor (``mlp``), after the export's norm if that ancestor's inputs were scaled by one;
- anything the folds do not explain that way (two norms, a common ancestor that is the decoder
  layer itself, a module the probe did not run): the whole decoder layer, its error relative to
  what the layer adds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quark_ptq_eval.validate.rewrites import LAYER, SCALING


@dataclass(frozen=True)
class ReplayUnit:
    """What one replay compares: ``module``'s output, computed after the export's ``norm`` if any."""

    module: str
    norm: str | None = None
    residual: bool = False  # a decoder layer: its output carries its input along
    capture: str | None = None  # the source call replayed, where it is not the probe's own (experts.py)
    # a linear inside a fold unit, replayed alone on the source's input: only the loader is judged (against the
    # emulation, which takes the same input); its distance from the source is the fold's, not a quantization error
    alone: bool = False

    @property
    def key(self) -> str:
        return self.capture or self.module


def fold_groups(qconfig: dict[str, Any] | None) -> list[tuple[str, list[str]]]:
    """(prev_op, layers) pairs, names relative to a decoder layer, of every scaling algorithm."""
    groups = []
    for algo in (qconfig or {}).get("algo_config") or []:
        if not isinstance(algo, dict) or str(algo.get("name", "")).lower() not in SCALING:
            continue
        for entry in algo.get("scaling_layers") or []:
            if isinstance(entry, dict) and entry.get("prev_op") and entry.get("layers"):
                groups.append((str(entry["prev_op"]), [str(x) for x in entry["layers"]]))
    return groups


def fold_units(targets: list[str], groups: list[tuple[str, list[str]]], owners: set[str],
               replayable: Callable[[str], bool]) -> list[ReplayUnit]:
    """One unit per target (deduplicated); ``replayable(name)`` says a module can be run alone."""
    units: list[ReplayUnit] = []
    for target in targets:
        unit = _unit(target, groups, owners, replayable)
        if unit not in units:
            units.append(unit)
    return units


def _unit(target: str, groups: list[tuple[str, list[str]]], owners: set[str],
          replayable: Callable[[str], bool]) -> ReplayUnit:
    match = LAYER.match(target)
    if not match:
        return ReplayUnit(target)  # embeddings, lm_head: outside the decoder layers no scale is folded
    layer, rel = match.group(1), match.group(2)
    groups = groups + per_expert_folds(rel, groups)
    scope = _scope(rel, groups, lambda r: f"{layer}.{r}" in owners)
    whole_layer = ReplayUnit(layer, residual=True)
    if not scope or not groups:  # no scaling_layers recorded: any module of the layer may be folded
        return whole_layer if replayable(layer) else ReplayUnit(target)
    feeding = {prev for prev, layers in groups for r in layers if _within(r, scope) and not _within(prev, scope)}
    norm = f"{layer}.{feeding.pop()}" if len(feeding) == 1 else None
    if feeding or not replayable(f"{layer}.{scope}") or (norm and not replayable(norm)):
        return whole_layer if replayable(layer) else ReplayUnit(target)
    return ReplayUnit(f"{layer}.{scope}", norm)


def per_expert_folds(rel: str, groups: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """Quark records an expert's own folds with bare names (``up_proj`` -> ``down_proj``): they hold
    inside each expert and shared-experts module, so for ``rel`` they are placed under its parent."""
    out = []
    for prev, layers in groups:
        for name in (prev, *layers):
            if "." not in name and rel.endswith(f".{name}"):
                prefix = rel[: -len(name)]
                out.append((prefix + prev, [prefix + x for x in layers]))
                break
    return out


def _scope(rel: str, groups: list[tuple[str, list[str]]], is_linear: Callable[[str], bool]) -> str:
    """The smallest module holding ``rel`` and every linear it exchanges a folded scale with."""
    scope = rel
    while True:
        widened = scope
        for prev, layers in groups:
            members = [prev, *layers] if is_linear(prev) else []
            if any(_within(m, widened) for m in members):
                for member in members:
                    widened = _common(widened, member)
        if widened == scope:
            return scope
        scope = widened


def _within(name: str, scope: str) -> bool:
    return name == scope or name.startswith(scope + ".")


def _common(a: str, b: str) -> str:
    parts = []
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        parts.append(x)
    return ".".join(parts)
