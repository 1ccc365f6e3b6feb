"""Conformance to the approved plan: the export's quantization_config against what the plan's scheme means.

The plan names schemes (``global_scheme``, per-pattern overrides, ``kv_cache_scheme``); the
scheme table (``schemes.py``) turns each name into the spec Quark would have written. The
layout check then holds every tensor against that plan-derived config, not against the
export's own ``quantization_config``: an export quantized with another scheme cannot pass by
describing itself correctly.

A KV-cache scheme is encoded as Quark 0.13's ``LLMTemplate._set_kv_cache_config`` writes it:
for each of the template's KV patterns (``*k_proj``/``*v_proj``, MLA's ``*kv_b_proj``, ...) a
``layer_quant_config`` entry (the pattern's base spec, resolved as Quark resolves it, plus the
KV output spec) and the same entry in ``kv_cache_quant_config``; only the latter when an
exclusion matches the pattern. The exporter adds ``export.kv_cache_group`` (the same patterns)
and merges each attention layer's k/v output scales. Those entries are the plan's KV scheme,
not overrides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any

from quark_ptq_eval.base.schemes import ROLES, describe, meaning
from quark_ptq_eval.validate.report import Finding

DEFAULT_KV_PATTERNS = ("*k_proj", "*v_proj")
ATTENTION_TOKENS = ("self_attn", "self_attention", "attn", "attention")  # Quark's _ATTN_TOKENS


@dataclass
class PlanExpectation:
    qconfig: dict[str, Any] | None  # what the layout check holds the tensors against
    origin: str  # "plan" or "quantization_config"
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def plan_expectation(plan: dict[str, Any] | None, out_qconfig: dict[str, Any] | None, table: dict[str, Any] | None) -> PlanExpectation:
    """The plan-derived quantization config, plus a finding per spec the export got wrong."""
    scheme = (plan or {}).get("global_scheme")
    if plan is None or not scheme:
        why = "no plan was given" if plan is None else "the plan names no global_scheme"
        return PlanExpectation(out_qconfig, "quantization_config",
                               notes=[f"{why}: tensors are held against the export's own quantization_config"])
    schemes = (table or {}).get("schemes") or {}
    unknown = [s for s in [scheme, *((plan.get("layer_quant_config") or {}).values())] if s not in schemes]
    if unknown:
        return PlanExpectation(out_qconfig, "quantization_config", notes=[
            f"the installed Quark's scheme table does not describe {sorted(set(map(str, unknown)))}: tensors "
            "are held against the export's own quantization_config"])
    expected = _expected_qconfig(plan, out_qconfig or {}, table or {})
    result = PlanExpectation(expected, "plan")
    result.findings += _compare(plan, expected, out_qconfig, schemes)
    return result


def _expected_qconfig(plan: dict[str, Any], out_qconfig: dict[str, Any], table: dict[str, Any]) -> dict[str, Any]:
    schemes = table["schemes"]
    expected: dict[str, Any] = {
        "global_quant_config": schemes[plan["global_scheme"]],
        "layer_quant_config": {str(p): schemes[s] for p, s in (plan.get("layer_quant_config") or {}).items()},
        "exclude": list(plan.get("exclude_layers") or []),
    }
    kv_scheme = plan.get("kv_cache_scheme")
    kv_spec = (table.get("kv_cache") or {}).get(kv_scheme) if kv_scheme else None
    if kv_spec is not None:
        patterns = kv_patterns(plan, out_qconfig, table)
        expected["kv_cache_quant_config"] = {}
        for pattern in patterns:
            entry = _kv_entry(expected, pattern, kv_spec)
            expected["kv_cache_quant_config"][pattern] = entry
            if entry["weight"] is not None:
                expected["layer_quant_config"][pattern] = entry
    return expected


def kv_patterns(plan: dict[str, Any], out_qconfig: dict[str, Any], table: dict[str, Any]) -> list[str]:
    """The patterns a KV scheme quantizes: the export's own, else the model type's Quark template."""
    written = list(out_qconfig.get("kv_cache_quant_config") or {})
    group = list((out_qconfig.get("export") or {}).get("kv_cache_group") or [])
    model_type = str((plan.get("model") or {}).get("model_type") or "")
    template = list((table.get("kv_layers") or {}).get(model_type) or [])
    return written or group or template or list(DEFAULT_KV_PATTERNS)


def _kv_entry(expected: dict[str, Any], pattern: str, kv_spec: dict[str, Any]) -> dict[str, Any]:
    """Quark's entry for one KV pattern: its base spec (None when excluded) with the KV output spec."""
    if any(fnmatch(pattern, ex) for ex in expected["exclude"]):
        return {"weight": None, "input_tensors": None, "output_tensors": kv_spec}
    overrides = expected["layer_quant_config"]
    base = next((cfg for p, cfg in overrides.items() if fnmatch(pattern, p)), None)
    if base is None:  # _resolve_projection_base_spec: same leaf, or any attention-wide override
        leaf = pattern.rsplit(".", 1)[-1].strip("*")
        base = next((cfg for p, cfg in overrides.items()
                     if (leaf and p.endswith(leaf)) or any(t in p for t in ATTENTION_TOKENS)),
                    expected["global_quant_config"])
    return {"weight": base.get("weight"), "input_tensors": base.get("input_tensors"), "output_tensors": kv_spec}


def _compare(plan: dict[str, Any], expected: dict[str, Any], out: dict[str, Any] | None, schemes: dict[str, Any]) -> list[Finding]:
    if out is None:
        return [Finding("quantization_config", f"is absent, but the plan quantizes with {plan['global_scheme']!r}.",
                        side="quark", evidence=f"expected (plan): {describe(expected['global_quant_config']['weight'])}"
                                               " weights; found: no quantization_config")]
    findings = _compare_layer("global_quant_config", plan["global_scheme"], expected["global_quant_config"],
                              out.get("global_quant_config"), schemes)
    written = out.get("layer_quant_config") or {}
    for pattern, scheme in (plan.get("layer_quant_config") or {}).items():
        if pattern not in written:
            findings.append(Finding(f"layer_quant_config[{pattern!r}]", f"the plan overrides it with {scheme!r} but "
                                    "the output's quantization_config has no such entry.", side="quark",
                                    evidence=f"expected (plan): {describe(expected['layer_quant_config'][pattern]['weight'])}"
                                             f" for {pattern}; found patterns: {sorted(written) or 'none'}"))
        else:
            findings += _compare_layer(f"layer_quant_config[{pattern!r}]", scheme, expected["layer_quant_config"][pattern],
                                       written[pattern], schemes)
    kv_entries = expected.get("kv_cache_quant_config") or {}
    for p in written:
        if p in (plan.get("layer_quant_config") or {}):
            continue
        if p in kv_entries and p in expected["layer_quant_config"]:  # the KV scheme's own entry (module docstring)
            findings += _compare_layer(f"layer_quant_config[{p!r}]", f"{plan['global_scheme']} + KV {plan['kv_cache_scheme']}",
                                       expected["layer_quant_config"][p], written[p], schemes)
            continue
        findings.append(Finding(f"quantization_config.layer_quant_config[{p!r}]",
                                "overrides a pattern the plan does not override.", side="quark",
                                evidence=f"expected (plan): {plan['global_scheme']!r} or an approved override; "
                                         f"found: {describe((written[p] or {}).get('weight'))}"))
    findings += _compare_kv(plan, expected, out)
    return findings


def _compare_layer(where: str, scheme: str, want: dict[str, Any], got: Any, schemes: dict[str, Any]) -> list[Finding]:
    got = got if isinstance(got, dict) else {}
    findings = []
    for role in ROLES:
        if meaning(want.get(role)) == meaning(got.get(role)):
            continue
        guess = _scheme_of(got, schemes)
        findings.append(Finding(
            f"quantization_config.{where}.{role}",
            f"does not match the plan's scheme {scheme!r}: the plan needs {describe(want.get(role))}, "
            f"the export holds {describe(got.get(role))}"
            + (f" (as scheme {guess!r} would)." if guess and guess != scheme else "."),
            side="quark", evidence=_difference(scheme, want.get(role), got.get(role))))
    return findings


def _difference(scheme: str, want: Any, got: Any) -> str:
    """Only the fields that differ, level by level: ``expected (plan 'int8'): dtype=int8; found: dtype=fp8_e4m3``."""
    a, b = meaning(want) or [], meaning(got) or []
    if len(a) != len(b):
        return f"expected (plan {scheme!r}): {len(a)} quantization level(s); found: {len(b)}"
    diffs = [(i, k, x[k], y[k]) for i, (x, y) in enumerate(zip(a, b, strict=True)) for k in x if x[k] != y[k]]
    tag = [f"level {i + 1} " if len(a) > 1 else "" for i in range(len(a))]
    return (f"expected (plan {scheme!r}): " + ", ".join(f"{tag[i]}{k}={v!r}" for i, k, v, _ in diffs)
            + "; found: " + ", ".join(f"{tag[i]}{k}={w!r}" for i, k, _, w in diffs))


def _scheme_of(layer: dict[str, Any], schemes: dict[str, Any]) -> str | None:
    """The scheme whose spec the export's layer config carries, to name it in the message."""
    for name, spec in schemes.items():
        if all(meaning(spec.get(r)) == meaning(layer.get(r)) for r in ROLES):
            return name
    return None


def _compare_kv(plan: dict[str, Any], expected: dict[str, Any], out: dict[str, Any]) -> list[Finding]:
    written = out.get("kv_cache_quant_config") or {}
    kv_scheme = plan.get("kv_cache_scheme")
    if not kv_scheme:
        return [Finding("quantization_config.kv_cache_quant_config", "quantizes the KV cache, but the plan has no "
                        "KV-cache scheme.", side="quark", evidence=f"found patterns {sorted(written)}")] if written else []
    want = (expected.get("kv_cache_quant_config") or {})
    if not written:
        return [Finding("quantization_config.kv_cache_quant_config", f"is empty, but the plan's KV-cache scheme "
                        f"{kv_scheme!r} quantizes the KV cache.", side="quark",
                        evidence=f"expected (plan): output quantizers on {sorted(want)}; found: none")]
    first: dict[str, Any] = next(iter(want.values()), {})
    spec = first.get("output_tensors")
    findings = [Finding(f"quantization_config.kv_cache_quant_config[{p!r}]",
                        f"does not match the plan's KV-cache scheme {kv_scheme!r}: the plan needs {describe(spec)}, "
                        f"the export holds {describe((cfg or {}).get('output_tensors'))}.", side="quark")
                for p, cfg in written.items() if meaning((cfg or {}).get("output_tensors")) != meaning(spec)]
    group = (out.get("export") or {}).get("kv_cache_group")
    if isinstance(group, list) and set(group) != set(written):  # Quark's QuantConfigParser holds them equal
        findings.append(Finding("quantization_config.export.kv_cache_group",
                                "does not name the KV-cache patterns, so the exporter did not merge each attention "
                                "layer's k/v scales.", side="quark",
                                evidence=f"expected: {sorted(written)}; found: {sorted(map(str, group))}"))
    return findings
