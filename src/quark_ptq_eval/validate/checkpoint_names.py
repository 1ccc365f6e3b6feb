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


_FUSED = re.compile(r"^(?P<experts>.*\.experts)\.(?P<proj>[a-z_]+?)(?P<bias>_bias)?$")


def _split_fused_expert(name: str, info, output: dict) -> dict | None:
    """``experts.gate_up_proj`` [E, ...] (gpt-oss style, on disk) -> ``experts.<e>.gate_up_proj.weight``,
    one slice of the leading (expert) dimension each: exact byte ranges of the same tensor."""
    m = _FUSED.match(name)
    if not m or len(info.shape) < 2 or name in output:
        return None
    role = "bias" if m["bias"] else "weight"
    first = f"{m['experts']}.0.{m['proj']}.{role}"
    if first not in output:
        return None
    per = (info.end - info.start) // info.shape[0]
    shape = tuple(info.shape[1:])
    out_shape = tuple(output[first].shape)
    if role == "weight" and len(shape) == 2 and out_shape[:1] == shape[1:] and shape[0] != shape[1]:
        shape = shape[::-1]  # stored [in, out] per expert; a linear's weight is [out, in]
    split = {}
    for e in range(info.shape[0]):
        alias = f"{m['experts']}.{e}.{m['proj']}.{role}"
        split[alias] = dataclasses.replace(info, name=alias, shape=shape, start=info.start + e * per,
                                           end=info.start + (e + 1) * per)
    return split


def _in_output(alias: str, output: dict) -> bool:
    module = alias.rsplit(".", 1)[0]
    return alias in output or f"{module}.weight" in output
