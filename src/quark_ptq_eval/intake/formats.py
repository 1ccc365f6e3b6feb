"""Source formats as a registry: what a checkpoint's weights are, how they are read, what they weigh.

Each row says what the format is, how the recipe reads such a source (``reading``) and, when it is
refused, what to start from instead; which engines read a format themselves is the engines' to say
(their ``reads_sources``, plan/engines). :func:`describe_source` turns
config.json and the safetensors headers (never payloads) into the analysis's ``source_format``:
the format, its true parameter count from header shapes (an FP8 byte is one parameter, an MXFP4
byte two, a packed int32 ``qweight`` of 4-bit codes eight, scale tensors none), the parameters the
template quantizes, and the bytes the model takes once read as BF16 (what a staged copy, a CPU load
and an engine's "the rest" hold), and its label with the scales' real dtypes and granularity.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.registry import Registry, load
from quark_ptq_eval.base.safetensors_io import TensorInfo

# Readings: how the recipe reads the source before an engine sees it (plan/source_reading.py decides).
DIRECT, STAGE_BF16, CONVERT_BIN, REFUSED = "direct", "stage_bf16", "convert_bin", "refused"
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", "_scales", "weight_zero_point", "qzeros",
                  "scales", "g_idx", "weight_shape")  # weight_shape: a packed weight's [out, in] (compressed-tensors)
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
# Packed integer weights: each element holds (its dtype's bits / the format's bits) codes of one linear
# (GPTQ / AWQ ``qweight`` I32, compressed-tensors pack-quantized ``weight_packed`` I32).
PACKED_LEAVES = ("qweight", "weight_packed")
WORD_BITS = {"I32": 32, "U32": 32, "I64": 64, "I16": 16, "U16": 16, "I8": 8, "U8": 8}
NON_LINEAR_HINTS = ("embed", "norm", "wte", "wpe", "rotary")  # as intake/analyze.py
BIN_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class SourceEvidence:
    """What a format's detector reads: config.json's quantization_config, the headers, the files."""

    qc: dict[str, Any]
    method: str  # quantization_config.quant_method, lower-cased ("" without one)
    tensors: dict[str, TensorInfo]
    model_dir: Path | None
    config: dict[str, Any]  # the whole config.json (a format may be marked there)


@dataclass(frozen=True)
class SourceFormat:
    name: str
    summary: str  # without headers; ``label`` once they are read ({granularity}, {dtype}: the scales' own)
    reading: str  # DIRECT, STAGE_BF16, CONVERT_BIN or REFUSED
    detector: str  # "module:function": function(SourceEvidence) -> bool; the first row that answers wins
    refusal: str = ""  # for REFUSED: what is wrong and what to start from
    risk: str = ""  # the analysis's risk line for this format ("" = none)
    fp8_weights: bool = False  # FP8 weights an engine recovers (4 bytes a parameter while it does)
    # STAGE_BF16 rows: the release's label in messages, "module:function(src, dst)" writing the exact BF16
    # copy, the rule it widens each weight by ("" : from the block size) and what transformers cannot load
    release: str = ""
    stage_copy: str = ""
    stage_rule: str = ""
    unloadable: str = "FP8 checkpoints here"
    label: str = ""


def _here(function: str) -> str:
    return f"{__name__}:{function}"


# In detection order: each detector may assume the rows above it did not answer.
FORMATS: Registry[SourceFormat] = Registry("source format", (
    SourceFormat("pytorch_bin", "pytorch_model.bin (PyTorch pickle)", CONVERT_BIN,
                 _here("only_bin_weights"),
                 risk="Only pytorch_model.bin weights: the plan converts them to safetensors in the work dir "
                      "(torch.load(weights_only=True), after the execution gate) and validates against that copy; "
                      "the counts here come from config.json until then."),
    SourceFormat("float", "BF16/FP16/FP32 safetensors", DIRECT, _here("no_quantization")),
    SourceFormat("fp8_block", "FP8 (E4M3) weights with one scale per block (weight_scale_inv), DeepSeek style",
                 STAGE_BF16, _here("fp8_blocks"), fp8_weights=True, release="FP8",
                 stage_copy="quark_ptq_eval.execute.staging:dequantize_fp8_checkpoint",
                 label="FP8 (E4M3) weights with one {dtype} scale per block (weight_scale_inv), DeepSeek style",
                 risk="FP8 block release (the authors' own format): a normal starting point. The plan reads it "
                      "through Quark's file-to-file engine on a GPU host, or through an exact BF16 staging copy "
                      "(each block x its scale) in the work dir for CPU hosts and calibrated schemes."),
    SourceFormat("fp8_tensor", "FP8 (E4M3) weights with a per-tensor or per-channel scale", STAGE_BF16,
                 _here("fp8_per_tensor"), fp8_weights=True, release="FP8",
                 stage_copy="quark_ptq_eval.execute.staging:dequantize_fp8_checkpoint",
                 label="FP8 (E4M3) weights with a {granularity} {dtype} scale",
                 risk="FP8 per-tensor/channel release: a normal starting point, read through an exact BF16 "
                      "staging copy (weight x its scale) or Quark's file-to-file engine on a GPU host."),
    SourceFormat("compressed_tensors", "compressed-tensors (llm-compressor) checkpoint", REFUSED,
                 _here("compressed_other"),
                 refusal="this compressed-tensors format is not staged here; run on a GPU host with "
                         "--engine file2file (Quark decompresses it shard by shard), or start from the model "
                         "it was compressed from"),
    SourceFormat("mxfp4", "MXFP4 weights (gpt-oss *_blocks / *_scales)", STAGE_BF16,
                 _here("mxfp4_blocks"), release="MXFP4",
                 stage_copy="quark_ptq_eval.execute.staging:dequantize_mxfp4_checkpoint",
                 stage_rule="each E2M1 code, two a byte low nibble first, x 2^(its block of 32's E8M0 scale - 127)",
                 unloadable="MXFP4 experts on a CPU (only its Triton kernels or a dequantizing load) for Quark to "
                            "quantize",
                 risk="MXFP4 release (gpt-oss: experts in E2M1 blocks of 32 with E8M0 scales): the plan reads it "
                      "through an exact BF16 staging copy (each E2M1 value x 2^(its block's scale - 127), as "
                      "transformers dequantizes it) in the work dir; re-quantizing MXFP4 weights adds the new "
                      "scheme's rounding to theirs."),
    SourceFormat("int4", "4-bit integer weights (GPTQ / AWQ / bitsandbytes)", REFUSED,
                 _here("four_bit_integers"),
                 refusal="re-quantizing 4-bit integer weights compounds their rounding error; start from the "
                         "BF16 (or FP8) checkpoint they were made from"),
    SourceFormat("quark", "a Quark export", REFUSED, _here("quark_export"),
                 refusal="this model is already a Quark export; quantizing it again compounds the error: start "
                         "from the checkpoint it was made from"),
    SourceFormat("other_quantized", "a pre-quantized checkpoint of a method not read here", REFUSED,
                 _here("any_other_method"),
                 refusal="this quantization method is not read here; start from the unquantized (BF16) or FP8 "
                         "checkpoint"),
))
UNQUANTIZED = "float"  # the row a source without a quantization_config reads as (and an old analysis's default)
INT4_METHODS = ("gptq", "awq", "bitsandbytes", "bnb", "autoround", "hqq", "marlin", "exl2", "aqlm", "eetq")


def quant_config(config: dict[str, Any]) -> dict[str, Any]:
    qc = config.get("quantization_config")
    return qc if isinstance(qc, dict) else {}


def has_bin_weights(model_dir: Path | None) -> bool:
    if model_dir is None:
        return False
    root = Path(model_dir)
    return any((root / n).is_file() for n in BIN_NAMES) or any(root.glob("pytorch_model-*.bin"))


def detect(config: dict[str, Any], tensors: dict[str, TensorInfo] | None, model_dir: Path | None) -> SourceFormat:
    """The format of a source from its config.json, its headers and, without headers, its files."""
    qc = quant_config(config)
    evidence = SourceEvidence(qc, str(qc.get("quant_method", "")).lower() if qc else "", tensors or {}, model_dir, config)
    for fmt in FORMATS.values():
        if load(fmt.detector)(evidence):
            return fmt
    raise AssertionError("the last source format answers for every quantization method")


def only_bin_weights(e: SourceEvidence) -> bool:
    return not e.tensors and has_bin_weights(e.model_dir)


def no_quantization(e: SourceEvidence) -> bool:
    return not e.qc


def fp8_blocks(e: SourceEvidence) -> bool:
    return e.method == "fp8" and bool(e.qc.get("weight_block_size"))


def fp8_per_tensor(e: SourceEvidence) -> bool:
    return e.method == "fp8" or (e.method == "compressed-tensors" and _ct_is_fp8(e.qc))


def compressed_other(e: SourceEvidence) -> bool:
    return e.method == "compressed-tensors" and not _ct_is_int(e.qc)


def mxfp4_blocks(e: SourceEvidence) -> bool:
    return e.method != "compressed-tensors" and (e.method == "mxfp4" or any(n.endswith("_blocks") for n in e.tensors))


def four_bit_integers(e: SourceEvidence) -> bool:
    return (e.method == "compressed-tensors" or e.method in INT4_METHODS or bool(e.qc.get("load_in_4bit"))
            or e.qc.get("bits") == 4)


def quark_export(e: SourceEvidence) -> bool:
    return e.method == "quark"


def any_other_method(e: SourceEvidence) -> bool:
    return True


def _ct_groups(qc: dict[str, Any]) -> list[dict[str, Any]]:
    return [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]


def _ct_is_fp8(qc: dict[str, Any]) -> bool:
    """compressed-tensors float-quantized FP8 weights: one F32 ``weight_scale`` per tensor or channel."""
    weights = [g.get("weights") or {} for g in _ct_groups(qc)]
    return (qc.get("format") in ("float-quantized", "naive-quantized") and bool(weights)
            and all(w.get("type") == "float" and w.get("num_bits") == 8 and w.get("strategy") in ("tensor", "channel")
                    for w in weights))


def _ct_is_int(qc: dict[str, Any]) -> bool:
    return any((g.get("weights") or {}).get("type") == "int" and (g.get("weights") or {}).get("num_bits", 8) <= 4
               for g in _ct_groups(qc))


def is_scale(name: str) -> bool:
    suffix = name.rpartition(".")[2]
    return suffix in SCALE_SUFFIXES or suffix.endswith("_scales")


def release_of(name: str | None) -> str:
    """The source format as messages name it ("FP8", "MXFP4"; "pre-quantized" for a row without a label)."""
    return (FORMATS[name].release if name and name in FORMATS else "") or "pre-quantized"


def is_packed(name: str) -> bool:
    return name.rpartition(".")[2] in PACKED_LEAVES


def packed_bits(qc: dict[str, Any]) -> int:
    """Bits a code of a packed integer weight: ``bits`` (GPTQ / AWQ), the weights' ``num_bits``
    (compressed-tensors), else 4."""
    weights = [g["weights"] for g in _ct_groups(qc) if isinstance(g.get("weights"), dict)]
    bits = qc.get("bits") or next((w.get("num_bits") for w in weights), None)
    return bits if isinstance(bits, int) and 0 < bits <= 8 else 4


def tensor_params(info: TensorInfo, bits: int = 4) -> int:
    """Parameters a tensor holds: its elements; two per byte of packed FP4 blocks; word bits / ``bits``
    per element of a packed integer weight; none for a scale."""
    if is_scale(info.name):
        return 0
    n = math.prod(info.shape)
    if is_packed(info.name):
        return n * WORD_BITS.get(info.dtype, 8) // bits
    return 2 * n if info.name.endswith("_blocks") else n


def read_as_bytes(info: TensorInfo, params: int | None = None) -> int:
    """Bytes once the source is read in BF16 (staged or loaded): quantized weights widen, scales go."""
    if is_scale(info.name):
        return 0
    if info.dtype in FLOAT_BYTES:
        return info.nbytes
    return 2 * (tensor_params(info) if params is None else params)


def exclusion_matcher(excludes: list[str]) -> Callable[[str], bool]:
    """One compiled regex for the template's fnmatch patterns (a real release has ~10^5 tensors)."""
    if not excludes:
        return lambda module: False
    rx = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in excludes))
    return lambda module: rx.match(module) is not None


def is_quantizable(info: TensorInfo, excluded: Callable[[str], bool]) -> bool:
    """A linear weight the template quantizes: 2-D ``*.weight`` (or fused 3-D experts), not an
    embedding or norm, not matched by the exclusions (as intake counts linears)."""
    name = info.name
    fused = (len(info.shape) == 3 or name.endswith("_blocks")) and ".experts." in name  # MXFP4 blocks are 4-D
    linear = (name.endswith(".weight") or is_packed(name)) and len(info.shape) == 2
    if not (linear or fused):
        return False
    return not any(h in name for h in NON_LINEAR_HINTS) and not excluded(name.rpartition(".")[0])


def describe_source(config: dict[str, Any], tensors: dict[str, TensorInfo] | None, model_dir: Path | None,
                    excludes: list[str]) -> dict[str, Any]:
    """The analysis's ``source_format``: the format, how it is read, its true counts from the headers."""
    fmt = detect(config, tensors, model_dir)
    qc = quant_config(config)
    record: dict[str, Any] = {"name": fmt.name, "summary": label(fmt, tensors), "reading": fmt.reading,
                              "quant_method": qc.get("quant_method")}
    if fmt.refusal:
        record["refusal"] = fmt.refusal
    if qc.get("weight_block_size"):
        record["weight_block_size"] = list(qc["weight_block_size"])
    if not tensors:
        return record
    excluded, bits = exclusion_matcher(excludes), packed_bits(qc)
    params = quantizable = read = read_quantizable = prequantized = 0
    for t in tensors.values():  # one pass: a real release has ~10^5 tensors
        n = tensor_params(t, bits)
        b = read_as_bytes(t, n)
        params, read = params + n, read + b
        if n and t.dtype not in FLOAT_BYTES:
            prequantized += 1
        if n and is_quantizable(t, excluded):
            quantizable, read_quantizable = quantizable + n, read_quantizable + b
    record.update(params=params, quantizable_params=quantizable, read_as_bytes=read,
                  rest_read_as_bytes=read - read_quantizable, prequantized_tensors=prequantized)
    return record


def label(fmt: SourceFormat, tensors: dict[str, TensorInfo] | None) -> str:
    """The format's label with what its headers say of the scales ("per-channel BF16"), or its summary."""
    if not (fmt.label and tensors):
        return fmt.summary
    kinds: dict[str, None] = {}
    dtypes: dict[str, None] = {}
    for t in tensors.values():
        scale = tensors.get(t.name + "_scale_inv") or tensors.get(t.name + "_scale")
        if scale is None or not t.dtype.startswith("F8"):
            continue
        n, rows = math.prod(scale.shape), t.shape[0] if t.shape else 1
        kinds[("per-tensor" if n == 1 else "per-channel" if n == rows else "per-block")] = None
        dtypes[scale.dtype] = None
    if not dtypes:
        return fmt.summary
    return fmt.label.format(granularity="/".join(kinds), dtype="/".join(dtypes))
