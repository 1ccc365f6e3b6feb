"""The plan's source reading carried out after the execution gate (plan/source_reading.py).

- an FP8 release -> an exact BF16 copy: every F8_E4M3 weight times its scale as the format defines
  it (each ``[b0, b1]`` block x its ``weight_scale_inv`` entry, or a per-tensor/channel scale),
  computed in float32 and rounded once to BF16; every other tensor copied as it is;
- a gpt-oss MXFP4 release -> an exact BF16 copy: every ``*_blocks`` E2M1 code (two a byte, low
  nibble first) x 2^(its block of 32's E8M0 ``*_scales`` byte - 127), as transformers' gpt-oss
  integration dequantizes it (exact in BF16), stored as transformers holds it ([E, in, out]);
- ``pytorch_model.bin`` -> safetensors, read with ``torch.load(weights_only=True)`` after the
  pickle scan of intake (intake/pickle_scan.py) has refused anything that is not tensor data.

Both go shard by shard into ``<dir>.partial`` (memory bounded by one shard), then config.json
(without the FP8 ``quantization_config``), the other files, a completion mark, and a rename.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Container
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.fsio import read_json
from quark_ptq_eval.base.registry import load
from quark_ptq_eval.base.safetensors_io import INDEX_NAME, weight_files
from quark_ptq_eval.intake.formats import FORMATS
from quark_ptq_eval.plan.source_reading import COMPLETE_MARK

if TYPE_CHECKING:
    import torch

SCALE_NAMES = ("weight_scale_inv", "weight_scale")  # DeepSeek / HF fp8, compressed-tensors
DROPPED = ("input_scale",)  # dynamic-activation releases may carry one; the BF16 copy has no use for it
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def stage_source(reading: dict[str, Any], model_dir: Path, say: Callable[[str], None] = print) -> Path | None:
    """Make the staged copy the plan names (once: a complete copy is reused); returns its dir."""
    from quark_ptq_eval.base.safety import check_free_space

    mode = reading.get("mode")
    if mode in (None, "direct"):
        return None
    dst = Path(reading["source_dir"])
    if (dst / COMPLETE_MARK).is_file():
        return dst
    tmp = dst.with_name(dst.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)  # our own unfinished copy in the work dir from an interrupted run
    check_free_space(dst.parent, int(reading.get("disk_bytes") or 0))
    tmp.mkdir(parents=True)
    if mode == "convert_bin":
        say(f"[quark-ptq-eval] converting pytorch_model.bin to safetensors in {dst}")
        convert_bin(model_dir, tmp)
    else:
        fmt = FORMATS[reading.get("format") or ""]  # a STAGE_BF16 row: its own copy function and label
        say(f"[quark-ptq-eval] writing the exact BF16 copy of the {fmt.release} release to {dst} (shard by shard)")
        load(fmt.stage_copy)(model_dir, tmp)
    _copy_other_files(model_dir, tmp)
    (tmp / COMPLETE_MARK).write_text(json.dumps({"from": str(model_dir), "mode": mode}) + "\n", encoding="utf-8")
    if dst.exists():
        shutil.rmtree(dst)  # an incomplete copy of ours (no mark): replaced
    tmp.rename(dst)
    return dst


# ---- FP8 -> BF16 ---------------------------------------------------------------------------------
def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    """weight x scale as the release defines it: one scale per ``block`` tile, or per tensor/channel."""
    import torch

    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if block and s.dim() == 2 and w.dim() == 2 and s.shape != (w.shape[0], 1):
        b0, b1 = block
        if tuple(s.shape) != (math.ceil(w.shape[0] / b0), math.ceil(w.shape[1] / b1)):
            raise UsageError(f"A weight_scale_inv of shape {list(s.shape)} does not tile a {list(w.shape)} weight in "
                             f"{b0}x{b1} blocks.", "Check the release's files: its scales do not match its weights.")
        s = s.repeat_interleave(b0, 0)[: w.shape[0]].repeat_interleave(b1, 1)[:, : w.shape[1]]
    elif s.dim() == 1 and s.numel() == w.shape[0]:
        s = s.reshape(-1, *([1] * (w.dim() - 1)))  # per output channel
    return (w * s).to(torch.bfloat16)


def _scale_name(name: str, names: Container[str]) -> str | None:
    module = name.rpartition(".")[0]
    return next((f"{module}.{s}" for s in SCALE_NAMES if f"{module}.{s}" in names), None)


def dequantize_fp8_checkpoint(src: Path, dst: Path) -> None:
    config = read_json(src / "config.json", "model config")
    block = (config.get("quantization_config") or {}).get("weight_block_size")

    def convert(f: Any, shard: Path, where: dict[str, Path]) -> dict[str, Any]:
        out = {}
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            if name.rpartition(".")[2] in (*SCALE_NAMES, *DROPPED):
                continue
            t = f.get_tensor(name)
            scale = _scale_name(name, where) if str(t.dtype).removeprefix("torch.") in FP8_DTYPES else None
            if scale:  # the scale may sit in another shard than its weight
                s = f.get_tensor(scale) if where[scale] == shard else _read(where[scale], scale)
                t = dequantize_fp8(t, s, block)
            out[name] = t
        return out

    _write_bf16_copy(src, dst, config, convert)


def _write_bf16_copy(src: Path, dst: Path, config: dict[str, Any],
                     convert: Callable[[Any, Path, dict[str, Path]], dict[str, Any]]) -> None:
    """Each shard through ``convert(open shard, shard, tensor -> shard)`` into ``dst`` under its name, then
    the index (when the release has one) and config.json without its ``quantization_config``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = weight_files(src)
    where = _tensor_shards(shards)
    weight_map: dict[str, str] = {}
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            out = convert(f, shard, where)
        save_file(out, str(dst / shard.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard.name))
        del out
    if (src / INDEX_NAME).is_file():
        _write_index(dst, weight_map)
    config.pop("quantization_config", None)
    for key in ("dtype", "torch_dtype"):  # only the key the release spells: no drift of our making
        if key in config:
            config[key] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _tensor_shards(shards: list[Path]) -> dict[str, Path]:
    from quark_ptq_eval.base.safetensors_io import read_header

    return {n: s for s in shards for n in read_header(s).tensors}


def _read(shard: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(shard), "pt") as f:
        tensor: torch.Tensor = f.get_tensor(name)
        return tensor


def _write_index(dst: Path, weight_map: dict[str, str]) -> None:
    total = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    (dst / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2),
                                  encoding="utf-8")


# ---- MXFP4 (gpt-oss) -> BF16 ---------------------------------------------------------------------
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_ROWS_PER_CHUNK = 1 << 16  # blocks of 32 decoded at a time: bounds the float32 temporaries (8 MiB)


def dequantize_mxfp4(blocks: Any, scales: Any) -> Any:
    """gpt-oss expert blocks [E, out, in/32, 16] (E2M1 codes, two a byte, low nibble first) x
    2^(E8M0 scale - 127) per block of 32 -> the BF16 tensor transformers holds: [E, in, out]."""
    import torch

    if blocks.dim() != 4 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise UsageError(f"MXFP4 blocks of shape {list(blocks.shape)} with scales {list(scales.shape)} are not the "
                         "gpt-oss expert layout ([E, out, in/32, 16] and [E, out, in/32]).",
                         "Check the release's files: only gpt-oss-style expert blocks are read here.")
    *lead, groups, half = blocks.shape
    codes = blocks.reshape(-1, half)
    exponents = scales.reshape(-1, 1).to(torch.int32) - 127
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    out = torch.empty(codes.shape[0], 2 * half, dtype=torch.bfloat16)
    for r0 in range(0, codes.shape[0], MX_ROWS_PER_CHUNK):
        chunk = codes[r0:r0 + MX_ROWS_PER_CHUNK].to(torch.int64)
        values = torch.empty(chunk.shape[0], 2 * half, dtype=torch.float32)
        values[:, 0::2], values[:, 1::2] = lut[chunk & 0x0F], lut[chunk >> 4]
        out[r0:r0 + chunk.shape[0]] = torch.ldexp(values, exponents[r0:r0 + chunk.shape[0]])  # exact in BF16
    return out.reshape(*lead, groups * 2 * half).transpose(-1, -2).contiguous()


def dequantize_mxfp4_checkpoint(src: Path, dst: Path) -> None:
    """Each ``<name>_blocks`` + ``<name>_scales`` pair -> ``<name>`` in BF16, shard by shard; the rest as stored."""

    def convert(f: Any, shard: Path, where: dict[str, Path]) -> dict[str, Any]:
        out = {}
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in where:
                continue  # read with its blocks
            tensor = f.get_tensor(name)
            if name.endswith("_blocks"):
                scale = name.removesuffix("_blocks") + "_scales"
                if scale not in where:
                    raise UsageError(f"The MXFP4 release has {name} but no {scale}.",
                                     "Check the release's files: a shard may be missing or truncated.")
                s = f.get_tensor(scale) if where[scale] == shard else _read(where[scale], scale)
                name, tensor = name.removesuffix("_blocks"), dequantize_mxfp4(tensor, s)
            out[name] = tensor
        return out

    _write_bf16_copy(src, dst, read_json(src / "config.json", "model config"), convert)


# ---- pytorch_model.bin -> safetensors ------------------------------------------------------------
def bin_files(src: Path) -> list[Path]:
    index = src / "pytorch_model.bin.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [src / Path(n).name for n in names]  # base names only: nothing outside the model dir
    return [src / "pytorch_model.bin"]


def convert_bin(src: Path, dst: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from quark_ptq_eval.intake.pickle_scan import scan_pickle

    files = bin_files(src)
    weight_map = {}
    for i, path in enumerate(files, 1):
        scan_pickle(path)  # refuses code in the pickle before torch reads it (intake/pickle_scan.py)
        state = torch.load(path, map_location="cpu", weights_only=True)
        out = {k: v.detach().contiguous().clone() for k, v in state.items()}  # tied tensors share storage
        del state
        name = "model.safetensors" if len(files) == 1 else f"model-{i:05d}-of-{len(files):05d}.safetensors"
        save_file(out, str(dst / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, name))
    if len(files) > 1:
        _write_index(dst, weight_map)
    shutil.copy2(src / "config.json", dst / "config.json")


def _copy_other_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, README ...: byte for byte (weights and config are written above)."""
    skip = {"config.json", INDEX_NAME, "pytorch_model.bin.index.json"}
    for f in src.iterdir():
        if (f.is_file() and f.name not in skip and not f.name.startswith(".")
                and f.suffix not in (".safetensors", ".bin") and not (dst / f.name).exists()):
            shutil.copy2(f, dst / f.name)
