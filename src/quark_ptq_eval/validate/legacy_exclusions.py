"""Exclusion patterns written against a checkpoint's legacy names, applied to the export's names.

Quark 0.13's minimax_m2 template excludes the router as ``*block_sparse_moe.gate*``: the name the
family's checkpoints use (transformers 5 saves it so too). transformers 5 loads that block as
``mlp``, so Quark's export, and the source once aligned to it (tensor_names.py), call the router
``model.layers.N.mlp.gate``: the pattern matches nothing there, the router counted as a layer the
plan quantizes, and validation reported every minimax_m2 export "partial" (router left in BF16).
The template means the router: a source module a pattern matched under its own name stays
excluded under the export's, so it is counted as excluded and held byte-identical (md5) instead.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from quark_ptq_eval.base.safetensors_io import TensorInfo


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
