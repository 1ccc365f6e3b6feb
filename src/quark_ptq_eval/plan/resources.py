"""The memory model: what a plan needs from the host (RAM, GPU memory) and from the target (weights +
KV cache), and the output's size on disk.

The engine's peak memory comes from a fit to MEASURED peak RSS of our Quark-API engine child
(``bench/benchmarks/measure_memory.py``; figures and fit in docs/planning.md): a fixed start-up cost plus
multiples of the model's bytes, of one calibration forward's activations and, for AWQ / GPTQ /
SmoothQuant, of the cached layer inputs. Nothing here loads a model: the inputs are the analysis
(config and safetensors headers) and the plan's choices.

Around it: what this host has (``host_memory.py``), whether the plan fits it and what would
(``host_fit.py``), the plan table's rows (``resource_rows.py``) and the checkpoint's rule for a plan
that does not fit (``fit_gate.py``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from quark_ptq_eval.base.sizes import GIB, gb, kv_bytes_per_token_of  # noqa: F401 (gb: callers use resources.gb)
from quark_ptq_eval.intake.formats import FORMATS, release_of

if TYPE_CHECKING:
    from quark_ptq_eval.base.artifacts import ModelAnalysis
    from quark_ptq_eval.base.catalog import SchemeInfo
    from quark_ptq_eval.base.plan_records import DeviceStrategy, PlannedCalibration


@dataclass(frozen=True)
class QuantizeWorkload:
    """What the engine is asked to do: the model (its analysis), the scheme and its catalog ``info``,
    the algorithm, the calibration, the device strategy and the KV scheme."""

    analysis: ModelAnalysis
    scheme: str
    info: SchemeInfo
    algorithm: str | None
    calibration: PlannedCalibration
    device: DeviceStrategy
    kv: str | None = None


# ---- measured scaling (bench/benchmarks/measure_memory.py on the CPU engine; see docs/planning.md) ----------
BASE_BYTES = 1.15 * GIB  # python + torch + transformers + quark.torch imported, tokenizer loaded (docs/planning.md)
WEIGHT_FACTOR = 2.0  # peak / model bytes for plain PTQ: model, its quantized copy at freeze, export
ACT_FACTOR = 1.0  # x one calibration forward's live activations (fp32); modelled, not fitted
# Algorithms: extra multiples of the model bytes and of the cached calibration inputs (modelled).
ALGO_WEIGHT_FACTOR = {"awq": 1.0, "gptq": 0.5, "smoothquant": 0.3, "autosmoothquant": 0.3, "rotation": 1.0}
ALGO_CACHE_FACTOR = {"awq": 2.0, "gptq": 2.0, "smoothquant": 0.0}
OTHER_ALGO_WEIGHT_FACTOR = 1.0  # algorithms not measured here: assume like AWQ
MODELLED_GPU_FACTOR = 1.3  # GPU engine: weights + quantized copy in flight (modelled, not measured)
SEQ_EXIT_FACTOR = 1.0  # the exit's embedding and lm_head as read (bench/benchmarks/bench_sequential.py)
SEQ_FEED_COPIES = 4  # the sequential engine's hidden states: in and out, an algorithm's and calibration's phases
HEADROOM = 0.9  # plan for at most 90 % of a memory, never all of it
EVAL_LOGIT_COPIES = 3  # logits, log-softmax and the baseline's logits live together in Tier 1
EVAL_LOGIT_BUDGET = 64 * 2**20  # elements per batch (evaluate.ppl.tier.LOGIT_BUDGET on CPU)
# The file-to-file engine (bench/benchmarks/bench_file2file.py): python + torch + quark.torch, no model, then the
# largest shard as read, its quantized copy and the bytes being written, one shard at a time.
F2F_BASE_BYTES = 1.05 * GIB
F2F_SHARD_FACTOR = 2.0
F2F_RECOVERY_BYTES_PER_FP8_BYTE = 4.0  # an FP8 shard recovered to float32 before it is quantized (modelled)


# ---- what the model is made of -------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """The dimensions of the analysis' architecture (config.json) the memory model reads; 0 where it is silent."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool


def model_shape(analysis: ModelAnalysis) -> ModelShape:
    a = analysis.architecture

    def dim(key: str) -> int:
        return int(a.get(key) or 0)

    return ModelShape(dim("hidden_size"), dim("vocab_size"), dim("num_hidden_layers"), dim("num_attention_heads"),
                      dim("num_key_value_heads"), dim("intermediate_size"), bool(a.get("tie_word_embeddings")))


def param_count(analysis: ModelAnalysis) -> int:
    """Parameters from the safetensors headers, else from config.json (dense Llama-style formula)."""
    if analysis.size.get("params"):
        return int(analysis.size["params"])
    a = model_shape(analysis)
    embeds = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
    return quantizable_params(analysis) + embeds


def quantizable_params(analysis: ModelAnalysis) -> int:
    """Parameters of the decoder's linear layers (what a scheme quantizes; lm_head is a template exclusion)."""
    a = model_shape(analysis)
    h, layers = a.hidden_size, a.num_hidden_layers
    heads = a.num_attention_heads or 1
    kv = a.num_key_value_heads or heads
    inter = a.intermediate_size or 4 * h
    per_layer = 2 * h * h + 2 * h * (h // heads) * kv + 3 * h * inter
    linear = layers * per_layer
    total = int(analysis.size.get("params") or 0)
    if total:
        linear = min(linear, max(total - a.vocab_size * h, 0))
    return linear


def bytes_per_param(analysis: ModelAnalysis) -> float:
    params = param_count(analysis)
    return analysis.size["bytes"] / params if params and analysis.size.get("bytes") else 2.0


def weight_bits(scheme: str, info: SchemeInfo) -> float:
    """Stored bits per quantized weight, scales included (MX: one E8M0 per 32; NVFP4: one FP8 per 16)."""
    bits = float(info.get("weight_bits") or 16)
    if scheme.startswith(("mxfp", "mx", "amdfp4")):
        return bits + 8 / 32
    if scheme.startswith(("nvfp4", "fp4_block16")):
        return bits + 8 / 16
    group = re.search(r"_(\d+)$", scheme)
    if group:
        return bits + 16 / int(group.group(1))  # one BF16 scale per group
    return bits


def output_bytes(analysis: ModelAnalysis, scheme: str, info: SchemeInfo) -> int:
    """The quantized checkpoint's size on disk: quantized linears at the scheme's bits + everything else
    as the engine writes it. With the source's header counts (intake/formats.py): the template's linears
    from their shapes, the rest at its bytes once read (FP8 layers left out are written dequantized to
    BF16 by both engines; Quark's file-to-file keeps them FP8 only when asked, which we do not)."""
    fmt = getattr(analysis, "source_format", None) or {}
    if fmt.get("quantizable_params") is not None and fmt.get("rest_read_as_bytes") is not None:
        return int(fmt["quantizable_params"] * weight_bits(scheme, info) / 8 + fmt["rest_read_as_bytes"])
    q = quantizable_params(analysis)
    rest = max(param_count(analysis) - q, 0)
    return int(q * weight_bits(scheme, info) / 8 + rest * bytes_per_param(analysis))


def loaded_bytes(analysis: ModelAnalysis) -> int:
    """The model's bytes once read in its float dtype (an FP8 source is read as BF16, scales dropped)."""
    return int(analysis.size.get("read_as_bytes") or analysis.size["bytes"] or param_count(analysis) * 2)


def output_basis(analysis: ModelAnalysis | None) -> str:
    """What :func:`output_bytes` counted, in words (the plan table's reason for the output size)."""
    fmt = getattr(analysis, "source_format", None) or {}
    if fmt.get("quantizable_params") is None or not fmt.get("prequantized_tensors"):
        return "quantized linears at the scheme's bits (scales included), the rest in the source dtype"
    return (f"{fmt['quantizable_params']:,} parameters of the template's linears (header shapes) at the scheme's "
            f"bits, scales included; the rest ({gb(fmt['rest_read_as_bytes'])}) as both engines write it: "
            f"{release_of(fmt.get('name'))} layers left out dequantized to BF16")


# ---- the engine ----------------------------------------------------------------------------------
def calibration_activation_bytes(analysis: ModelAnalysis, calibration: PlannedCalibration) -> int:
    """Live tensors of one calibration forward (fp32): hidden states, MLP intermediates and logits."""
    a = model_shape(analysis)
    tokens = calibration.batch_size * calibration.seq_len
    width = 4 * a.hidden_size + 2 * a.intermediate_size + a.vocab_size
    return int(tokens * width * 4)


def calibration_cache_bytes(analysis: ModelAnalysis, calibration: PlannedCalibration) -> int:
    """Every calibration sample's input to one decoder layer, as AWQ/GPTQ keep them (model dtype)."""
    h = model_shape(analysis).hidden_size
    return int(calibration.tokens * h * bytes_per_param(analysis))


def estimate_quantize(analysis: ModelAnalysis, info: SchemeInfo, algorithm: str | None, calibration: PlannedCalibration, device: str) -> dict[str, Any]:
    """Peak host RAM (and GPU memory on a GPU device) of the engine for this plan, with its terms."""
    w = loaded_bytes(analysis)
    act = calibration_activation_bytes(analysis, calibration)
    algos = [a for a in (algorithm or "").split(",") if a]
    algo_w = sum(ALGO_WEIGHT_FACTOR.get(a, OTHER_ALGO_WEIGHT_FACTOR) for a in algos)
    cache = calibration_cache_bytes(analysis, calibration) * sum(ALGO_CACHE_FACTOR.get(a, 0.0) for a in algos)
    work = (WEIGHT_FACTOR + algo_w) * w + ACT_FACTOR * act + cache
    if device == "cpu":
        return {"host_peak_bytes": int(BASE_BYTES + work), "gpu_peak_bytes": 0, "model_bytes": w,
                "terms": {"start-up": BASE_BYTES, "weights": (WEIGHT_FACTOR + algo_w) * w,
                          "calibration activations": ACT_FACTOR * act, "algorithm cache": cache},
                "basis": "measured"}
    # On a GPU the model is read into host RAM once, then moved: the work happens on the device.
    gpu = (MODELLED_GPU_FACTOR + algo_w) * w + ACT_FACTOR * act + cache
    return {"host_peak_bytes": int(BASE_BYTES + w), "gpu_peak_bytes": int(gpu), "model_bytes": w,
            "terms": {"start-up": BASE_BYTES, "weights": (MODELLED_GPU_FACTOR + algo_w) * w,
                      "calibration activations": ACT_FACTOR * act, "algorithm cache": cache},
            "basis": "modelled (GPU not measured here)"}


def largest_shard_bytes(analysis: ModelAnalysis) -> int:
    """The biggest safetensors file of a local model (the file-to-file engine holds one at a time);
    the whole model when its files are not here to measure."""
    from quark_ptq_eval.base.safetensors_io import weight_files

    path = analysis.model.get("model_path")
    try:
        sizes = [f.stat().st_size for f in weight_files(path)] if path else []
    except OSError:
        sizes = []
    return max(sizes) if sizes else (analysis.size["bytes"] or int(param_count(analysis) * 2))


def estimate_file2file(analysis: ModelAnalysis, device: str) -> dict[str, Any]:
    """Peak memory of Quark's file-to-file engine: start-up plus a multiple of the largest shard; an FP8
    source adds the shard's recovery buffer (Quark dequantizes FP8 weights to float32: 4 bytes a parameter)."""
    shard = largest_shard_bytes(analysis)
    work = F2F_SHARD_FACTOR * shard
    terms = {"start-up": F2F_BASE_BYTES, "largest shard": work}
    fmt = (getattr(analysis, "source_format", None) or {}).get("name")
    if isinstance(fmt, str) and fmt in FORMATS and FORMATS[fmt].fp8_weights:
        terms["FP8 recovery buffer"] = F2F_RECOVERY_BYTES_PER_FP8_BYTE * shard
        work += terms["FP8 recovery buffer"]
    if device == "cpu":
        return {"host_peak_bytes": int(F2F_BASE_BYTES + work), "gpu_peak_bytes": 0, "model_bytes": shard,
                "terms": terms, "basis": "measured (file-to-file: one shard at a time)"}
    return {"host_peak_bytes": int(F2F_BASE_BYTES + shard), "gpu_peak_bytes": int(work), "model_bytes": shard,
            "terms": terms, "basis": "modelled (file-to-file on a GPU: not measured here)"}


def estimate_sequential(analysis: ModelAnalysis, algorithm: str | None, calibration: PlannedCalibration) -> dict[str, Any]:
    """Peak host RAM of the sequential engine: start-up, the larger of one decoder block (times the whole-model
    engine's factors: the block, its quantized copy, its export) and the exit's parts (embedding and lm_head held
    together; lm_head excluded by the templates, so no quantized copy), one block's calibration forward, and the
    hidden states kept between blocks. Measured: 5.21 GiB on a 2-block Llama-3-70B-shaped source (docs/planning.md)."""
    arch = model_shape(analysis)
    layers = max(1, arch.num_hidden_layers or 1)
    per = bytes_per_param(analysis)
    edge = int(arch.vocab_size * arch.hidden_size * per)
    edges = edge * (1 if arch.tie_word_embeddings else 2)
    block = max(0, loaded_bytes(analysis) - edges) / layers
    algos = [a for a in (algorithm or "").split(",") if a]
    factor = WEIGHT_FACTOR + sum(ALGO_WEIGHT_FACTOR.get(a, OTHER_ALGO_WEIGHT_FACTOR) for a in algos)
    held = max(factor * block, SEQ_EXIT_FACTOR * edges)
    act = calibration_activation_bytes(analysis, calibration)
    feeds = SEQ_FEED_COPIES * calibration_cache_bytes(analysis, calibration)
    terms = {"start-up": BASE_BYTES, "one part": held, "calibration activations": act, "hidden states kept": feeds}
    return {"host_peak_bytes": int(BASE_BYTES + held + act + feeds), "gpu_peak_bytes": 0, "model_bytes": int(block),
            "terms": terms, "basis": "modelled (the sequential engine: one block at a time)"}


def engine_estimate(engine: str | None, analysis: ModelAnalysis, info: SchemeInfo, algorithm: str | None, calibration: PlannedCalibration,
                    device: str) -> dict[str, Any]:
    from quark_ptq_eval.plan.engines import holds_one_block, holds_one_shard

    if holds_one_shard(engine):
        return estimate_file2file(analysis, device)
    if holds_one_block(engine):
        return estimate_sequential(analysis, algorithm, calibration)
    return estimate_quantize(analysis, info, algorithm, calibration, device)


def estimate_eval(analysis: ModelAnalysis, out_bytes: int, baseline: bool = False, seq_len: int = 2048) -> dict[str, Any]:
    """Tier 1 on the CPU: the quantized model held dequantized (its source size), the baseline when
    asked, and the logits of one batch (evaluate.ppl.tier caps a batch at EVAL_LOGIT_BUDGET elements)."""
    w = loaded_bytes(analysis)
    vocab = model_shape(analysis).vocab_size
    logits = min(EVAL_LOGIT_BUDGET, max(seq_len * vocab, 1)) * 4 * EVAL_LOGIT_COPIES
    peak = BASE_BYTES + w + (w if baseline else 0) + logits
    return {"host_peak_bytes": int(peak), "model_bytes": w, "baseline": baseline, "logits_bytes": logits}


# The streamed Tier 1 (evaluate/ppl/stream.py; measured by bench/benchmarks/bench_stream_tier1.py, docs/streamed_tier1.md):
# start-up, one decoder block of each model as loaded, the larger of one embedding or lm_head, the hidden states
# of the windows held (at most STREAM_STATE_BYTES, more windows go in chunks), a linear dequantized in its
# forward, and one batch's logits.
STREAM_STATE_BYTES = 3 * GIB  # evaluate.ppl.stream.STATE_BUDGET


def estimate_eval_streamed(analysis: ModelAnalysis, out_bytes: int, seq_len: int = 2048,
                           windows: int | None = None) -> dict[str, Any]:
    """Tier 1 streamed one decoder block at a time, with the baseline (the models are never held whole).
    ``windows``: the windows scored (None: as many as fill a chunk, the most that is ever held)."""
    arch = model_shape(analysis)
    layers = max(1, arch.num_hidden_layers or 1)
    hidden, vocab = arch.hidden_size, arch.vocab_size
    inter = arch.intermediate_size or hidden * 4
    per = bytes_per_param(analysis)
    edge = int(vocab * hidden * per)  # one embedding or lm_head
    edges = edge * (1 if arch.tie_word_embeddings else 2)
    w = loaded_bytes(analysis)
    source_block = max(0, w - edges) / layers
    export_block = max(0, out_bytes - edges) / layers
    per_window = seq_len * hidden * per * 2 * 2  # both models' hidden states, and a block's output beside them
    states = STREAM_STATE_BYTES if windows is None else min(STREAM_STATE_BYTES, windows * per_window)
    logits = min(EVAL_LOGIT_BUDGET, max(seq_len * vocab, 1)) * 4 * EVAL_LOGIT_COPIES
    fixed = BASE_BYTES + max(source_block + export_block, edge) + hidden * inter * per + logits
    return {"host_peak_bytes": int(fixed + states), "model_bytes": w, "baseline": True, "logits_bytes": logits,
            "streamed": True, "block_bytes": int(source_block + export_block), "fixed_bytes": int(fixed),
            "per_window_bytes": int(per_window)}


# ---- the target ----------------------------------------------------------------------------------
def kv_bytes_per_token(analysis: ModelAnalysis, kv_scheme: str | None) -> int:
    return kv_bytes_per_token_of(analysis.architecture, kv_scheme)  # the formula vLLM's sizing shares


class ServingBudget(TypedDict):
    """The serving budget a goal states (plan.json's ``target.budget``; plan/targets.py reads it from the goal)."""

    devices: int
    context: int  # tokens
    batch: int


@dataclass(frozen=True)
class ServingFit:
    """Weights + KV cache against the serving budget on the target's devices (plan.json's ``target.serving_fit``;
    compare reports whether a measured export fits)."""

    weights_bytes: int
    kv_cache_bytes: int
    context: int  # tokens
    batch: int
    device_memory_gb: float  # one device, vendor GB; 0: no device (this host's RAM)
    devices_needed: int | None  # a power of two (tensor parallelism); None without a device
    fits_budget: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def serving_fit(analysis: ModelAnalysis, out_bytes: int, kv_scheme: str | None, memory_gb: float,
                budget: ServingBudget | None) -> ServingFit:
    """Weights + KV cache at the budget's context and batch on one device of ``memory_gb`` (vendor GB)."""
    budget = budget or {"devices": 1, "context": 4096, "batch": 1}
    kv = kv_bytes_per_token(analysis, kv_scheme) * budget["context"] * budget["batch"]
    need = out_bytes + kv
    per_device = memory_gb * 1e9 * HEADROOM
    devices = max(1, math.ceil(need / per_device)) if per_device else None
    tp = 1 << (devices - 1).bit_length() if devices else None  # tensor parallelism goes in powers of two
    return ServingFit(out_bytes, kv, budget["context"], budget["batch"], memory_gb, tp,
                      bool(per_device) and need <= per_device * budget["devices"])


def serving_text(fit: ServingFit, label: str, kv: str | None) -> str:
    what = (f"weights {gb(fit.weights_bytes)} + {(kv or 'BF16').upper()} KV cache {gb(fit.kv_cache_bytes)} "
            f"at {fit.context} tokens x batch {fit.batch} on {label}")
    if not fit.devices_needed:
        return f"{what}: that much memory on the serving host"
    return f"{what} ({fit.device_memory_gb:g} GB, {HEADROOM:.0%} usable): {fit.devices_needed} device(s)"
