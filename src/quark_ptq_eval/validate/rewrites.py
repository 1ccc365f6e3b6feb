"""Which tensors an algorithm rewrites on purpose, so the byte check does not call that damage.

- AWQ, SmoothQuant (``smooth``, ``autosmoothquant``): fold per-channel scales into the op before
  each scaled linear (``scaling_layers[].prev_op``, usually a norm) and into the linears
  themselves (``layers``). The export's ``algo_config`` lists those names per decoder layer.
- Rotation (QuaRot-style): rotates the embedding, every linear, the head, and folds the norms.
- GPTQ and the other weight-rounding algorithms change only the weights they quantize.

Anything else that differs from the source is a failure.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from typing import Any

SCALING = frozenset({"awq", "smooth", "autosmoothquant"})
ROTATING = frozenset({"rotation", "quarot", "spinquant"})
ALIASES = {"smoothquant": "smooth", "smooth_quant": "smooth"}
FALLBACK_SCALED = ("*norm*",)  # scaling algorithm without its scaling_layers: norms may change
ROTATED = ("*embed*", "*wte*", "lm_head.*", "*norm*", "*_proj.*", "*.fc*", "*.dense*")
LAYER = re.compile(r"^(.*?\.(?:layers|h|blocks|layer)\.\d+)\.(.+)$")


def algorithms(qconfig: dict[str, Any] | None, plan: dict[str, Any] | None) -> list[str]:
    """Algorithm names from the export's ``algo_config`` and the plan's ``algorithm``."""
    names: list[str] = []
    for algo in (qconfig or {}).get("algo_config") or []:
        if isinstance(algo, dict) and algo.get("name"):
            names.append(str(algo["name"]))
    planned = (plan or {}).get("algorithm")
    for name in (planned if isinstance(planned, list) else str(planned or "").split(",")):
        if name:
            names.append(str(name).strip())
    return sorted({ALIASES.get(n.lower(), n.lower()) for n in names})


def rewritten_by(names: list[str], qconfig: dict[str, Any] | None, plan: dict[str, Any] | None) -> dict[str, str]:
    """Tensor name -> the algorithm allowed to rewrite it (first one wins)."""
    allowed: dict[str, str] = {}
    configs = {str(a.get("name", "")).lower(): a for a in (qconfig or {}).get("algo_config") or [] if isinstance(a, dict)}
    for algo in algorithms(qconfig, plan):
        if algo in SCALING:
            scaled = _scaled_ops(configs.get(algo))
            for name in names:
                if _in_scaling_layers(name, scaled):
                    allowed.setdefault(name, algo)
        elif algo in ROTATING:
            for name in names:
                if any(fnmatchcase(name, p) for p in ROTATED):
                    allowed.setdefault(name, algo)
    return allowed


def _scaled_ops(config: dict[str, Any] | None) -> set[str] | None:
    """Relative module names (``input_layernorm``, ``self_attn.o_proj``) a scaling pass touches."""
    layers = (config or {}).get("scaling_layers")
    if not isinstance(layers, list) or not layers:
        return None
    ops: set[str] = set()
    for entry in layers:
        if isinstance(entry, dict):
            ops.add(str(entry.get("prev_op", "")))
            ops.update(str(x) for x in entry.get("layers") or [])
    return ops - {""}


def _in_scaling_layers(name: str, scaled: set[str] | None) -> bool:
    module = name.rpartition(".")[0]
    if scaled is None:
        return any(fnmatchcase(module, p) for p in FALLBACK_SCALED)
    m = LAYER.match(module)
    return m is not None and m.group(2) in scaled
