"""The model's context length, and token windows kept within it.

A window longer than the positions the model was trained on (``max_position_embeddings``, or
the longer length a declared RoPE scaling gives) scores positions the model never saw: its
perplexity is meaningless. An explicit longer length is refused naming the limit; a default is
clamped to the limit, with the reason said.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UsageError

NO_SCALING = (None, "default", "none")


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    if "max_position_embeddings" not in config and isinstance(config.get("text_config"), dict):
        inner: dict[str, Any] = config["text_config"]  # multimodal wrappers keep the language model's config inside
        return inner
    return config


def model_context(config: dict[str, Any]) -> tuple[int | None, str]:
    """(context length in tokens, where it comes from); (None, "") when the config does not say."""
    cfg = _text_config(config)
    base = cfg.get("max_position_embeddings")
    if not isinstance(base, int) or base < 1:
        return None, ""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    rope = rope if isinstance(rope, dict) else {}
    factor = rope.get("factor")
    kind = rope.get("rope_type") or rope.get("type")
    if isinstance(factor, int | float) and factor > 1 and kind not in NO_SCALING:
        original = rope.get("original_max_position_embeddings") or base
        scaled = int(original * factor)
        if scaled > base:
            return scaled, f"RoPE scaling {kind} x{factor:g} over {original} positions"
    return base, "max_position_embeddings"


def read_model_config(model_dir: str | Path | None) -> dict[str, Any]:
    """config.json of a local model directory, or {} (no limit known) when it cannot be read; through
    fsio.read_json, which never opens a FIFO or reads an oversized file."""
    from quark_ptq_eval.base.fsio import read_json

    if not model_dir or not (Path(model_dir) / "config.json").exists():
        return {}
    try:
        config = read_json(Path(model_dir) / "config.json", "model config")
    except UsageError:
        return {}
    return config if isinstance(config, dict) else {}


def fit_window(seq_len: int | None, default: int, config: dict[str, Any], flag: str) -> tuple[int, str | None]:
    """The window to use and, when a default was clamped, why. An explicit ``seq_len`` beyond the
    model's context is refused (UsageError) naming the limit."""
    limit, why = model_context(config)
    if seq_len is not None:
        if limit is not None and seq_len > limit:
            raise UsageError(f"{flag} {seq_len} is longer than the model's context of {limit} tokens ({why}).",
                             f"Use {flag} {limit} or less.")
        return seq_len, None
    if limit is not None and default > limit:
        return limit, f"clamped from the default {default} to the model's context of {limit} tokens ({why})"
    return default, None
