"""Exclusion patterns written against a checkpoint's tensor names, applied to the names transformers
loads the model under (the names Quark matches patterns against and exports).

Quark 0.13's minimax_m2 template excludes the router as ``*block_sparse_moe.gate*``: the name the
family's checkpoints use (transformers 5 saves it so too). transformers 5 loads that block as
``mlp``, so Quark's export, and the source once aligned to it (tensor_names.py), call the router
``model.layers.N.mlp.gate``: the pattern matches nothing there, the router counted as a layer the
plan quantizes, and validation reported every minimax_m2 export "partial" (router left in BF16).
The template means the router: a source module a pattern matched under its own name stays
excluded under the export's, so it is counted as excluded and held byte-identical (md5) instead.

DeepSeek-V4 is the same case before the export: its template excludes ``head`` (and ``*ffn.gate*``),
the checkpoint's names; transformers loads them as ``lm_head`` (``mlp.gate``), so Quark quantized
the lm_head the template keeps. One mapping serves both sides: validation applies it to the
export's names (validate/registry.py), the engines to the loaded model's before Quark sees the
patterns (``loaded_name_exclusions``: the quark-api child from the model it holds, the quark-cli
plan from transformers' renaming rules).
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase
from os import PathLike

from quark_ptq_eval.base.safetensors_io import TensorInfo, read_model_headers
from quark_ptq_eval.base.tensor_names import align_source_names, loaded_name


def _module(name: str) -> str:
    return name.rpartition(".")[0]


def _renamed_pattern(pattern: str, old: str, new: str) -> str | None:
    """``pattern`` with the renamed part of the module name replaced (None when it holds no such part)."""
    prefix = 0
    while prefix < min(len(old), len(new)) and old[prefix] == new[prefix]:
        prefix += 1
    suffix = 0
    while suffix < min(len(old), len(new)) - prefix and old[-1 - suffix] == new[-1 - suffix]:
        suffix += 1
    start = old.rfind(".", 0, prefix) + 1  # widen to whole dot-separated parts
    end = old.find(".", len(old) - suffix) if suffix else -1
    old_part = old[start:end] if end >= 0 else old[start:]
    new_part = new[start:len(new) - (len(old) - end)] if end >= 0 else new[start:]
    if not old_part or old_part not in pattern:
        return None
    return pattern.replace(old_part, new_part)


def legacy_exclusions(raw: dict[str, TensorInfo], aligned: dict[str, TensorInfo], patterns: list[str]) -> list[str]:
    """Patterns to add so that every module ``patterns`` excluded under its source name stays
    excluded under its aligned (export) name: each pattern with its renamed part replaced, or the
    module's own name where no such rewrite matches it."""
    raw_names = {(t.file, t.start, t.nbytes): name for name, t in raw.items()}
    added: list[str] = []
    for name, info in aligned.items():
        old = raw_names.get((info.file, info.start, info.nbytes))
        if old is None or old == name:
            continue
        old_module, new_module = _module(old), _module(name)
        if any(fnmatchcase(new_module, p) for p in (*patterns, *added)):
            continue
        hit = next((p for p in patterns if fnmatchcase(old_module, p)), None)
        if hit is None:
            continue
        rewritten = _renamed_pattern(hit, old_module, new_module)
        added.append(rewritten if rewritten and fnmatchcase(new_module, rewritten) else new_module)
    return added


def loaded_name_exclusions(model_dir: str | PathLike[str], model_type: str, patterns: list[str],
                           loaded: Iterable[str] | None = None) -> list[str]:
    """Patterns to add to ``patterns`` so that every module they name under ``model_dir``'s tensor
    names stays excluded under its loaded name: the ``loaded`` model's tensor names, or (without the
    model) the names transformers' renaming rules for ``model_type`` give the checkpoint's."""
    if not patterns:
        return []
    raw = read_model_headers(model_dir)
    names = set(loaded) if loaded is not None else {loaded_name(n, model_type) for n in raw}
    return legacy_exclusions(raw, align_source_names(raw, dict.fromkeys(names), model_type), patterns)
