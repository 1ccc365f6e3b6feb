"""Tiny random instances of every model family, built offline from transformers' config classes.

``AutoConfig.for_model(model_type)`` gives the family's default (full-size) config; ``shrink``
cuts it to 2 layers and small dimensions chosen so every scheme's group size (32) divides each
linear layer's input, keeping the family's structure (experts, shared experts, MLA, hybrid
layers, tied embeddings). Weights are random and seeded; the tokenizer is the demo's.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 128, 256, 4, 2, 32
# Config keys -> the small value they get wherever they appear (top level and every sub-config).
SMALL: dict[str, Any] = {
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2,
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "word_embed_proj_dim": HIDDEN,
    "intermediate_size": INTER, "ffn_dim": INTER, "n_inner": INTER, "ffn_hidden_size": INTER,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "kv_n_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "expert_ffn_hidden_size": 64,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_top_k": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
    "v_head_dim": 32, "rotary_dim": 16, "index_head_dim": 32, "index_n_heads": 2, "index_topk": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16,
    "mamba_n_groups": 1, "block_ff_dim": INTER, "block_dim": HIDDEN,
    "max_position_embeddings": 2048, "max_window_layers": 2, "sliding_window": 64,
    "vision_start_token_id": None,
}
NOT_NONE_ONLY = {"q_lora_rank": 64}  # set only where the family uses it (None means "no low-rank q")
# Keys some families leave None by default and then need (set wherever the config has them).
EVEN_IF_NONE = {"num_experts_per_tok": 2, "head_dim": HEAD_DIM, "indexer_n_heads": 2, "indexer_kv_heads": 1,
                "indexer_head_dim": 32, "indexer_budget": 16, "indexer_compress_ratio": 4}
# Family quirks of the default configs (values their real checkpoints carry).
FAMILY_EXTRA: dict[str, dict[str, Any]] = {
    # mamba_expand * hidden == heads * head dim; real Granite-4 hybrids interleave attention layers
    "granitemoehybrid": {"mamba_n_heads": 8, "layer_types": ["linear_attention", "full_attention"]},
    "gemma4": {"hidden_size_per_layer_input": 32, "num_kv_shared_layers": 0},
    "gemma4_unified": {"hidden_size_per_layer_input": 32, "num_kv_shared_layers": 0},
}
# Families whose per-layer overrides are fixed at construction: built small from the start.
_GEMMA4_TEXT = {"num_hidden_layers": 2, "hidden_size": HIDDEN, "num_attention_heads": HEADS, "head_dim": HEAD_DIM,
                "num_key_value_heads": KV_HEADS, "global_head_dim": HEAD_DIM, "num_global_key_value_heads": KV_HEADS,
                "layer_types": ["sliding_attention", "full_attention"]}
CONSTRUCT: dict[str, dict[str, Any]] = {"gemma4": {"text_config": _GEMMA4_TEXT},
                                        "gemma4_unified": {"text_config": _GEMMA4_TEXT}}
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def shrink(cfg: Any, vocab_size: int, token_ids: dict | None = None, seen: set[int] | None = None) -> None:
    """Shrink ``cfg`` and every nested config in place."""
    seen = seen if seen is not None else set()
    if id(cfg) in seen:
        return
    seen.add(id(cfg))
    fields = vars(cfg)  # read the stored fields: some configs refuse getattr of per-layer values
    for key, value in SMALL.items():
        if fields.get(key) is not None and value is not None:
            setattr(cfg, key, value)
    for key, value in NOT_NONE_ONLY.items():
        if fields.get(key) is not None:
            setattr(cfg, key, value)
    for key, value in EVEN_IF_NONE.items():
        if key in fields:
            setattr(cfg, key, value)
    for key, value in FAMILY_EXTRA.get(getattr(cfg, "model_type", ""), {}).items():
        if key in fields:
            setattr(cfg, key, value)
    if fields.get("kv_lora_rank") is not None:  # MLA: rotary tables are sized by the rope part of a head
        cfg.head_dim = SMALL["qk_rope_head_dim"]
        cfg.num_key_value_heads = cfg.num_attention_heads
        if "qk_head_dim" in fields:
            cfg.qk_head_dim = SMALL["qk_rope_head_dim"] + SMALL["qk_nope_head_dim"]
    if "vocab_size" in fields:
        cfg.vocab_size = vocab_size
    if "vocab_size_per_layer_input" in fields:
        cfg.vocab_size_per_layer_input = vocab_size
    for key in TOKEN_KEYS:
        if key in fields and token_ids is not None:
            setattr(cfg, key, token_ids[key])
    if getattr(cfg, "model_type", "") == "dbrx":  # the default omits what DbrxAttention reads
        attn = cfg.attn_config
        attn.rope_theta = vars(attn).get("rope_theta") or 500000.0
        attn.clip_qkv = vars(attn).get("clip_qkv") or 8.0
    _shrink_layer_lists(cfg)
    for child in list(vars(cfg).values()):
        if hasattr(child, "to_dict") and hasattr(child, "model_type"):
            shrink(child, vocab_size, token_ids, seen)
        elif isinstance(child, dict):
            _shrink_dict(child)


def _shrink_dict(node: dict) -> None:
    for key in list(node):
        if key in SMALL and node[key] is not None and SMALL[key] is not None:
            node[key] = SMALL[key]


def _shrink_layer_lists(cfg: Any) -> None:
    """Per-layer lists keep one layer of each kind the family has (hybrid attention, dense/MoE mixes)."""
    for key in ("layer_types", "mlp_layer_types", "layers_block_type"):
        types = getattr(cfg, key, None)
        if isinstance(types, list) and types:
            first = types[0]
            other = next((t for t in types if t != first), first)
            setattr(cfg, key, [first, other])
    for key in ("mlp_only_layers",):
        if isinstance(getattr(cfg, key, None), list):
            setattr(cfg, key, [])


# Values a config class derives when it reads config.json (DeepSeek-V4: qk_rope_head_dim = head_dim x
# partial_rotary_factor, a runtime-only attribute): a shrunk value would be saved and then read back as another.
DERIVED_ON_LOAD = ("qk_rope_head_dim",)


def _as_read_back(cfg: Any) -> None:
    """Set the derived values to what every loader of the saved config.json will read back."""
    try:
        back = type(cfg).from_dict(cfg.to_dict())
    except Exception:  # noqa: BLE001 - a class that cannot round-trip its own dict derives nothing we fix
        return
    for key in DERIVED_ON_LOAD:
        if key in vars(cfg) and getattr(back, key, None) != getattr(cfg, key):
            setattr(cfg, key, getattr(back, key))


def build_family(model_type: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a tiny random ``model_type`` model with the demo tokenizer to ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(model_type, **copy.deepcopy(CONSTRUCT.get(model_type, {})))
    shrink(config, len(tokenizer), {k: getattr(tokenizer, k) for k in TOKEN_KEYS})
    _as_read_back(config)
    torch.manual_seed(seed)
    # BF16, the dtype the families' releases use (DeepSeek-V4's float32 norms included: base/float32_modules.py)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16)
    model.eval()
    _keep_fp32(model)
    _hash_routes(model, seed)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _keep_fp32(model) -> None:
    """Tensors the family keeps in float32 (DeepSeek-V3's e_score_correction_bias) are stored so,
    as in the family's real checkpoints."""
    import torch

    # only the strict list: the plain one applies to float16 loads, not to bf16 checkpoints
    keep = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if not keep:
        return
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if any(k in name for k in keep) and tensor.is_floating_point():
                tensor.data = tensor.data.float()


def _hash_routes(model, seed: int) -> None:
    """Hash-routed MoE layers (DeepSeek-V4's first ones) pick experts from a token -> experts table the
    checkpoint carries; transformers initialises it to zeros (every token to expert 0, the other experts
    never calibrated), which no release ships: filled as a release's is, each token to distinct experts."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            table = getattr(module, "tid2eid", None)
            if isinstance(table, torch.Tensor) and table.dim() == 2:
                experts = int(getattr(module, "num_experts", table.max() + 1))
                rows = [torch.randperm(experts, generator=gen)[: table.shape[1]] for _ in range(table.shape[0])]
                table.copy_(torch.stack(rows))
