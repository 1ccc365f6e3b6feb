"""What a plan needs from the host (RAM, GPU memory, disk) and from the target (weights + KV cache).

The engine's peak memory comes from a fit to MEASURED peak RSS of our Quark-API engine child
(``bench/measure_memory.py``; figures and fit in docs/planning.md): a fixed start-up cost plus
multiples of the model's bytes, of one calibration forward's activations and, for AWQ / GPTQ /
SmoothQuant, of the cached layer inputs. Nothing here loads a model: the inputs are the analysis
(config and safetensors headers), the plan's choices and the env_context.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.sizes import GIB, gb, kv_bytes_per_token_of  # noqa: F401 (gb: callers use resources.gb)
from quark_ptq_eval.intake.formats import FORMATS, release_of

if TYPE_CHECKING:
    from quark_ptq_eval.base.artifacts import ModelAnalysis, QuantPlan
    from quark_ptq_eval.base.gates import Approver


@dataclass(frozen=True)
class Workload:
    """What the engine is asked to do: the model (its analysis), the scheme and its catalog ``info``,
    the algorithm, the calibration, the device strategy ({"device", "multi_device"}) and the KV scheme."""

    analysis: ModelAnalysis
    scheme: str
    info: dict[str, Any]
    algorithm: str | None
    calibration: dict[str, Any]
    device: dict[str, Any] = field(default_factory=lambda: {"device": "cpu", "multi_device": False})
    kv: str | None = None


# ---- measured scaling (bench/measure_memory.py on the CPU engine; see docs/planning.md) ----------
BASE_BYTES = 1.40 * GIB  # python + torch + transformers + quark.torch imported, tokenizer loaded
WEIGHT_FACTOR = 2.0  # peak / model bytes for plain PTQ: model, its quantized copy at freeze, export
ACT_FACTOR = 1.0  # x one calibration forward's live activations (fp32); modelled, not fitted
# Algorithms: extra multiples of the model bytes and of the cached calibration inputs (modelled).
ALGO_WEIGHT_FACTOR = {"awq": 1.0, "gptq": 0.5, "smoothquant": 0.3, "autosmoothquant": 0.3, "rotation": 1.0}
ALGO_CACHE_FACTOR = {"awq": 2.0, "gptq": 2.0, "smoothquant": 0.0}
OTHER_ALGO_WEIGHT_FACTOR = 1.0  # algorithms not measured here: assume like AWQ
MODELLED_GPU_FACTOR = 1.3  # GPU engine: weights + quantized copy in flight (modelled, not measured)
HEADROOM = 0.9  # plan for at most 90 % of a memory, never all of it
EVAL_LOGIT_COPIES = 3  # logits, log-softmax and the baseline's logits live together in Tier 1
EVAL_LOGIT_BUDGET = 64 * 2**20  # elements per batch (evaluate.tier_ppl.LOGIT_BUDGET on CPU)
# The file-to-file engine (bench/bench_file2file.py): python + torch + quark.torch, no model, then the
# largest shard as read, its quantized copy and the bytes being written, one shard at a time.
F2F_BASE_BYTES = 1.05 * GIB
F2F_SHARD_FACTOR = 2.0
F2F_RECOVERY_BYTES_PER_FP8_BYTE = 4.0  # an FP8 shard recovered to float32 before it is quantized (modelled)


# ---- what the model is made of -------------------------------------------------------------------
def _arch(analysis: ModelAnalysis) -> dict[str, Any]:
    return analysis.architecture


def param_count(analysis: ModelAnalysis) -> int:
    """Parameters from the safetensors headers, else from config.json (dense Llama-style formula)."""
    if analysis.size.get("params"):
        return int(analysis.size["params"])
    a = _arch(analysis)
    h, vocab = a.get("hidden_size") or 0, a.get("vocab_size") or 0
    embeds = vocab * h * (1 if a.get("tie_word_embeddings") else 2)
    return quantizable_params(analysis) + embeds


def quantizable_params(analysis: ModelAnalysis) -> int:
    """Parameters of the decoder's linear layers (what a scheme quantizes; lm_head is a template exclusion)."""
    a = _arch(analysis)
    h, layers = a.get("hidden_size") or 0, a.get("num_hidden_layers") or 0
    heads = a.get("num_attention_heads") or 1
    kv = a.get("num_key_value_heads") or heads
    inter = a.get("intermediate_size") or 4 * h
    per_layer = 2 * h * h + 2 * h * (h // heads) * kv + 3 * h * inter
    linear = layers * per_layer
    total = int(analysis.size.get("params") or 0)
    if total:
        vocab = a.get("vocab_size") or 0
        linear = min(linear, max(total - vocab * h, 0))
    return linear


def bytes_per_param(analysis: ModelAnalysis) -> float:
    params = param_count(analysis)
    return analysis.size["bytes"] / params if params and analysis.size.get("bytes") else 2.0


def weight_bits(scheme: str, info: dict[str, Any]) -> float:
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


def output_bytes(analysis: ModelAnalysis, scheme: str, info: dict[str, Any]) -> int:
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


# ---- the engine ----------------------------------------------------------------------------------
def calibration_activation_bytes(analysis: ModelAnalysis, calibration: dict[str, Any]) -> int:
    """Live tensors of one calibration forward (fp32): hidden states, MLP intermediates and logits."""
    a = _arch(analysis)
    tokens = calibration["batch_size"] * calibration["seq_len"]
    width = 4 * (a.get("hidden_size") or 0) + 2 * (a.get("intermediate_size") or 0) + (a.get("vocab_size") or 0)
    return int(tokens * width * 4)


def calibration_cache_bytes(analysis: ModelAnalysis, calibration: dict[str, Any]) -> int:
    """Every calibration sample's input to one decoder layer, as AWQ/GPTQ keep them (model dtype)."""
    h = _arch(analysis).get("hidden_size") or 0
    return int(calibration["num_samples"] * calibration["seq_len"] * h * bytes_per_param(analysis))


def estimate_quantize(analysis: ModelAnalysis, info: dict[str, Any], algorithm: str | None, calibration: dict[str, Any], device: str) -> dict[str, Any]:
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


def engine_estimate(engine: str | None, analysis: ModelAnalysis, info: dict[str, Any], algorithm: str | None, calibration: dict[str, Any],
                    device: str) -> dict[str, Any]:
    from quark_ptq_eval.plan.engines import holds_one_shard

    if holds_one_shard(engine):
        return estimate_file2file(analysis, device)
    return estimate_quantize(analysis, info, algorithm, calibration, device)


def _fits(est: dict[str, Any], host: dict[str, Any], device: dict[str, Any]) -> bool:
    ram = host["ram_bytes"]
    gpu = host["gpu_bytes_per_device"] * (host["gpu_count"] if device["multi_device"] else 1)
    return ((not ram or est["host_peak_bytes"] <= ram * HEADROOM)
            and (not est["gpu_peak_bytes"] or not gpu or est["gpu_peak_bytes"] <= gpu * HEADROOM))


def engine_for_host(work: Workload, engine: str, why: str, requested: str, env: dict[str, Any]) -> tuple[str, str]:
    """The plan's engine once this host's memory is known: file-to-file when the automatic choice's
    whole-model engine does not fit and file-to-file does and can serve the plan (docs/planning.md)."""
    from quark_ptq_eval.plan.engines import shard_engine

    analysis, info, algorithm, kv, device = work.analysis, work.info, work.algorithm, work.kv, work.device
    calibration = work.calibration

    shard = shard_engine()
    if shard is not None and requested == shard.name:
        why_not = shard.unsupported_reason(info, algorithm, kv)
        if why_not:
            raise shard.refusal(why_not)
        return engine, why
    from quark_ptq_eval.plan.source_reading import file2file_can_read

    host = host_capacity(env, None)
    whole = estimate_quantize(analysis, info, algorithm, calibration, device["device"])
    if (shard is None or requested != "auto" or _fits(whole, host, device)
            or shard.unsupported_reason(info, algorithm, kv) or not file2file_can_read(analysis, device["device"])):
        return engine, why
    f2f = estimate_file2file(analysis, device["device"])
    if not _fits(f2f, host, device):
        return engine, why  # neither fits: the plan stops at its checkpoint with proposals
    key, have = (("gpu_peak_bytes", host["gpu_bytes_per_device"]) if whole["gpu_peak_bytes"]
                 and not _fits({**whole, "host_peak_bytes": 0}, host, device) else ("host_peak_bytes", host["ram_bytes"]))
    where = "GPU memory" if key == "gpu_peak_bytes" else "RAM"
    return shard.name, (f"the whole-model engine ({engine}) needs about {gb(whole[key])} of {where} at its peak and "
                         f"this host has {gb(have)} (planning for at most {HEADROOM:.0%}); Quark's file-to-file "
                         f"quantization holds one shard at a time: about {gb(f2f[key])} (largest shard "
                         f"{gb(f2f['model_bytes'])}), and this scheme needs no calibration")


def estimate_eval(analysis: ModelAnalysis, out_bytes: int, baseline: bool = False, seq_len: int = 2048) -> dict[str, Any]:
    """Tier 1 on the CPU: the quantized model held dequantized (its source size), the baseline when
    asked, and the logits of one batch (evaluate.tier_ppl caps a batch at EVAL_LOGIT_BUDGET elements)."""
    w = loaded_bytes(analysis)
    vocab = _arch(analysis).get("vocab_size") or 0
    logits = min(EVAL_LOGIT_BUDGET, max(seq_len * vocab, 1)) * 4 * EVAL_LOGIT_COPIES
    peak = BASE_BYTES + w + (w if baseline else 0) + logits
    return {"host_peak_bytes": int(peak), "model_bytes": w, "baseline": baseline, "logits_bytes": logits}


# ---- the host ------------------------------------------------------------------------------------
def mem_available_bytes(meminfo: str | None = None) -> int | None:
    """MemAvailable from /proc/meminfo (or the text given): what can be allocated now."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text(encoding="ascii")
        except OSError:
            return None
    m = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M)
    return int(m.group(1)) * 1024 if m else None


def host_capacity(env: dict[str, Any], output_dir: Path | None, meminfo: str | None = None) -> dict[str, Any]:
    """RAM (the env_context's host_memory_gb), GPU memory (memory_gb x gpu_count) and free disk."""
    from quark_ptq_eval.context.preflight import free_gb

    hw = env["hardware"]
    ram = hw.get("host_memory_gb")
    disk = free_gb(output_dir) if output_dir is not None else None
    return {"ram_bytes": int(ram * GIB) if ram else None, "ram_available_bytes": mem_available_bytes(meminfo),
            "gpu_bytes_per_device": int((hw.get("memory_gb") or 0) * GIB), "gpu_count": hw.get("gpu_count") or 0,
            "disk_free_bytes": int(disk * GIB) if disk is not None else None}


# ---- the target ----------------------------------------------------------------------------------
def kv_bytes_per_token(analysis: ModelAnalysis, kv_scheme: str | None) -> int:
    return kv_bytes_per_token_of(_arch(analysis), kv_scheme)  # the formula vLLM's sizing shares


def serving_fit(analysis: ModelAnalysis, out_bytes: int, kv_scheme: str | None, memory_gb: float, budget: dict[str, Any] | None) -> dict[str, Any]:
    """Weights + KV cache at the budget's context and batch on one device of ``memory_gb`` (vendor GB)."""
    budget = budget or {"devices": 1, "context": 4096, "batch": 1}
    kv = kv_bytes_per_token(analysis, kv_scheme) * budget["context"] * budget["batch"]
    need = out_bytes + kv
    per_device = memory_gb * 1e9 * HEADROOM
    devices = max(1, math.ceil(need / per_device)) if per_device else None
    tp = 1 << (devices - 1).bit_length() if devices else None  # tensor parallelism goes in powers of two
    return {"weights_bytes": out_bytes, "kv_cache_bytes": kv, "context": budget["context"], "batch": budget["batch"],
            "device_memory_gb": memory_gb, "devices_needed": tp,
            "fits_budget": bool(per_device) and need <= per_device * budget["devices"]}


# ---- the plan checkpoint's verdict ---------------------------------------------------------------
def assess(work: Workload, host: dict[str, Any], rerun: list[str], engine: str | None = None) -> dict[str, Any]:
    """Does this host hold the engine, the output and a Tier 1 evaluation? If not, what would."""
    from quark_ptq_eval.plan.engines import holds_one_shard

    analysis, scheme, info, algorithm, device = work.analysis, work.scheme, work.info, work.algorithm, work.device
    calibration = work.calibration

    est = engine_estimate(engine, analysis, info, algorithm, calibration, device["device"])
    out = output_bytes(analysis, scheme, info)
    ev = estimate_eval(analysis, out)
    ev["with_baseline_bytes"] = estimate_eval(analysis, out, baseline=True)["host_peak_bytes"]
    problems = _problems(est, out, ev, host, device)
    fits = not any(p["blocking"] for p in problems)
    proposals = [] if fits else _proposals(work, host, est, rerun)
    if not fits and not holds_one_shard(engine):
        proposals[-1:-1] = _file2file_proposal(work, host)
    return {"quantize": est, "evaluate": ev, "output_bytes": out, "host": host, "output_basis": output_basis(analysis),
            "fits": fits, "problems": problems, "proposals": proposals}


def output_basis(analysis: ModelAnalysis | None) -> str:
    fmt = getattr(analysis, "source_format", None) or {}
    if fmt.get("quantizable_params") is None or not fmt.get("prequantized_tensors"):
        return "quantized linears at the scheme's bits (scales included), the rest in the source dtype"
    return (f"{fmt['quantizable_params']:,} parameters of the template's linears (header shapes) at the scheme's "
            f"bits, scales included; the rest ({gb(fmt['rest_read_as_bytes'])}) as both engines write it: "
            f"{release_of(fmt.get('name'))} layers left out dequantized to BF16")


def _problems(est: dict[str, Any], out: int, ev: dict[str, Any], host: dict[str, Any], device: dict[str, Any]) -> list[dict[str, Any]]:
    problems = []
    ram, gpu = host["ram_bytes"], host["gpu_bytes_per_device"] * (host["gpu_count"] if device["multi_device"] else 1)
    if ram and est["host_peak_bytes"] > ram * HEADROOM:
        problems.append({"blocking": True, "what": "host RAM",
                         "message": f"the engine needs about {gb(est['host_peak_bytes'])} of RAM at its peak; "
                                    f"this host has {gb(ram)} (planning for at most {HEADROOM:.0%})"})
    if est["gpu_peak_bytes"] and gpu and est["gpu_peak_bytes"] > gpu * HEADROOM:
        problems.append({"blocking": True, "what": "GPU memory",
                         "message": f"the engine needs about {gb(est['gpu_peak_bytes'])} of GPU memory; "
                                    f"{'all GPUs' if device['multi_device'] else 'one GPU'} here hold {gb(gpu)}"})
    if host["disk_free_bytes"] is not None and out > host["disk_free_bytes"]:
        problems.append({"blocking": True, "what": "disk",
                         "message": f"the output needs about {gb(out)} on disk; {gb(host['disk_free_bytes'])} is free"})
    if ram and ev["host_peak_bytes"] > ram * HEADROOM:
        problems.append({"blocking": False, "what": "evaluation RAM",
                         "message": f"a Tier 1 evaluation here needs about {gb(ev['host_peak_bytes'])} of RAM "
                                    f"(more with the baseline); this host has {gb(ram)}"})
    avail = host.get("ram_available_bytes")
    if ram and avail and avail < est["host_peak_bytes"] <= ram * HEADROOM:
        problems.append({"blocking": False, "what": "RAM in use", "live": True,
                         "message": f"only {gb(avail)} of RAM is free right now (other processes); "
                                    f"the engine needs about {gb(est['host_peak_bytes'])}"})
    return problems


def _proposals(work: Workload, host: dict[str, Any], est: dict[str, Any], rerun: list[str]) -> list[dict[str, Any]]:
    """Concrete changes with their estimates: smaller calibration, no algorithm, GPUs, another host."""
    analysis, info, algorithm, calibration, device = work.analysis, work.info, work.algorithm, work.calibration, work.device
    ram = host["ram_bytes"] or 0
    out: list[dict[str, Any]] = []

    def variant(change: str, algo: str | None, **calib: int) -> None:
        e = estimate_quantize(analysis, info, algo, {**calibration, **calib}, device["device"])
        if e["host_peak_bytes"] < 0.95 * est["host_peak_bytes"]:
            fits = "fits" if not ram or e["host_peak_bytes"] <= ram * HEADROOM else "still too much"
            out.append({"change": change, "detail": f"{change}: about {gb(e['host_peak_bytes'])} ({fits})"})

    if calibration["num_samples"] > 16:
        variant(f"--num-calib-samples {max(16, calibration['num_samples'] // 4)}", algorithm,
                num_samples=max(16, calibration["num_samples"] // 4))
    if calibration["seq_len"] > 256:
        variant("--calib-seq-len 256", algorithm, seq_len=256)
    if algorithm:
        variant("--algorithm '' (plain PTQ)", None)
    if device["device"] == "cuda" and host["gpu_count"] > 1 and not device["multi_device"]:
        out.append({"change": "--multi-device", "detail": f"--multi-device: spread the model over the "
                                                          f"{host['gpu_count']} GPUs here"})
    gpu_est = estimate_quantize(analysis, info, algorithm, calibration, "cuda")
    need_ram = est["host_peak_bytes"] / HEADROOM
    out.append({"change": "another host", "command": " ".join(rerun),
                "detail": f"a host with at least {gb(need_ram)} of RAM, or a GPU host (about "
                          f"{gb(gpu_est['gpu_peak_bytes'])} of GPU memory and {gb(gpu_est['host_peak_bytes'])} of "
                          f"RAM); run there: {' '.join(rerun)}"})
    return out


def _file2file_proposal(work: Workload, host: dict[str, Any]) -> list[dict[str, Any]]:
    """Quark's file-to-file engine with its estimate, when it can serve this plan (a proposal must work)."""
    from quark_ptq_eval.plan.engines import shard_engine
    from quark_ptq_eval.plan.source_reading import file2file_can_read

    analysis, info, algorithm, kv, device = work.analysis, work.info, work.algorithm, work.kv, work.device

    shard, no_kv = shard_engine(), ""
    if shard is None:
        return []
    if shard.unsupported_reason(info, algorithm, kv):
        if not (kv and not shard.unsupported_reason(info, algorithm, None)):
            return []
        no_kv = " --kv-cache-scheme ''"  # file-to-file never runs the model, so it calibrates no KV scales
    if not file2file_can_read(analysis, device["device"]):
        if not file2file_can_read(analysis, "cuda"):
            return []
        e = estimate_file2file(analysis, "cuda")
        return [{"change": f"--engine {shard.name} --device cuda{no_kv} (a GPU host)",
                 "detail": f"on a GPU host, Quark's file-to-file engine recovers the FP8 weights itself, one shard "
                           f"at a time: about {gb(e['gpu_peak_bytes'])} of GPU memory and {gb(e['host_peak_bytes'])} "
                           f"of RAM (this host has no GPU for its FP8 kernel)"
                           + ("; without the KV-cache scheme, whose scales need calibration" if no_kv else "")}]
    e = estimate_file2file(analysis, device["device"])
    fits = "fits" if _fits(e, host, device) else "still too much"
    return [{"change": f"--engine {shard.name}{no_kv}", "detail": f"--engine {shard.name}{no_kv}: one shard at a time, "
                                                               f"about {gb(e['host_peak_bytes'])} ({fits})"}]


def rerun_command(model: str, output_dir: Path | None, scheme: str, algorithm: str | None, kv: str | None,
                  calibration: dict[str, Any], target: str | None) -> list[str]:
    """The `quark-ptq-eval run` command that reproduces this plan on a GPU host."""
    import shlex

    argv = ["quark-ptq-eval", "run", model, "-o", str(output_dir or "OUTPUT_DIR"), "--scheme", scheme,
            "--device", "cuda", "--num-calib-samples", str(calibration["num_samples"]),
            "--calib-seq-len", str(calibration["seq_len"])]
    if algorithm:
        argv += ["--algorithm", algorithm]
    if kv:
        argv += ["--kv-cache-scheme", kv]
    if calibration.get("path"):
        argv += ["--calib-data", calibration["path"]]
    if target:
        argv += ["--target", target]
    return [shlex.quote(a) for a in argv]


def decision_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The plan table's rows for memory and disk, each with the basis of its number."""
    q, host = res["quantize"], res["host"]
    ram = f"of {gb(host['ram_bytes'])}" if host["ram_bytes"] else "(host RAM unknown)"
    rows = [{"decision": "host memory (quantize)", "value": f"~{gb(q['host_peak_bytes'])} {ram}",
             "reason": f"peak RSS {q['basis']}: {', '.join(f'{k} {gb(v)}' for k, v in q['terms'].items() if v)} "
                       "(docs/planning.md)"}]
    if q["gpu_peak_bytes"]:
        rows.append({"decision": "GPU memory (quantize)", "value": f"~{gb(q['gpu_peak_bytes'])}",
                     "reason": f"{q['basis']}: weights, activations and algorithm caches on the device"})
    rows.append({"decision": "output size on disk", "value": f"~{gb(res['output_bytes'])}",
                 "reason": res.get("output_basis") or output_basis(None)})
    ev = res["evaluate"]
    rows.append({"decision": "host memory (evaluate)", "value": f"~{gb(ev['host_peak_bytes'])}",
                 "reason": f"Tier 1 (modelled): start-up, the model as loaded, {gb(ev['logits_bytes'])} of logits per "
                           f"batch; ~{gb(ev['with_baseline_bytes'])} with the baseline"})
    for p in res["problems"]:
        if p.get("live"):
            continue  # a reading of this moment (free RAM) is kept in resources, out of the approved table
        rows.append({"decision": f"does not fit: {p['what']}" if p["blocking"] else f"warning: {p['what']}",
                     "value": "STOP" if p["blocking"] else "note", "reason": p["message"]})
    for p in res["proposals"]:
        rows.append({"decision": "proposal", "value": p["change"], "reason": p["detail"]})
    return rows


def unfit_message(plan: QuantPlan) -> str | None:
    """One sentence for the plan checkpoint when this host cannot hold the plan (None when it can)."""
    res = getattr(plan, "resources", None) or {}
    blocking = [p["message"] for p in res.get("problems", []) if p.get("blocking")]
    if not blocking:
        return None
    return "This host cannot hold this plan: " + "; ".join(blocking) + "."


def hold_message(plan: QuantPlan, execution_mode: str, approver: Approver, already_approved: bool) -> str | None:
    """Why a run must stop at the plan checkpoint before anything runs, or None.

    A plan this host cannot hold is not approved by --yes: only by name (``--approve plan``), by a
    person at the terminal who saw the table, or in plan_only mode (nothing runs there)."""
    from quark_ptq_eval.base.calibration_text import short_message

    unfit = unfit_message(plan) or short_message(plan.calibration)  # less calibration text than planned, too
    if unfit is None or execution_mode == "plan_only" or already_approved:
        return None
    if approver.weighs("plan"):  # named, or someone who sees the table answers
        return None
    return (f"{unfit} Change the plan as its table proposes, or approve it by name (--approve plan) "
            "to run it anyway")


def serving_text(fit: dict[str, Any], label: str, kv: str | None) -> str:
    what = (f"weights {gb(fit['weights_bytes'])} + {(kv or 'BF16').upper()} KV cache {gb(fit['kv_cache_bytes'])} "
            f"at {fit['context']} tokens x batch {fit['batch']} on {label}")
    if not fit["devices_needed"]:
        return f"{what}: that much memory on the serving host"
    return f"{what} ({fit['device_memory_gb']:g} GB, {HEADROOM:.0%} usable): {fit['devices_needed']} device(s)"
