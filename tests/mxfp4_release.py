"""Turn a BF16 gpt-oss checkpoint into the layout OpenAI's gpt-oss releases ship: every fused expert
tensor ``mlp.experts.{gate_up_proj,down_proj}`` ([E, in, out] in BF16) as ``<name>_blocks`` (U8
[E, out, in/32, 16]: E2M1 codes, two per byte, low nibble first) and ``<name>_scales`` (U8 [E, out,
in/32]: one E8M0 exponent per block of 32, biased by 127), and ``quantization_config: {"quant_method":
"mxfp4", "modules_to_not_convert": [...]}``; attention, router, embeddings, biases stay BF16.

transformers 5.16 writes this layout only through its Triton kernels (``quantize_to_mxfp4`` needs
the kernels hub and a GPU), so the conversion is written here (OCP MX: shared exponent
floor(log2(amax)) - 2, each value rounded to the nearest E2M1 value) and checked against
transformers' own ``convert_moe_packed_tensors`` by the tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; code | 8 is the negative value
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize_mxfp4(weight):
    """(blocks U8 [..., out, in/32, 16], scales U8 [..., out, in/32]) of a [..., out, in] weight."""
    import torch

    w = weight.to(torch.float32)
    *lead, cols = w.shape
    tiles = w.reshape(*lead, cols // 32, 32)
    amax = tiles.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - 2, torch.full_like(amax, -127.0))
    exp = exp.clamp(-127, 127)
    scaled = (tiles / torch.exp2(exp)).clamp(-6.0, 6.0)
    lut = torch.tensor(E2M1)
    code = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    code |= (scaled < 0).to(torch.uint8) << 3
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)  # two codes a byte, the first in the low nibble
    return blocks.contiguous(), (exp.squeeze(-1) + 127).to(torch.uint8)


def to_mxfp4_release(src: Path, dst: Path) -> Path:
    """Write the gpt-oss MXFP4 release of the BF16 gpt-oss checkpoint ``src`` to ``dst``."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for shard in sorted(src.glob("*.safetensors")):
        out = {}
        for name, t in load_file(shard).items():
            if name.endswith(EXPERT_TENSORS):  # stored [E, in, out]; the blocks run along ``in``
                out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(t.transpose(1, 2))
            else:
                out[name] = t
        save_file(out, dst / shard.name, metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
