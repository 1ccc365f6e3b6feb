"""Turn the confirmed analysis, the user's goal and the hardware into a quantization plan.

Recommendations are data (goal keywords, hardware preferences); every value the plan carries is
checked against what the installed Quark supports (the catalog) and every incompatible
combination is refused with its reason before anything runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..artifacts import ModelAnalysis, QuantPlan
from ..errors import UsageError
from ..execute.engines import choose_engine, get_engine
from ..sensitivity.plan_hook import apply_sensitivity
from ..textdata import check_text_source
from .family_limits import check_family_limits

# Goal phrases -> scheme, most specific first. Matched on the lower-cased goal.
GOAL_SCHEMES: tuple[tuple[str, str], ...] = (
    (r"\bnvfp4\b", "nvfp4"), (r"\bmxfp4\b|\bfp4\b|\bmi355|\bgfx950", "mxfp4"), (r"\bptpc", "ptpc_fp8"),
    (r"\bfp8\b|\bw8a8[- ]?fp8", "fp8"), (r"\bint8\b|\bw8a8\b", "int8"),
    (r"\bint4\b|\bw4a16\b|4[- ]?bit|\bsmallest\b|\bmemory\b|\bsize\b", "int4_wo_128"),
)
# Hardware preference when the goal names no format: (accelerator, arch prefix) -> scheme, reason.
HARDWARE_DEFAULTS: tuple[tuple[str, str, str, str], ...] = (
    ("amd-rocm", "gfx950", "mxfp4", "MI350-class GPUs (gfx950) run OCP MXFP4 natively"),
    ("amd-rocm", "gfx94", "fp8", "MI300-class GPUs (gfx942) have native FP8 matrix cores"),
    ("nvidia-cuda", "sm_9", "fp8", "Hopper GPUs have native FP8 tensor cores"),
    ("nvidia-cuda", "sm_10", "nvfp4", "Blackwell GPUs run NVFP4 natively"),
    ("amd-rocm", "", "int4_wo_128", "weight-only INT4 runs on every ROCm GPU"),
    ("nvidia-cuda", "", "int4_wo_128", "weight-only INT4 runs on every CUDA GPU"),
    ("cpu", "", "int8", "INT8 weights and activations are the format CPU backends accelerate"),
    ("unknown", "", "int8", "no accelerator was detected; INT8 is the portable choice"),
)
# Algorithms that reshape weights for low-bit weight-only formats vs those that need activations.
WEIGHT_ONLY_ALGORITHMS = {"awq", "gptq", "gptaq", "qronos", "autoround"}
ACTIVATION_ALGORITHMS = {"smoothquant", "autosmoothquant"}
ACCURACY_FIRST = re.compile(r"accura|quality|best")


@dataclass
class PlanRequest:
    """What the user asked for; None means "recommend"."""

    goal: str = ""
    scheme: str | None = None
    algorithm: str | None = None
    kv_cache_scheme: str | None = None
    exclude_layers: list[str] | None = None  # None: template defaults; []: only with no_exclusions
    no_exclusions: bool = False
    layer_quant_config: dict[str, str] = field(default_factory=dict)
    calib_data: str | None = None
    calib_dataset: str | None = None
    num_calib_samples: int | None = None
    calib_seq_len: int | None = None
    batch_size: int = 1
    device: str | None = None
    multi_device: bool = False
    engine: str = "auto"
    trust_remote_code: bool = False
    evaluation_intent: str = "smoke"
    offline: bool = False
    sensitivity: bool = False  # run the sensitivity scan now and propose exclusions (sensitivity/plan_hook.py)
    max_kl: float | None = None  # the proposal's KL budget (None: the healthy threshold)


def _gpu(env: dict) -> tuple[str, str]:
    hw = env["hardware"]
    return hw["accelerator"], (hw.get("gpu_arch") or "").lower()


def _choose_scheme(req: PlanRequest, env: dict, catalog: dict) -> tuple[str, str]:
    if req.scheme:
        return req.scheme, "asked for explicitly"
    goal = req.goal.lower()
    for pattern, scheme in GOAL_SCHEMES:
        if re.search(pattern, goal):
            return scheme, f"the goal {req.goal!r} asks for it"
    acc, arch = _gpu(env)
    for accelerator, prefix, scheme, why in HARDWARE_DEFAULTS:
        if acc == accelerator and arch.startswith(prefix) and scheme in catalog["schemes"]:
            return scheme, why
    return "int8", "portable default"


def _choose_algorithm(req: PlanRequest, scheme_info: dict) -> tuple[str | None, str]:
    if req.algorithm is not None:
        return (req.algorithm or None), "asked for explicitly" if req.algorithm else "disabled explicitly"
    low_bit_weight_only = scheme_info.get("weight_only") and (scheme_info.get("weight_bits") or 16) <= 4
    if low_bit_weight_only and ACCURACY_FIRST.search(req.goal.lower()):
        return "awq", "accuracy first on a 4-bit weight-only scheme: AWQ protects salient channels"
    return None, "plain PTQ; add --algorithm awq/gptq (weight-only) or smoothquant (W8A8) if accuracy drops"


def _check_compatible(model_type: str, scheme: str, algorithm: str | None, kv: str | None,
                      overrides: dict[str, str], analysis: ModelAnalysis, catalog: dict) -> None:
    if not analysis.template["available"]:
        raise UsageError(f"The installed Quark {catalog['quark_version']} has no template for model_type {model_type!r}.",
                         f"Supported model types: {', '.join(sorted(catalog['templates']))}.")
    for s in [scheme, *overrides.values()]:
        if s not in catalog["schemes"]:
            raise UsageError(f"Quark {catalog['quark_version']} does not support the scheme {s!r}.",
                             f"Supported: {', '.join(catalog['schemes'])}.")
    check_family_limits(model_type, scheme, algorithm)  # known Quark/transformers limits (docs/families.md)
    info = catalog["scheme_info"].get(scheme, {})
    for algo in (algorithm or "").split(","):
        if not algo:
            continue
        if algo not in catalog["algorithms"] or algo not in analysis.template.get("algorithms", catalog["algorithms"]):
            raise UsageError(f"The algorithm {algo!r} is not available for model_type {model_type!r} in this Quark.",
                             f"Available: {', '.join(analysis.template.get('algorithms') or catalog['algorithms'])}.")
        if algo in WEIGHT_ONLY_ALGORITHMS and not info.get("weight_only"):
            raise UsageError(f"{algo} is a weight-only algorithm and cannot be combined with {scheme}, "
                             "which also quantizes activations.", "Use smoothquant for W8A8 schemes, or a *_wo_* scheme.")
        if algo in ACTIVATION_ALGORITHMS and info.get("weight_only"):
            raise UsageError(f"{algo} migrates activation outliers and has no effect on the weight-only scheme {scheme}.",
                             "Use awq or gptq for weight-only schemes.")
    if kv is not None and kv not in catalog["kv_cache_schemes"]:
        raise UsageError(f"The template for {model_type!r} rejects the KV-cache scheme {kv!r}.",
                         f"Supported KV-cache schemes: {', '.join(catalog['kv_cache_schemes'])}.")


def _calibration(req: PlanRequest, accelerator: str) -> tuple[dict, str]:
    samples = req.num_calib_samples or (128 if accelerator in ("cpu", "unknown") else 512)
    seq_len = req.calib_seq_len or 512
    common = {"num_samples": samples, "seq_len": seq_len, "batch_size": req.batch_size}
    if req.calib_data:
        path = check_text_source(req.calib_data, "calibration data")
        return {"source": "local_file", "dataset": None, "path": str(path), **common}, "your local text"
    if req.offline:
        raise UsageError("Offline mode needs local calibration text: the Hub datasets cannot be fetched.",
                         "Pass --calib-data PATH (.txt, .jsonl or .parquet).")
    dataset = req.calib_dataset or "pileval"
    return {"source": "hub_dataset", "dataset": dataset, "path": None, **common}, f"Quark's standard {dataset}"


def _device(req: PlanRequest, env: dict, size_bytes: int) -> dict:
    acc, _ = _gpu(env)
    device = req.device or ("cpu" if acc in ("cpu", "unknown") else "cuda")
    mem = env["hardware"].get("memory_gb") or 0
    multi = req.multi_device or (device == "cuda" and mem and size_bytes > 0.8 * mem * 2**30)
    return {"device": device, "multi_device": bool(multi),
            "gpu_count": env["hardware"].get("gpu_count", 0)}


def make_plan(analysis: ModelAnalysis, env: dict, req: PlanRequest, catalog: dict, analysis_ref: Path,
              output_dir: Path) -> QuantPlan:
    model_type = analysis.model_type
    accelerator, arch = _gpu(env)
    scheme, scheme_why = _choose_scheme(req, env, catalog)
    info = catalog["scheme_info"].get(scheme, {})
    algorithm, algo_why = _choose_algorithm(req, info)
    _check_compatible(model_type, scheme, algorithm, req.kv_cache_scheme, req.layer_quant_config, analysis, catalog)
    if req.exclude_layers is not None and not req.exclude_layers and not req.no_exclusions:
        raise UsageError("An empty exclusion list would quantize every layer, lm_head included.",
                         "Pass --no-exclusions to mean that, or omit --exclude to keep the template defaults.")
    if req.no_exclusions:
        excludes, ex_source, ex_why = [], "user", "you disabled all exclusions explicitly (--no-exclusions)"
    elif req.exclude_layers:
        excludes, ex_source, ex_why = list(req.exclude_layers), "user", "your patterns replace the template defaults"
    else:
        excludes, ex_source = list(analysis.template["exclude_layers"]), "template_default"
        ex_why = f"Quark's {model_type} template defaults"
    if analysis.model.get("has_custom_code") and not req.trust_remote_code and not analysis.template["available"]:
        raise UsageError("This model needs its own code to load and --trust-remote-code was not given.",
                         "Review the model repository's code, then pass --trust-remote-code.")
    calibration, calib_why = _calibration(req, accelerator)
    device = _device(req, env, analysis.size["bytes"])
    # The engines registry decides (execute/engines/): its automatic choice and its constraints.
    engine, engine_why = choose_engine(req.engine, accelerator, calibration, device["device"] == "cpu")
    get_engine(engine).check_constraints(info, algorithm, device)
    hw = f"{accelerator}{' ' + arch if arch else ''}"
    decisions = [
        {"decision": "global_scheme", "value": scheme, "reason": f"{scheme_why} ({hw})"},
        {"decision": "algorithm", "value": algorithm, "reason": algo_why},
        {"decision": "kv_cache_scheme", "value": req.kv_cache_scheme,
         "reason": "asked for explicitly" if req.kv_cache_scheme else "KV cache left in model dtype (no KV scheme asked)"},
        {"decision": "exclude_layers", "value": excludes, "reason": ex_why},
        {"decision": "layer_quant_config", "value": req.layer_quant_config,
         "reason": "your per-pattern overrides" if req.layer_quant_config else "no overrides"},
        {"decision": "calibration", "value": calibration.get("path") or calibration["dataset"], "reason": calib_why},
        {"decision": "calibration size", "value": f"{calibration['num_samples']} x {calibration['seq_len']} tokens",
         "reason": "explicit" if req.num_calib_samples else
         ("CPU-sized default: enough for min-max observers, minutes not hours" if accelerator in ("cpu", "unknown")
          else "quark-cli's default sample count")},
        {"decision": "device", "value": device["device"] + (" (multi-device)" if device["multi_device"] else ""),
         "reason": "explicit" if req.device else f"detected {hw}"},
        {"decision": "engine", "value": engine, "reason": engine_why},
        {"decision": "trust_remote_code", "value": req.trust_remote_code,
         "reason": "approved explicitly (--trust-remote-code)" if req.trust_remote_code else
         "off: nothing from the model repository is executed"},
        {"decision": "evaluation_intent", "value": req.evaluation_intent, "reason": "Phase 3 asks before running"},
        {"decision": "output format", "value": "Hugging Face safetensors (Quark format)", "reason": "what vLLM/transformers load"},
    ]
    plan = QuantPlan(
        model={"model_type": model_type, "analysis_ref": str(analysis_ref), "model_path": analysis.model["model_path"]},
        global_scheme=scheme, exclude_layers=excludes, exclude_source=ex_source,
        layer_quant_config=dict(req.layer_quant_config), algorithm=algorithm, kv_cache_scheme=req.kv_cache_scheme,
        calibration=calibration, device_strategy=device, engine={"name": engine, "reason": engine_why},
        trust_remote_code=req.trust_remote_code, evaluation_intent=req.evaluation_intent, decisions=decisions,
        requires_confirmation=True, output_dir=str(output_dir),
    )
    return apply_sensitivity(plan, req, Path(analysis_ref).parent)


def check_plan(plan: QuantPlan, analysis: ModelAnalysis, catalog: dict) -> None:
    """Re-check a (hand-edited) plan against the installed Quark, as make_plan does."""
    _check_compatible(analysis.model_type, plan.global_scheme, plan.algorithm, plan.kv_cache_scheme,
                      plan.layer_quant_config, analysis, catalog)
    if plan.engine.get("name") == "quark-api" and plan.calibration.get("source") == "local_file":
        check_text_source(plan.calibration.get("path") or "", "calibration data")
