"""Turn a float checkpoint into the layouts two more kinds of release ship, for intake's tests:

- a GPTQ release (AutoGPTQ / GPTQModel, ``checkpoint_format: gptq``): every linear but lm_head as
  ``qweight`` (I32 [in/8, out]: eight 4-bit codes an int32 along the input, the first in the low
  bits), ``qzeros`` (I32 [in/group, out/8]: zero point - 1, packed along the output), ``scales``
  (F16 [in/group, out]) and ``g_idx`` (I32 [in]); everything else in F16, as those releases are;
- a compressed-tensors FP8 release (llm-compressor's FP8_DYNAMIC): F8_E4M3 weights with a
  per-channel ``weight_scale`` [out, 1] in the model's dtype (BF16 here, as llm-compressor writes it
  for a BF16 model), ``quantization_config.format: float-quantized``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

KEPT = ("embed", "norm", "lm_head")  # stay in float in both releases


def _is_linear(name: str, shape: tuple[int, ...]) -> bool:
    return name.endswith(".weight") and len(shape) == 2 and not any(k in name for k in KEPT)


def _pack(codes, axis: int):
    """Eight 4-bit codes an int32 along ``axis`` (the first in the low bits), as GPTQ packs them."""
    import torch

    c = codes.to(torch.int64).movedim(axis, 0)
    c = c.reshape(c.shape[0] // 8, 8, *c.shape[1:])
    packed = sum(c[:, i] << (4 * i) for i in range(8))
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # two's complement into int32
    return packed.to(torch.int32).movedim(0, axis).contiguous()


def gptq_tensors(weight, group: int) -> dict:
    """qweight / qzeros / scales / g_idx of one [out, in] weight (asymmetric round-to-nearest per group)."""
    import torch

    w = weight.to(torch.float32).t()  # GPTQ stores [in, out]
    rows, cols = w.shape
    tiles = w.reshape(rows // group, group, cols)
    lo, hi = tiles.amin(1), tiles.amax(1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = (-lo / scale).round().clamp(0, 15)
    codes = (tiles / scale[:, None] + zero[:, None]).round().clamp(0, 15).reshape(rows, cols)
    return {"qweight": _pack(codes, 0), "qzeros": _pack(zero - 1, 1), "scales": scale.to(torch.float16),
            "g_idx": (torch.arange(rows, dtype=torch.int32) // group)}


def _rewrite(src: Path, dst: Path, convert, quantization_config: dict, dtype: str) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for shard in sorted(src.glob("*.safetensors")):
        out: dict = {}
        for name, t in load_file(shard).items():
            out.update(convert(name, t))
        save_file(out, dst / shard.name, metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config.update(dtype=dtype, quantization_config=quantization_config)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def to_gptq_release(src: Path, dst: Path, group: int = 128) -> Path:
    import torch

    def convert(name: str, t) -> dict:
        if _is_linear(name, tuple(t.shape)):
            module = name.removesuffix(".weight")
            return {f"{module}.{k}": v for k, v in gptq_tensors(t, group).items()}
        return {name: t.to(torch.float16) if t.is_floating_point() else t}

    qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False,
          "checkpoint_format": "gptq"}
    return _rewrite(src, dst, convert, qc, "float16")


def to_ct_fp8_release(src: Path, dst: Path) -> Path:
    import torch

    def convert(name: str, t) -> dict:
        if _is_linear(name, tuple(t.shape)):
            w = t.to(torch.float32)
            scale = (w.abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
            return {name: (w / scale).to(torch.float8_e4m3fn), name + "_scale": scale.to(torch.bfloat16)}
        return {name: t.to(torch.bfloat16) if t.is_floating_point() else t}

    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
          "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"],
                                        "weights": {"type": "float", "num_bits": 8, "strategy": "channel",
                                                    "symmetric": True, "dynamic": False},
                                        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                                              "symmetric": True, "dynamic": True}}}}
    return _rewrite(src, dst, convert, qc, "bfloat16")
