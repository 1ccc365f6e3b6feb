"""The check registry: what runs, in which order, under which title, and which failures are structural.

Cheapest first: headers (layout against the plan, shard index), small files (auxiliary files
and tokenizer behaviour, ``config.json``), tensor bytes, the quantized weights decoded against the
source, the activation scales' values, then loading the model.
"""

from __future__ import annotations

from typing import Any

from quark_ptq_eval.base.registry import Registry
from quark_ptq_eval.base.safetensors_io import TensorInfo
from quark_ptq_eval.base.schemes import load_scheme_table
from quark_ptq_eval.validate.auxfiles import check_aux
from quark_ptq_eval.validate.byte_identity import (
    Sampling,
    compare_pair,
    compare_tensors,
    excluded_candidates,
    sample,
)
from quark_ptq_eval.validate.calibration import check_calibration
from quark_ptq_eval.validate.configdiff import HeaderFacts, check_config
from quark_ptq_eval.validate.decode import check_decode
from quark_ptq_eval.validate.index import check_index
from quark_ptq_eval.validate.layout import LayoutInputs, check_layout, layer_count, truncation_findings
from quark_ptq_eval.validate.loadcheck import check_load
from quark_ptq_eval.validate.plan_conformance import plan_expectation
from quark_ptq_eval.validate.registry import Check, CheckInputs, unreadable_headers
from quark_ptq_eval.validate.report import CheckResult, Finding
from quark_ptq_eval.validate.rewrites import rewritten_by
from quark_ptq_eval.validate.servecheck import check_serving

FLOAT_EXPONENT = {"F16": (2, 0x7C00), "BF16": (2, 0x7F80)}  # all-ones exponent: inf or NaN


def run_layout(ctx: CheckInputs) -> CheckResult:
    if (bad := unreadable_headers(ctx, "layout")) is not None:
        return bad
    table = load_scheme_table() if (ctx.plan or {}).get("global_scheme") else None
    expectation = plan_expectation(ctx.plan, ctx.qconfig, table)
    # Overrides missing from the export are the conformance findings' job once the plan has a scheme.
    overrides = {} if expectation.origin == "plan" else \
        {str(k): str(v) for k, v in ((ctx.plan or {}).get("layer_quant_config") or {}).items()}
    inputs = LayoutInputs(ctx.readable("source"), ctx.declared_output, expectation.qconfig, ctx.exclude, overrides,
                          export_has_qconfig=ctx.qconfig is not None, export_qconfig=ctx.qconfig)
    result = check_layout(inputs)
    result.findings[:0] = [*truncation_findings(ctx.truncated, ctx.without_data), *expectation.findings]
    result.notes[:0] = expectation.notes
    result.stats["expectations_from"] = expectation.origin
    ctx.shared.quantized_modules = inputs.quantized_modules
    ctx.shared.expected_qconfig = expectation.qconfig  # the KV-scale check's patterns (kvcache.py)
    return result


def run_aux(ctx: CheckInputs) -> CheckResult:
    return check_aux(ctx.source, ctx.quantized)


def run_config(ctx: CheckInputs) -> CheckResult:
    counts = (layer_count(h) if isinstance(h, dict) else 0 for h in (ctx.headers["source"], ctx.declared_output))
    return check_config(ctx.source, ctx.quantized, HeaderFacts(*counts))


def run_bytes(ctx: CheckInputs) -> CheckResult:
    """Every tensor that is neither quantized nor rewritten by a planned algorithm, byte for byte."""
    source, output = ctx.headers["source"], ctx.headers["output"]
    if not isinstance(source, dict) or not isinstance(output, dict):
        return _bytes_unreadable(ctx)
    quantized = ctx.shared.quantized_modules
    must = [n for n in source if not (n.endswith(".weight") and n.rpartition(".")[0] in quantized)]
    rewritten = rewritten_by(must, ctx.qconfig, ctx.plan)
    lost = set(ctx.without_data)  # past a truncated shard's cut: each named, none read
    keep = [n for n in must if n not in rewritten and n not in lost]
    sampling = Sampling(ctx.max_samples, ctx.seed, ctx.workers, ctx.progress)
    result = compare_tensors(source, output, keep, sampling=sampling, result=CheckResult("md5"))
    uncompared = [n for n in must if n in lost and n not in rewritten]
    result.findings += [Finding(n, "cannot be compared with the source: its bytes lie past a truncated shard's cut "
                                   "(the layout check names the shard).", side="environment") for n in uncompared]
    checked = set(result.stats["checked_names"]) | set(uncompared)  # held to the source, as an unreadable one is
    excluded = excluded_candidates(source, ctx.exclude, tied_embeddings(ctx.src_config, source))
    result.stats["excluded_checked"] = len(checked & set(excluded))
    _check_rewritten(source, output, rewritten, result)
    return result


def _bytes_unreadable(ctx: CheckInputs) -> CheckResult:
    """Refused headers: name each excluded tensor that cannot be compared (as Quark's helper does)."""
    source = ctx.tensors("source")
    if source is None:
        return unreadable_headers(ctx, "md5") or CheckResult("md5")
    result = CheckResult("md5")
    why = "the output's safetensors headers were refused (see the layout check)"
    names = sample(excluded_candidates(source, ctx.exclude, tied_embeddings(ctx.src_config, source)), ctx.max_samples,
                   ctx.seed)
    result.findings += [Finding(n, f"cannot be compared with the source: {why}.", side="environment") for n in names]
    result.stats.update(checked=len(names), excluded_checked=len(names))
    return result


def _check_rewritten(source: dict[str, TensorInfo], output: dict[str, TensorInfo], rewritten: dict[str, str],
                     result: CheckResult) -> None:
    """Tensors an algorithm may change: same dtype and shape, finite values; reported by algorithm."""
    changed: dict[str, list[str]] = {}
    for name, algo in sorted(rewritten.items()):
        s, o = source[name], output.get(name)
        if o is None or (o.dtype, o.shape) != (s.dtype, s.shape):
            found = f"{o.dtype} {list(o.shape)}" if o else "no such tensor"
            result.findings.append(Finding(name, f"may be rewritten by {algo} but must keep the source's dtype and "
                                                 "shape.", side="quark",
                                           evidence=f"expected: {s.dtype} {list(s.shape)}; found: {found}"))
            continue
        if compare_pair(s, o).identical:
            continue
        bad = non_finite(o)
        if bad:
            result.findings.append(Finding(name, f"was rewritten by {algo} into {bad} non-finite value(s).",
                                           side="quark", evidence="expected: finite values; found NaN/inf"))
        changed.setdefault(algo, []).append(name)
    for algo, names in changed.items():
        result.notes.append(f"{len(names)} tensor(s) rewritten by {algo} (dtype, shape and finiteness checked): "
                            + ", ".join(names[:5]) + (" ..." if len(names) > 5 else ""))
    result.stats["rewritten"] = sum(len(v) for v in changed.values())


def non_finite(info: TensorInfo) -> int:
    """How many NaN/inf values a float tensor holds (0 for integer tensors)."""
    import numpy as np  # only for rewritten tensors: keeps the import of the validator light

    if info.dtype == "F32" or info.dtype == "F64":
        values = np.fromfile(info.file, dtype=np.float32 if info.dtype == "F32" else np.float64,
                             count=info.nbytes // (4 if info.dtype == "F32" else 8), offset=info.start)
        return int((~np.isfinite(values)).sum())
    if info.dtype in FLOAT_EXPONENT:
        width, mask = FLOAT_EXPONENT[info.dtype]
        raw = np.fromfile(info.file, dtype=np.uint16, count=info.nbytes // width, offset=info.start)
        return int(((raw & mask) == mask).sum())
    return 0


def tied_embeddings(config: dict[str, Any], source: dict[str, TensorInfo] | None = None) -> bool:
    """``tie_word_embeddings`` from config.json (or its ``text_config``); when the key is absent, the weights.

    The config class's default would need transformers imported (measured: 3-5 s idle, minutes on a
    loaded host, as it pulls in torch). It is not needed: a source that stores no ``lm_head.weight``
    next to its embedding is tied whatever the default, and one that stores both has both tensors
    compared byte for byte anyway.
    """
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict) and "tie_word_embeddings" in cfg:
            return bool(cfg["tie_word_embeddings"])
    names = set(source or ())
    return "lm_head.weight" not in names and any(n.endswith("embed_tokens.weight") for n in names)


CHECKS: Registry[Check] = Registry("validation check", (
    Check("layout", "Layout against the plan (safetensors headers, shapes)", run_layout, structural=True,
          module="quark_ptq_eval.validate.layout", unloadable_when_failed=True),
    Check("index", "Shard index (model.safetensors.index.json)", check_index, structural=True,
          unloadable_when_failed=True),
    Check("aux", "Auxiliary files and tokenizer behaviour", run_aux, structural=False,
          next_action="Re-copy the missing or changed files from the source: `validate ... --approve fix`.",
          fixable=True, module="quark_ptq_eval.validate.auxfiles"),
    Check("config", "config.json", run_config, structural=False, module="quark_ptq_eval.validate.configdiff"),
    Check("md5", "Byte identity of every tensor that must not change", run_bytes, structural=True,
          module="quark_ptq_eval.validate.byte_identity"),
    Check("decode", "Quantized weights decode to the source within the scheme's rounding", check_decode,
          structural=True),
    Check("calibration", "Activation scales set by calibration", check_calibration, structural=True,
          next_action="Quantize again with more or more varied calibration text (--num-calib-samples, "
                      "--calib-data) so that every module, every MoE expert included, sees some."),
    Check("load", "Loads and runs (probe against the source)", check_load, structural=True),
    Check("serve", "vLLM serves it (advisory)", check_serving, structural=False, advisory=True),
))
