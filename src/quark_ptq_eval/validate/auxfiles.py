"""Check 2: every non-weight file of the source present in the output and unchanged.

Files are compared by SHA-256 (size only above ``max_hash_bytes``). A changed file is benign
drift when it still means the same thing: a tokenizer re-saved with the same vocabulary,
merges, added and special tokens and chat template, or a JSON file that differs only by
version stamps and renamed keys. Files the export writes itself (weights, index,
``config.json``) are left to the other checks; the top-level ``README.md`` is the model card,
ours on the export's side (written by the recipe's last step) and the base model's on the
source's: neither is compared, so the card is never reported as drift nor "fixed" back.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from quark_ptq_eval.validate.configdiff import JsonDiff, benign_reason, triage_json
from quark_ptq_eval.validate.report import CheckResult, Finding
from quark_ptq_eval.validate.tokenizer_content import (
    describe,
    differing_aspects,
    is_tokenizer_file,
    tokenizer_content,
)

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.ckpt", "*.gguf", "*.msgpack", "*.onnx", "*.pb", "*.pt", "*.pth",
                   "config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
OWN_FILES = ("README.md",)  # top-level files each side holds about itself (the model card)
IGNORED_DIRS = frozenset({".git", "__pycache__", ".ipynb_checkpoints", ".cache", ".venv", "node_modules"})
MAX_HASH_BYTES = 256 * 1024 * 1024
MAX_JSON_BYTES = 64 * 1024 * 1024


@dataclass
class AuxComparison:
    missing: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    size_only: list[str] = field(default_factory=list)
    compared: int = 0


def auxiliary_files(model_dir: Path) -> list[str]:
    """Relative POSIX paths of the non-weight files under ``model_dir`` (no symlinks followed out)."""
    files = []
    for path in sorted(model_dir.rglob("*")):
        rel = path.relative_to(model_dir)
        if any(part in IGNORED_DIRS for part in rel.parts) or not path.is_file() or rel.as_posix() in OWN_FILES:
            continue
        if not any(fnmatch.fnmatchcase(rel.name, p) or fnmatch.fnmatchcase(rel.as_posix(), p) for p in WEIGHT_PATTERNS):
            files.append(rel.as_posix())
    return files


def compare_files(source: Path, output: Path, max_hash_bytes: int = MAX_HASH_BYTES) -> AuxComparison:
    src, out = set(auxiliary_files(source)), set(auxiliary_files(output))
    cmp = AuxComparison(missing=sorted(src - out), extra=sorted(out - src))
    for rel in sorted(src & out):
        a, b = source / rel, output / rel
        cmp.compared += 1
        if a.stat().st_size != b.stat().st_size:
            cmp.changed.append(rel)
        elif a.stat().st_size > max_hash_bytes:
            cmp.size_only.append(rel)
        elif _sha256(a) != _sha256(b):
            cmp.changed.append(rel)
    return cmp


def check_aux(source: Path, output: Path, max_hash_bytes: int = MAX_HASH_BYTES) -> CheckResult:
    result = CheckResult("aux")
    cmp = compare_files(source, output, max_hash_bytes)
    tokenizer_drift, tokenizer_summary = _tokenizer_drift(source, output, cmp)
    for rel in cmp.missing:
        result.findings.append(_missing(rel, tokenizer_drift))
    for rel in cmp.changed:
        result.findings.append(_changed(source, output, rel, tokenizer_drift, tokenizer_summary))
    result.stats.update(source_files=cmp.compared + len(cmp.missing), missing=len(cmp.missing),
                        changed=len(cmp.changed), extra=len(cmp.extra), size_only=len(cmp.size_only))
    result.stats["missing_files"], result.stats["changed_files"] = cmp.missing, cmp.changed
    result.stats["extra_files"], result.stats["size_only_files"] = cmp.extra, cmp.size_only
    result.notes += [f"extra file in the output: {rel}" for rel in cmp.extra]
    result.notes += [f"{rel} is above {max_hash_bytes} bytes: compared by size only" for rel in cmp.size_only]
    return result


def _tokenizer_drift(source: Path, output: Path, cmp: AuxComparison) -> tuple[list[str] | None, str]:
    """(None when both tokenizers mean the same, else the aspects that differ; the output's summary)."""
    touched = [r for r in cmp.missing + cmp.changed + cmp.extra if is_tokenizer_file(r)]
    if not touched:
        return [], ""
    a, b = tokenizer_content(source), tokenizer_content(output)
    return differing_aspects(a, b) or None, describe(b)


def _missing(rel: str, tokenizer_drift: list[str] | None) -> Finding:
    if is_tokenizer_file(rel) and tokenizer_drift is None:
        return Finding(rel, "is missing, but the output's tokenizer files hold the same content.", benign=True,
                       evidence="tokenizer repackaged by a newer transformers")
    what = f"; the output's tokenizer differs in {', '.join(tokenizer_drift)}" if tokenizer_drift else ""
    return Finding(rel, f"is missing from the output{what}.", side="environment",
                   evidence="the file exists in the source; it was not copied (or was removed) after export; "
                            "the fix re-copies it")


def _changed(source: Path, output: Path, rel: str, tokenizer_drift: list[str] | None, summary: str) -> Finding:
    if is_tokenizer_file(rel):
        if tokenizer_drift is None:
            return Finding(rel, "differs byte-wise but the tokenizer is the same.", benign=True,
                           evidence=f"repackaged tokenizer: {summary}")
        return Finding(rel, f"changed: the tokenizer differs in {', '.join(tokenizer_drift)}.", side="environment",
                       evidence="a different tokenizer was saved into the output; the fix re-copies the source's")
    drift = _json_drift(source / rel, output / rel)
    if drift is not None and not drift[0]:
        reasons = sorted({benign_reason(d.path) for d in drift[1]})
        return Finding(rel, "differs only by metadata drift.", benign=True, evidence="; ".join(reasons))
    detail = f" at {', '.join(d.path for d in drift[0][:5])}" if drift else ""
    return Finding(rel, f"differs from the source{detail}.", side="environment",
                   evidence="the output's copy was modified or replaced; the fix re-copies the source's")


def _json_drift(a: Path, b: Path) -> tuple[list[JsonDiff], list[JsonDiff]] | None:
    if a.suffix != ".json" or max(a.stat().st_size, b.stat().st_size) > MAX_JSON_BYTES:
        return None
    try:
        return triage_json(json.loads(a.read_text(encoding="utf-8")), json.loads(b.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1024 * 1024):
            h.update(block)
    return h.hexdigest()
