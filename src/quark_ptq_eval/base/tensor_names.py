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
import functools
import re
from collections.abc import Callable, Collection, Mapping

from quark_ptq_eval.base.safetensors_io import TensorInfo

# (legacy pattern, export name) pairs, applied in order to a source tensor name.
LEGACY_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),  # Mixtral-style MoE block
    (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
    (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
    (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
    (re.compile(r"\.block_sparse_moe\.router\.layer\."), ".block_sparse_moe.router."),  # Granite MoE router
    # Gemma-3-style image-text checkpoints: top-level towers move under ``model.``
    (re.compile(r"^language_model\.model\."), "model.language_model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^(vision_tower|multi_modal_projector)\."), r"model.\1."),
)


def export_name(name: str, output: Collection[str] | None = None) -> str:
    """The legacy name rewritten; with ``output``, the first of (all rules, all but the MoE block
    rename) that the export holds (Granite keeps ``block_sparse_moe``, Mixtral's becomes ``mlp``)."""
    candidates = []
    for rules in (LEGACY_RENAMES, LEGACY_RENAMES[1:]):
        alias = name
        for pattern, repl in rules:
            alias = pattern.sub(repl, alias)
        candidates.append(alias)
    if output is not None:
        return next((c for c in candidates if _in_output(c, output)), candidates[0])
    return candidates[0]


def align_source_names(source: Mapping[str, TensorInfo], output: Collection[str],
                       model_type: str | None = None) -> dict[str, TensorInfo]:
    """``source`` (the source's safetensors headers, name -> entry) keyed by the export's names (``output``: the
    export's tensor names, e.g. its headers) where only the legacy name differs, and fused 3-D
    expert tensors split per expert where the export holds them per expert; else unchanged.
    Names still unmatched then go through transformers' own checkpoint renamings for
    ``model_type`` (DeepSeek-V4's ``ffn.*``/``attn.*``/``head``), imported only in that case."""
    renamed = _align(source, output, lambda n: n)
    if model_type and any(n not in output and not _in_output(n, output) for n in renamed):
        rename = _transformers_renamer(model_type)
        if rename is not None:
            renamed = _align(source, output, rename)
    return renamed


def loaded_name(name: str, model_type: str) -> str:
    """The name transformers loads the checkpoint tensor ``name`` under (its renaming rules only)."""
    rename = _transformers_renamer(model_type)
    return rename(name) if rename is not None else name


@functools.cache  # one rule table per model type and process
def _transformers_renamer(model_type: str) -> Callable[[str], str] | None:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        rules = [t for t in get_checkpoint_conversion_mapping(model_type) or [] if isinstance(t, WeightRenaming)]
    except Exception:  # noqa: BLE001 - another transformers: keep the names as they are
        return None
    return (lambda n: rename_source_key(n, rules, [])[0]) if rules else None


def _align(source: Mapping[str, TensorInfo], output: Collection[str],
           pre: Callable[[str], str]) -> dict[str, TensorInfo]:
    renamed: dict[str, TensorInfo] = {}
    for name, info in source.items():
        split = _split_fused_expert(name, info, output) or _split_granite_moe(name, info, output)
        if split:
            renamed.update(split)
            continue
        alias = export_name(name, output)
        if not _in_output(alias, output) and name not in output:
            alias = export_name(pre(name), output)
        use_alias = alias != name and name not in output and alias not in source and _in_output(alias, output)
        renamed[alias if use_alias else name] = dataclasses.replace(info, name=alias) if use_alias else info
    return renamed


_FUSED = re.compile(r"^(?P<experts>.*\.experts(?:\.mlp)?)\.(?P<proj>[a-z0-9_]+?)(?P<bias>_bias)?$")


def _split_fused_expert(name: str, info: TensorInfo, output: Collection[str]) -> dict[str, TensorInfo] | None:
    """A fused expert tensor on disk (gpt-oss ``experts.gate_up_proj`` [E, in, out], DBRX
    ``experts.mlp.w1`` [E*I, H]) -> ``experts.<e>.<proj>.weight`` per expert, as Quark exports it:
    equal slices of the leading dimension, exact byte ranges of the same tensor."""
    m = _FUSED.match(name)
    if not m or len(info.shape) < 2 or name in output:
        return None
    role = "bias" if m["bias"] else "weight"
    names: list[str] = []
    while f"{m['experts']}.{len(names)}.{m['proj']}.{role}" in output:
        names.append(f"{m['experts']}.{len(names)}.{m['proj']}.{role}")
    if not names or info.shape[0] % len(names):
        return None
    rows = info.shape[0] // len(names)
    shape = tuple(info.shape[1:]) if rows == 1 else (rows, *info.shape[1:])
    transposed = role == "weight" and len(shape) == 2 and (rows == 1 or m["proj"] == "w2")
    if transposed:
        shape = shape[::-1]  # gpt-oss [E, in, out] and DBRX's w2 [E*I, H] store [in, out]; a linear is [out, in]
    per = (info.end - info.start) // len(names)
    return {alias: dataclasses.replace(info, name=alias, shape=shape, start=info.start + e * per,
                                       end=info.start + (e + 1) * per, transposed=transposed)
            for e, alias in enumerate(names)}


_GRANITE = re.compile(r"^(?P<moe>.*\.block_sparse_moe)\.(?P<which>input|output)_linear\.weight$")


def _split_granite_moe(name: str, info: TensorInfo, output: Collection[str]) -> dict[str, TensorInfo] | None:
    """Granite MoE: ``input_linear`` [E, 2I, H] holds gate then up rows, ``output_linear`` [E, H, I]
    the down projection; Quark exports ``experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``."""
    m = _GRANITE.match(name)
    if not m or len(info.shape) != 3:
        return None
    projs = ("gate_proj", "up_proj") if m["which"] == "input" else ("down_proj",)
    if f"{m['moe']}.experts.0.{projs[0]}.weight_scale" not in output and \
            f"{m['moe']}.experts.0.{projs[0]}.weight" not in output:
        return None
    experts, rows, cols = info.shape
    part_rows = rows // len(projs)
    part = (info.end - info.start) // (experts * len(projs))
    split = {}
    for e in range(experts):
        for k, proj in enumerate(projs):
            alias = f"{m['moe']}.experts.{e}.{proj}.weight"
            start = info.start + (e * len(projs) + k) * part
            split[alias] = dataclasses.replace(info, name=alias, shape=(part_rows, cols), start=start, end=start + part)
    return split


def _in_output(alias: str, output: Collection[str]) -> bool:
    module = alias.rsplit(".", 1)[0]
    return alias in output or f"{module}.weight" in output
