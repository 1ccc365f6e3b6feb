"""The plan's scheme and algorithm when the request does not name them (the goal's words, the target's priority,
the host's accelerator), and the refusal of what the installed Quark's template cannot do with them."""

from __future__ import annotations

import re

from quark_ptq_eval.base.artifacts import ModelAnalysis
from quark_ptq_eval.base.catalog import QuarkCatalog, SchemeInfo
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.context.preflight import HostEnv
from quark_ptq_eval.plan.family_limits import check_family_limits
from quark_ptq_eval.plan.request import PlanRequest
from quark_ptq_eval.plan.targets import BudgetCheck, Deployment, recommend_scheme

# Goal phrases -> scheme, most specific first. Matched on the lower-cased goal.
GOAL_SCHEMES: tuple[tuple[str, str], ...] = (
    (r"\bnvfp4\b", "nvfp4"), (r"\bmxfp4\b|\bfp4\b", "mxfp4"), (r"\bptpc", "ptpc_fp8"),
    (r"\bfp8\b|\bw8a8[- ]?fp8", "fp8"), (r"\bint8\b|\bw8a8\b", "int8"),
    (r"\bint4\b|\bw4a16\b|4[- ]?bit", "int4_wo_128"),
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

# Algorithms that fold per-channel scales into the weights (and the op before them), by every name Quark and users
# give them: the ones a remedy removes first when validation finds rows a fold crushed.
SCALING_ALGORITHMS = frozenset({"awq", "smoothquant", "smooth_quant", "smooth", "autosmoothquant"})

ACCURACY_FIRST = re.compile(r"accura|quality|best")


def gpu_of(env: HostEnv) -> tuple[str, str]:
    hw = env["hardware"]
    return hw["accelerator"], (hw.get("gpu_arch") or "").lower()


def choose_scheme(req: PlanRequest, env: HostEnv, catalog: QuarkCatalog, tc: Deployment,
                   fits: BudgetCheck | None = None) -> tuple[str, str]:
    if req.scheme:
        return req.scheme, "asked for explicitly"
    goal = req.goal.lower()
    for pattern, scheme in GOAL_SCHEMES:
        if re.search(pattern, goal):
            return scheme, f"the goal {req.goal!r} asks for it"
    picked = recommend_scheme(tc, catalog, fits)  # target x priority (targets.py)
    if picked:
        return picked
    if tc.priority == "size" and "int4_wo_128" in catalog["schemes"]:
        return "int4_wo_128", "smallest model: weight-only INT4 stores weights in 4 bits, on any accelerator"
    acc, arch = gpu_of(env)
    for accelerator, prefix, scheme, why in HARDWARE_DEFAULTS:
        if acc == accelerator and arch.startswith(prefix) and scheme in catalog["schemes"]:
            return scheme, why
    return "int8", "portable default"


def choose_algorithm(req: PlanRequest, scheme_info: SchemeInfo, template_algorithms: list[str] | None = None
                      ) -> tuple[str | None, str]:
    if req.algorithm is not None:
        return (req.algorithm or None), "asked for explicitly" if req.algorithm else "disabled explicitly"
    low_bit_weight_only = scheme_info.get("weight_only") and (scheme_info.get("weight_bits") or 16) <= 4
    if low_bit_weight_only and ACCURACY_FIRST.search(req.goal.lower()):
        return "awq", "accuracy first on a 4-bit weight-only scheme: AWQ protects salient channels"
    int8_activations = "int8" in (scheme_info.get("activation_dtypes") or [])
    if int8_activations and ACCURACY_FIRST.search(req.goal.lower()) and "smoothquant" in (template_algorithms or []):
        # Quark's templates smooth at alpha 1 for most families: a massive activation's whole range moves into
        # its weight column, and a per-tensor weight scale then rounds the other columns to nothing.
        return None, ("plain PTQ, measured before anything is added: SmoothQuant in Quark's template moves an "
                      "outlier channel's whole range into the weights (alpha 1), which can destroy a layer on real "
                      "models; --remedies N measures it, the outlier layers kept unquantized and a wider format on "
                      "your text")
    if any(d.startswith("fp8") for d in scheme_info.get("activation_dtypes") or []):
        return None, ("plain PTQ: FP8's exponent range absorbs activation outliers; add --algorithm smoothquant "
                      "if accuracy drops")
    return None, "plain PTQ; add --algorithm awq/gptq (weight-only) or smoothquant (W8A8) if accuracy drops"


def check_compatible(model_type: str, scheme: str, algorithm: str | None, kv: str | None,
                      overrides: dict[str, str], analysis: ModelAnalysis, catalog: QuarkCatalog) -> None:
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
            own = analysis.template.get("algorithms", catalog["algorithms"])  # [] : the template has none
            hint = (f"Available: {', '.join(own)}." if own else f"Quark's {model_type} template has no built-in "
                    "algorithm config: run without --algorithm (plain PTQ).")
            raise UsageError(f"The algorithm {algo!r} is not available for model_type {model_type!r} in this Quark.",
                             hint)
        if algo in WEIGHT_ONLY_ALGORITHMS and not info.get("weight_only"):
            raise UsageError(f"{algo} is a weight-only algorithm and cannot be combined with {scheme}, "
                             "which also quantizes activations.", "Use smoothquant for W8A8 schemes, or a *_wo_* scheme.")
        if algo in ACTIVATION_ALGORITHMS and info.get("weight_only"):
            raise UsageError(f"{algo} migrates activation outliers and has no effect on the weight-only scheme {scheme}.",
                             "Use awq or gptq for weight-only schemes.")
    if kv is not None and kv not in catalog["kv_cache_schemes"]:
        raise UsageError(f"The template for {model_type!r} rejects the KV-cache scheme {kv!r}.",
                         f"Supported KV-cache schemes: {', '.join(catalog['kv_cache_schemes'])}.")
