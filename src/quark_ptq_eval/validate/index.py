"""Sharded checkpoints: ``model.safetensors.index.json``'s ``weight_map`` against each shard's header.

Loaders trust the index to find a tensor: an entry naming the wrong shard, a tensor a shard
holds that the index leaves out, or an entry for a tensor no shard holds all break loading
(or silently load a stale copy), even when every shard on its own is sound.
"""

from __future__ import annotations

import json
from pathlib import Path

from quark_ptq_eval.base.errors import UnsafeInputError
from quark_ptq_eval.base.safetensors_io import INDEX_NAME, TruncatedFileError, read_header
from quark_ptq_eval.validate.registry import CheckInputs
from quark_ptq_eval.validate.report import CheckResult, Finding


def check_index(ctx: CheckInputs) -> CheckResult:
    result = CheckResult("index")
    index = ctx.quantized / INDEX_NAME
    if not index.is_file():
        result.skipped_reason = "the output is a single file (no model.safetensors.index.json)"
        return result
    weight_map = _weight_map(index, result)
    if weight_map is None:
        return result
    held = _shard_contents(ctx.quantized, sorted(set(weight_map.values())), result)
    for name, shard in sorted(weight_map.items()):
        if name not in held:
            result.findings.append(Finding(f"{INDEX_NAME}: {name}", f"maps to {shard} but no shard holds it.",
                                           side="quark", evidence="expected: a tensor in the named shard; "
                                                                  "found: none"))
        elif held[name] != shard:
            result.findings.append(Finding(f"{INDEX_NAME}: {name}", f"maps to {shard} but the tensor is in "
                                                                    f"{held[name]}.", side="quark",
                                           evidence=f"expected (index): {shard}; found: {held[name]}"))
    for name in sorted(held.keys() - weight_map.keys()):
        result.findings.append(Finding(f"{INDEX_NAME}: {name}", f"is in shard {held[name]} but the index does "
                                                                "not list it, so loaders never read it.",
                                       side="quark", evidence="expected: an index entry; found: none"))
    result.stats.update(entries=len(weight_map), shards=len(set(weight_map.values())), tensors_in_shards=len(held))
    return result


def _weight_map(index: Path, result: CheckResult) -> dict[str, str] | None:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        result.findings.append(Finding(INDEX_NAME, "has no valid weight_map object.", side="quark"))
        return None
    return {str(k): v for k, v in weight_map.items()}


def _shard_contents(root: Path, shards: list[str], result: CheckResult) -> dict[str, str]:
    """Tensor name -> the shard file (as the index spells it) that actually holds it."""
    held: dict[str, str] = {}
    for shard in shards:
        try:  # the layout check already refused shards outside the model dir; read only inside
            path = (root / shard).resolve(strict=True)
            if not path.is_relative_to(root.resolve()):
                raise UnsafeInputError(f"{shard} points outside the model directory.")
            names = read_header(path).tensors
        except TruncatedFileError as exc:  # the mapping is the header's; the layout check names the truncation
            names = exc.header.tensors
        except (OSError, UnsafeInputError) as exc:
            result.findings.append(Finding(shard, f"cannot be read: {getattr(exc, 'message', exc)}",
                                           side="environment"))
            continue
        for name in names:
            held.setdefault(name, shard)
    return held
