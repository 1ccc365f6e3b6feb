"""Source checkpoints in a legacy tensor layout, matched to the names a Quark export uses.

transformers 5 renames some families' checkpoint tensors on load (Mixtral's
``block_sparse_moe.experts.<e>.w1`` becomes ``mlp.experts`` fused, then Quark's MoE preprocessing
splits it into ``mlp.experts.<e>.gate_proj``; Gemma 3's ``language_model.model.`` becomes
``model.language_model.``) and writes the legacy names back on save; Quark's
export keeps the module names. The same weight under two names is not a missing plus an extra
tensor: source names are aliased to the export's before the checks compare them.
"""

from __future__ import annotations

import dataclasses
import re

# (legacy pattern, export name) pairs, applied in order to a source tensor name.
LEGACY_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),  # Mixtral-style MoE block
    (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
    (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
    (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
    # Gemma-3-style image-text checkpoints: top-level towers move under ``model.``
    (re.compile(r"^language_model\.model\."), "model.language_model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^(vision_tower|multi_modal_projector)\."), r"model.\1."),
)


def export_name(name: str) -> str:
    for pattern, repl in LEGACY_RENAMES:
        name = pattern.sub(repl, name)
    return name


def align_source_names(source: dict, output: dict) -> dict:
    """``source`` keyed by the export's names where only the legacy name differs, and fused 3-D
    expert tensors split per expert where the export holds them per expert; else unchanged."""
    renamed = {}
    for name, info in source.items():
        split = _split_fused_expert(name, info, output)
        if split:
            renamed.update(split)
            continue
        alias = export_name(name)
        use_alias = alias != name and name not in output and alias not in source and _in_output(alias, output)
        renamed[alias if use_alias else name] = dataclasses.replace(info, name=alias) if use_alias else info
    return renamed


_FUSED = re.compile(r"^(?P<experts>.*\.experts(?:\.mlp)?)\.(?P<proj>[a-z0-9_]+?)(?P<bias>_bias)?$")


def _split_fused_expert(name: str, info, output: dict) -> dict | None:
    """A fused expert tensor on disk (gpt-oss ``experts.gate_up_proj`` [E, in, out], DBRX
    ``experts.mlp.w1`` [E*I, H]) -> ``experts.<e>.<proj>.weight`` per expert, as Quark exports it:
    equal slices of the leading dimension, exact byte ranges of the same tensor."""
    m = _FUSED.match(name)
    if not m or len(info.shape) < 2 or name in output:
        return None
    role = "bias" if m["bias"] else "weight"
    names = []
    while f"{m['experts']}.{len(names)}.{m['proj']}.{role}" in output:
        names.append(f"{m['experts']}.{len(names)}.{m['proj']}.{role}")
    if not names or info.shape[0] % len(names):
        return None
    rows = info.shape[0] // len(names)
    shape = tuple(info.shape[1:]) if rows == 1 else (rows, *info.shape[1:])
    if role == "weight" and len(shape) == 2 and (rows == 1 or m["proj"] == "w2"):
        shape = shape[::-1]  # gpt-oss [E, in, out] and DBRX's w2 [E*I, H] store [in, out]; a linear is [out, in]
    per = (info.end - info.start) // len(names)
    return {alias: dataclasses.replace(info, name=alias, shape=shape, start=info.start + e * per,
                                       end=info.start + (e + 1) * per) for e, alias in enumerate(names)}


def _in_output(alias: str, output: dict) -> bool:
    module = alias.rsplit(".", 1)[0]
    return alias in output or f"{module}.weight" in output
