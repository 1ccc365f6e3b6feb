"""Tier 3's facts about a model, read from its own files: a chat template, a reasoning (thinking) model, its
context length; which lm-eval tasks generate, and the generation budget a reasoning model is given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_TASKS = ["gsm8k"]

GENERATE_TASK_PREFIXES = (
    "gsm8k",
    "math",
    "minerva",
    "humaneval",
    "mbpp",
    "ifeval",
    "bbh",
    "gpqa",
    "aime",
    "drop",
    "triviaqa",
    "nq_open",
    "coqa",
)

REASONING_GEN_TOKS = 32768


def model_traits(model_dir: Path) -> dict[str, Any]:
    """Chat template? Reasoning (thinking) model? Context length? From the model's own files."""
    config = _read_json(model_dir / "config.json")
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    template = str(tok_config.get("chat_template") or "")
    if not template and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8", errors="replace")
    reasoning = "<think>" in template or "enable_thinking" in template
    return {
        "chat": bool(template),
        "reasoning": reasoning,
        "max_model_len": config.get("max_position_embeddings"),
    }


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return data
    except (OSError, json.JSONDecodeError):
        return {}


def is_generation_task(task: str) -> bool:
    return task.startswith(GENERATE_TASK_PREFIXES)


def generation_budget(traits: dict[str, Any], requested: int | None) -> int | None:
    """Reasoning models think before answering: give them room, bounded by their context length."""
    if requested:
        return requested
    if not traits["reasoning"]:
        return None
    limit = traits.get("max_model_len") or REASONING_GEN_TOKS
    return max(1024, min(REASONING_GEN_TOKS, int(limit) - 2048))
