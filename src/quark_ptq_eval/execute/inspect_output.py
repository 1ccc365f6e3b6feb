"""Judge an engine's output by what is on disk, never by its exit code alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.fsio import read_json
from quark_ptq_eval.base.safetensors_io import read_model_headers, weight_files
from quark_ptq_eval.execute.file_modes import mode_problems
from quark_ptq_eval.intake.model_files import not_regular

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def inspect_output(out: Path) -> dict[str, Any]:
    """Facts about an output directory and the problems that make it not a usable model."""
    facts: dict[str, Any] = {"dir": str(out), "exists": out.is_dir(), "problems": [], "ok": False}
    if not out.is_dir():
        facts["problems"].append("the output directory does not exist")
        return facts
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    facts["files"] = files
    facts["problems"] += not_regular(out)  # an export holds regular files only: no link leads out of it
    facts["problems"] += mode_problems(out)  # readable as the umask gives, by a server running as another user
    facts["size_bytes"] = sum((out / f).stat().st_size for f in files)
    try:
        shards = weight_files(out)
        tensors = read_model_headers(out) if shards else {}
    except UsageError as exc:
        facts["problems"].append(f"unreadable weights: {exc.message}")
        shards, tensors = [], {}
    facts["shards"] = [s.name for s in shards]
    facts["tensor_count"] = len(tensors)
    if not shards:
        facts["problems"].append("no safetensors shards")
    config_path = out / "config.json"
    try:
        qcfg = read_json(config_path, "config.json").get("quantization_config") if config_path.exists() else None
    except (UsageError, AttributeError):
        qcfg = None
    facts["quant_method"] = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if not config_path.exists():
        facts["problems"].append("no config.json")
    elif not qcfg:
        facts["problems"].append("config.json has no quantization_config")
    facts["tokenizer_files"] = [f for f in TOKENIZER_FILES if f in files]
    if not facts["tokenizer_files"]:
        facts["problems"].append("no tokenizer files")
    facts["ok"] = not facts["problems"]
    return facts
