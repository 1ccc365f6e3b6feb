"""Byte sizes as the plan and reports print them (a base module: the plan's steps share it)."""

from __future__ import annotations

from typing import Any

GIB = 2**30


def gb(n: float | None) -> str:
    """`n` bytes as GiB above one GiB, MiB below; '?' when unknown."""
    if n is None:
        return "?"
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def kv_bytes_per_token_of(config: dict[str, Any], kv_scheme: str | None) -> int:
    """K and V of every layer for one token (the plan's serving fit and vLLM's sizing): one byte an
    element with a KV scheme (FP8), else two (vLLM serves a float32 checkpoint in BF16). A config may
    state its head_dim; else hidden size / heads."""
    heads = config.get("num_attention_heads") or 1
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size") or 0) // heads
    return 2 * (config.get("num_hidden_layers") or 0) * kv * head_dim * (1 if kv_scheme else 2)
