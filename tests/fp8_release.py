"""Turn a BF16 checkpoint into an FP8 block release, exactly as DeepSeek-V3/R1, Kimi-K2, MiniMax-M2 and
Qwen3-*-FP8 ship: every linear weight (attention, MLP, experts; not embeddings, norms, routers or
lm_head) as F8_E4M3 with a ``<name>.weight_scale_inv`` F32 tensor of one scale per 128x128 block
(``[ceil(out/128), ceil(in/128)]``, weight = fp8 value x its block's scale), and
``quantization_config: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}``. Also a ``pytorch_model.bin``-only copy of a checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = (128, 128)
KEPT = ("embed", "norm", "lm_head", "mlp.gate.", "block_sparse_moe.gate.", "router")  # stay BF16 in releases


def is_fp8_linear(name: str, shape: tuple[int, ...]) -> bool:
    return name.endswith(".weight") and len(shape) == 2 and not any(k in name for k in KEPT)


def quantize_block_fp8(weight, block=BLOCK):
    """(F8_E4M3 weight, F32 scale per block) with scale = block amax / 448, as the releases do."""
    import torch

    w = weight.to(torch.float32)
    rows, cols = w.shape
    b0, b1 = block
    scale = torch.empty(math.ceil(rows / b0), math.ceil(cols / b1), dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1]
            s = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (tile / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def to_fp8_release(src: Path, dst: Path, block=BLOCK) -> Path:
    """Write the FP8 block release of the BF16 checkpoint ``src`` to ``dst`` (same shards and files)."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    # Releases keep everything that is not FP8 in BF16 (F32 only what the family keeps in F32): a
    # float32 checkpoint (the trained demo qwen3) is released as BF16 + FP8.
    as_stored = config.get("dtype", config.get("torch_dtype")) != "float32"
    weight_map = {}
    for shard in sorted(src.glob("*.safetensors")):
        out = {}
        for name, t in load_file(shard).items():
            if is_fp8_linear(name, tuple(t.shape)):
                out[name], out[name + "_scale_inv"] = quantize_block_fp8(t, block)
            else:
                out[name] = t if as_stored or not t.is_floating_point() else t.to(torch.bfloat16)
        save_file(out, dst / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard.name))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json",):
            shutil.copy2(f, dst / f.name)
    if (src / "model.safetensors.index.json").is_file():
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "bfloat16"
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def to_bin_only(src: Path, dst: Path) -> Path:
    """The same checkpoint with its weights in ``pytorch_model.bin`` only (older fine-tunes)."""
    import torch
    from safetensors.torch import load_file

    dst.mkdir(parents=True, exist_ok=True)
    state = {}
    for shard in sorted(src.glob("*.safetensors")):
        state.update(load_file(shard))
    torch.save(state, dst / "pytorch_model.bin")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    return dst
