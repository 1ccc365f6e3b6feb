"""Check 1, layout: safetensors headers of source and output held against the plan.

Every linear layer the plan quantizes must carry the storage and the scale/zero-point tensors
its plan-derived Quark spec asks for, each with the shape that spec and Quark's packing give;
excluded layers, embeddings and norms keep the source dtype and shape; no source tensor may be
missing and no output tensor unexplained. The report states the share of matrix parameters
the export quantized next to the share the plan quantizes.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.safetensors_io import TensorInfo, TruncatedFileError, canonical_name
from quark_ptq_eval.base.schemes import is_embedding
from quark_ptq_eval.validate.expectations import (
    TensorExpectation,
    activation_expectations,
    is_quant_param,
    kv_cache_output,
    matches,
    module_config,
    weight_expectations,
)
from quark_ptq_eval.validate.report import CheckResult, Finding
from quark_ptq_eval.validate.widening import header_change, is_lossless_widening, widening_note

LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def split_name(name: str) -> tuple[str, str]:
    module, _, suffix = name.rpartition(".")
    return module, suffix


def fuzzy_patterns(tensors: dict[str, TensorInfo]) -> list[dict[str, Any]]:
    """Canonical name patterns with dtype counts, in order of first appearance (as Quark lists them)."""
    counts: dict[str, Counter[str]] = {}
    for name, info in tensors.items():
        counts.setdefault(canonical_name(name), Counter())[info.dtype] += 1
    return [{"pattern": p, "dtype_counts": dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))}
            for p, c in counts.items()]


def layer_count(tensors: dict[str, TensorInfo]) -> int:
    indices = [int(m.group(1)) for name in tensors if (m := LAYER_INDEX.search(name))]
    return max(indices) + 1 if indices else 0


@dataclass
class LayoutInputs:
    source: dict[str, TensorInfo]
    output: dict[str, TensorInfo]
    qconfig: dict[str, Any] | None  # the output's quantization_config
    exclude: list[str]
    plan_overrides: dict[str, str]
    export_has_qconfig: bool = True
    export_qconfig: dict[str, Any] | None = None  # the export's own quantization_config, when qconfig is the plan's
    quantized_modules: set[str] = field(default_factory=set)  # filled in: modules the plan quantizes


def check_layout(inputs: LayoutInputs) -> CheckResult:
    result = CheckResult("layout")
    src_modules = _group(inputs.source)
    out_modules = _group(inputs.output)
    if inputs.qconfig is None and not inputs.export_has_qconfig:
        result.findings.append(Finding(
            "config.json", "the output has no quantization_config, so nothing says how it was quantized.",
            side="quark", evidence="quantization_config is absent from the output's config.json"))
    quantized = excluded = 0
    share = _Share()
    for module, suffixes in src_modules.items():
        out_suffixes = out_modules.get(module, {})
        done = share.add(module, suffixes, out_suffixes)
        if _expect_quantized(module, suffixes, inputs):
            quantized += 1
            inputs.quantized_modules.add(module)
            share.planned(suffixes, done)
            result.findings += _check_quantized(module, suffixes, out_suffixes, inputs.qconfig or {})
        else:
            excluded += matches(module, f"{module}.weight", inputs.exclude)
            result.findings += _check_unchanged(module, suffixes, out_suffixes, inputs.exclude,
                                                kv_cache_output(inputs.qconfig or {}, module))
    result.findings += _unexplained_extras(src_modules, out_modules)
    result.findings += _overrides_honoured(inputs)
    result.findings += share.findings()
    _summarize(result, inputs, quantized, excluded)
    share.report(result)
    return result


class _Share:
    """Matrix parameters (2-D and fused 3-D weights, embeddings aside): planned vs actually quantized."""

    SHORTFALL = 0.05  # more than this share of the planned parameters left in float fails as a whole

    def __init__(self) -> None:
        self.total = self.plan = self.done = self.planned_done = 0

    def add(self, module: str, src: dict[str, TensorInfo], out: dict[str, TensorInfo]) -> int:
        """Count one module; returns how many of its weight parameters the export quantized."""
        weight = src.get("weight")
        if weight is None or len(weight.shape) < 2 or is_embedding(module):
            return 0
        n = _numel(weight)
        self.total += n
        got = out.get("weight")
        done = n if got is not None and (got.dtype != weight.dtype or any(is_quant_param(s) for s in out)) else 0
        self.done += done
        return done

    def planned(self, src: dict[str, TensorInfo], done: int) -> None:
        self.plan += _numel(src["weight"])
        self.planned_done += done

    def findings(self) -> list[Finding]:
        if not self.plan:
            return []
        if self.done == 0:
            return [Finding("quantized share", f"the plan quantizes {self.plan / self.total:.1%} of the matrix "
                                               "parameters but the export quantizes none.", side="quark",
                            evidence=f"expected: {self.plan} parameters quantized; found: 0")]
        left = self.plan - self.planned_done
        if left > self.SHORTFALL * self.plan:
            return [Finding("quantized share", f"{left / self.plan:.1%} of the matrix parameters the plan quantizes "
                                               "are left in the source's float dtype.", side="quark",
                            evidence=f"expected (plan): {self.plan / self.total:.1%} of {self.total} matrix parameters "
                                     f"quantized; found: {self.done / self.total:.1%}")]
        return []

    def report(self, result: CheckResult) -> None:
        if not self.total:
            return
        result.stats["quantized_share"] = round(self.done / self.total, 4)
        result.stats["expected_share"] = round(self.plan / self.total, 4)
        result.notes.insert(0, f"quantized share of matrix parameters: {self.done / self.total:.1%} "
                               f"(expected: {self.plan / self.total:.1%} of {self.total})")


def truncation_findings(truncated: dict[Path, TruncatedFileError], without_data: tuple[str, ...]) -> list[Finding]:
    """One finding per shard whose data stops short, saying which modules no check could judge because of it."""
    findings = []
    for path, exc in sorted(truncated.items()):
        lost = sorted({n.rpartition(".")[0] for n in without_data if n in exc.header.tensors})
        blocks = sorted({int(m.group(1)) for n in lost if (m := re.search(r"\.layers\.(\d+)\.", n))})
        where = f"blocks {blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else f"block {blocks[0]}" if blocks else \
            ", ".join(lost[:3])
        findings.append(Finding(path.name, f"is truncated: its data stops at byte {exc.data_end:,} of "
                                           f"{max(t.end for t in exc.header.tensors.values()):,}; the {len(lost)} "
                                           f"modules past the cut ({where}) were judged by no check: copy, download "
                                           "or export it again.", side="environment",
                                evidence="the header is whole and every tensor before the cut was checked"))
    return findings


def _group(tensors: dict[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    grouped: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    for name, info in tensors.items():
        module, suffix = split_name(name)
        grouped[module][suffix] = info
    return grouped


ROUTER_SUFFIXES = (".mlp.gate", ".block_sparse_moe.gate", ".router", ".ffn.gate")  # MoE routers


def _expect_quantized(module: str, suffixes: dict[str, TensorInfo], inputs: LayoutInputs) -> bool:
    weight = suffixes.get("weight")
    if weight is None or len(weight.shape) != 2 or is_embedding(module):
        return False
    if matches(module, f"{module}.weight", inputs.exclude):
        return False
    cfg = module_config(inputs.qconfig or {}, module)
    return cfg is not None and bool(cfg.weight)


def _check_quantized(module: str, src: dict[str, TensorInfo], out: dict[str, TensorInfo], qconfig: dict[str, Any]) -> list[Finding]:
    cfg = module_config(qconfig, module)
    assert cfg is not None  # _expect_quantized guarantees it
    weight = src["weight"]
    out_weight = out.get("weight")
    if out_weight is not None and out_weight.dtype == weight.dtype and not any(is_quant_param(s) for s in out):
        if module.endswith(ROUTER_SUFFIXES):
            return [Finding(module, f"MoE router left in {weight.dtype}.", benign=True,
                            evidence="transformers 5 routers (TopKRouter) hold a raw parameter, not an nn.Linear, "
                                     "and Quark quantizes nn.Linear only")]
        return [Finding(module, f"is not quantized: its weight is still {weight.dtype} {list(weight.shape)} "
                                f"with no scale, but {cfg.source} quantizes it.", side="quark",
                        evidence=f"{_spec_summary(cfg.weight)} expected; no exclusion pattern matches it")]
    expected = weight_expectations(cfg.weight, weight.shape)
    expected += activation_expectations("input", cfg.input_tensors)
    expected += activation_expectations("output", cfg.output_tensors or kv_cache_output(qconfig, module))
    findings = [f for e in expected if (f := _check_expectation(module, e, out.get(e.suffix), cfg.source))]
    wanted = {e.suffix for e in expected}
    for suffix, info in src.items():  # the bias and any other plain tensor keep their header
        if suffix != "weight" and suffix not in wanted:
            findings += _same_header(module, suffix, info, out.get(suffix))
    findings += [Finding(f"{module}.{s}", f"is a quantization tensor that {cfg.source} does not ask for.",
                         side="quark", evidence=f"{out[s].dtype} {list(out[s].shape)}")
                 for s in out if is_quant_param(s) and s not in wanted]
    return findings


def _check_expectation(module: str, exp: TensorExpectation, got: TensorInfo | None, origin: str) -> Finding | None:
    name = f"{module}.{exp.suffix}"
    if got is None:
        return Finding(name, f"is missing, but {origin} stores it ({exp.why}).", side="quark")
    if got.dtype not in exp.containers:
        return Finding(name, f"is stored as {got.dtype}, but {exp.why} needs one of {sorted(exp.containers)}.",
                       side="quark", evidence=f"{got.dtype} {list(got.shape)}")
    if exp.shape is not None and tuple(got.shape) != exp.shape:
        return Finding(name, f"has shape {list(got.shape)}, but {exp.why} with Quark's packing needs "
                             f"{list(exp.shape)}.", side="quark",
                       evidence=f"expected (plan): {got.dtype} {list(exp.shape)}; found: {got.dtype} {list(got.shape)}")
    want_bytes = exp.nbytes()
    if want_bytes is not None and got.nbytes != want_bytes:
        return Finding(name, f"holds {got.nbytes} bytes, but {exp.count} values at {exp.bits} bits "
                             f"({exp.why}) need {want_bytes}.", side="quark",
                       evidence=f"{got.dtype} {list(got.shape)}")
    if want_bytes is None and exp.count is not None and _numel(got) != exp.count:
        return Finding(name, f"has {_numel(got)} values, but {exp.why} needs {exp.count}.", side="quark",
                       evidence=f"{got.dtype} {list(got.shape)}")
    return None


def _check_unchanged(module: str, src: dict[str, TensorInfo], out: dict[str, TensorInfo],
                     exclude: list[str], kv_spec: object = None) -> list[Finding]:
    """Keeps its source header; an excluded KV projection still carries its KV-cache scale (Quark's
    get_layer_quant_config: exclusion drops weight and input, never the KV cache's output)."""
    findings: list[Finding] = []
    for suffix, info in src.items():
        findings += _same_header(module, suffix, info, out.get(suffix))
    kv_tensors = {e.suffix for e in activation_expectations("output", kv_spec)} if kv_spec else set()
    extra = sorted(s for s in out if is_quant_param(s) and s not in kv_tensors)
    if extra:
        why = "is excluded from quantization" if matches(module, f"{module}.weight", exclude) else \
            "is not a linear layer the plan quantizes"
        findings.append(Finding(module, f"{why} but the output quantized it.", side="quark",
                                evidence=f"output carries {', '.join(extra)}"))
    return findings


def _same_header(module: str, suffix: str, src: TensorInfo, got: TensorInfo | None) -> list[Finding]:
    name = f"{module}.{suffix}"
    if got is None:
        return [Finding(name, "is missing from the output.", side="quark",
                        evidence=f"source has {src.dtype} {list(src.shape)} in {src.file.name}")]
    if (got.dtype, got.shape) != (src.dtype, src.shape):
        if is_lossless_widening(src, got):
            return [Finding(name, widening_note(src, got), benign=True,
                            evidence=f"{src.dtype} -> {got.dtype} {list(got.shape)}, values compared bit for bit")]
        side, evidence = header_change(src, got)
        return [Finding(name, f"should keep the source header {src.dtype} {list(src.shape)} "
                              f"but is {got.dtype} {list(got.shape)}.", side=side, evidence=evidence)]
    return []


def _unexplained_extras(src: dict[str, dict[str, Any]], out: dict[str, dict[str, TensorInfo]]) -> list[Finding]:
    findings = []
    for module, suffixes in out.items():
        for suffix, info in suffixes.items():
            if suffix in src.get(module, {}) or (module in src and is_quant_param(suffix)):
                continue
            findings.append(Finding(f"{module}.{suffix}", "is in the output but has no counterpart in the source.",
                                    side="quark", evidence=f"{info.dtype} {list(info.shape)} in {info.file.name}"))
    return findings


def _overrides_honoured(inputs: LayoutInputs) -> list[Finding]:
    written = (inputs.export_qconfig or inputs.qconfig or {}).get("layer_quant_config") or {}
    return [Finding(f"layer_quant_config[{pattern!r}]",
                    f"the plan overrides it with {scheme!r} but the output's quantization_config has no such entry.",
                    side="quark", evidence=f"written patterns: {sorted(written) or 'none'}")
            for pattern, scheme in inputs.plan_overrides.items() if pattern not in written]


def _summarize(result: CheckResult, inputs: LayoutInputs, quantized: int, excluded: int) -> None:
    source_patterns = fuzzy_patterns(inputs.source)
    output_patterns = fuzzy_patterns(inputs.output)
    mixed = [p for p in output_patterns if len(p["dtype_counts"]) > 1]
    result.stats.update(
        source_tensors=len(inputs.source), output_tensors=len(inputs.output), quantized_layers=quantized,
        excluded_layers=excluded, output_patterns=len(output_patterns), mixed_dtype_patterns=len(mixed),
    )
    result.notes += [f"mixed dtypes in {p['pattern']}: {p['dtype_counts']}" for p in mixed]
    result.stats["source_fuzzy"] = source_patterns
    result.stats["output_fuzzy"] = output_patterns


def _spec_summary(spec: object) -> str:
    specs = spec if isinstance(spec, list) else [spec]
    return " + ".join(f"{s.get('dtype')} {s.get('qscheme')}" for s in specs if isinstance(s, dict))


def _numel(info: TensorInfo) -> int:
    n = 1
    for d in info.shape:
        n *= d
    return n
