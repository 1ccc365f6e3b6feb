"""Turn the confirmed analysis, the user's goal and the hardware into a quantization plan.

Recommendations are data (goal keywords, hardware preferences); every value the plan carries is
checked against what the installed Quark supports (the catalog) and every incompatible
combination is refused with its reason before anything runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import Decision, ModelAnalysis, QuantPlan
from quark_ptq_eval.base.catalog import QuarkCatalog, SchemeInfo
from quark_ptq_eval.base.context_window import fit_window, read_model_config
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.plan_records import DeviceStrategy, PlanEngine, PlannedCalibration
from quark_ptq_eval.base.sizes import gb
from quark_ptq_eval.base.textdata import check_text_source
from quark_ptq_eval.context.preflight import HostEnv
from quark_ptq_eval.plan import decode_speed, host_fit, host_memory, resource_rows, resources, source_reading
from quark_ptq_eval.plan.calibration_check import check_calibration_text, source_note
from quark_ptq_eval.plan.choices import check_compatible, choose_algorithm, choose_scheme, gpu_of
from quark_ptq_eval.plan.engines import ENGINES, choose_engine, get_engine
from quark_ptq_eval.plan.groups import Settled, settle_groups
from quark_ptq_eval.plan.request import PlanRequest
from quark_ptq_eval.plan.scheme_fit import SchemeChoice, fit_to_model, linear_shapes
from quark_ptq_eval.plan.targets import (
    BudgetCheck,
    Deployment,
    deployment_of,
    format_family,
    keep_experts_unquantized,
    recommend_kv,
    refused_experts,
    scheme_warnings,
    target_fallbacks,
)


def _calibration(req: PlanRequest, accelerator: str, model_config: dict[str, Any]) -> tuple[PlannedCalibration, str]:
    samples = req.num_calib_samples or (128 if accelerator in ("cpu", "unknown") else 512)
    seq_len, clamped = fit_window(req.calib_seq_len, 512, model_config, "--calib-seq-len")
    if req.calib_data:
        path = check_text_source(req.calib_data, "calibration data")
        return PlannedCalibration("local_file", None, str(path), samples, seq_len, req.batch_size,
                                  clamped or None), "your local text"
    if req.offline:
        raise UsageError("Offline mode needs local calibration text: the Hub datasets cannot be fetched.",
                         "Pass --calib-data PATH (.txt, .jsonl or .parquet).")
    dataset = req.calib_dataset or "pileval"
    return PlannedCalibration("hub_dataset", dataset, None, samples, seq_len, req.batch_size, clamped or None), \
        f"Quark's standard {dataset}"


def _device(req: PlanRequest, env: HostEnv, size_bytes: int) -> DeviceStrategy:
    acc, _ = gpu_of(env)
    device = req.device or ("cpu" if acc in ("cpu", "unknown") else "cuda")
    mem = env["hardware"].get("memory_gb") or 0
    multi = req.multi_device or (device == "cuda" and mem and size_bytes > 0.8 * mem * 2**30)
    return DeviceStrategy(device, bool(multi), env["hardware"].get("gpu_count", 0))


LITTLE_CALIBRATION = 32  # samples when calibration only sees weight ranges


def _choose_kv(req: PlanRequest, tc: Deployment, catalog: QuarkCatalog, analysis: ModelAnalysis) -> tuple[str | None, str]:
    if req.kv_cache_scheme is not None:
        return (req.kv_cache_scheme or None), "asked for explicitly" if req.kv_cache_scheme else "disabled explicitly"
    return recommend_kv(tc, catalog, analysis.template.get("kv_layers") or [])


def _budget_check(tc: Deployment, analysis: ModelAnalysis, catalog: QuarkCatalog,
                  req: PlanRequest) -> BudgetCheck | None:
    """``fits(scheme) -> (ok, why)`` against a serving budget stated in the goal, or None."""
    target = tc.target
    if not (tc.budget and target):
        return None
    kv = req.kv_cache_scheme or recommend_kv(tc, catalog, analysis.template.get("kv_layers") or [])[0]

    def fits(scheme: str) -> tuple[bool, str]:
        out = resources.output_bytes(analysis, scheme, catalog["scheme_info"].get(scheme, {}))
        fit = resources.serving_fit(analysis, out, kv, target.memory_gb, tc.budget)
        return fit.fits_budget, resources.serving_text(fit, target.label, kv)

    return fits


def _scheme_reason(why: str, tc: Deployment, scheme: str) -> str:
    """A scheme the user named: say whether the target runs it natively (a warning row says when not)."""
    if tc.family is None or not why.startswith(("asked", "the goal")):
        return why
    kind = format_family(scheme)
    if kind == "weight-only":
        return f"{why}; {tc.label} runs it as weight-only (dequantized on the fly)"
    native = kind in tc.family.native
    return f"{why}; {tc.label} " + ("runs it natively" if native else "has no native support for it (see the warning)")


def _calibration_size(req: PlanRequest, calibration: PlannedCalibration, info: SchemeInfo, algorithm: str | None, kv: str | None,
                      accelerator: str) -> str:
    if req.num_calib_samples:
        return "explicit"
    if not info.get("static_activations") and not algorithm and not kv:
        calibration.num_samples = min(calibration.num_samples, LITTLE_CALIBRATION)
        return (f"{calibration.num_samples} samples: no static activation or KV scales and no algorithm, "
                "so calibration only sees weight ranges")
    if accelerator in ("cpu", "unknown"):
        return "CPU-sized default: enough for min-max observers, minutes not hours"
    return "quark-cli's default sample count"


def _target_and_fit(work: resources.QuantizeWorkload, tc: Deployment, env: HostEnv, output_dir: Path,
                    engine: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plan's ``target`` (with its serving fit) and ``resources`` (this host's fit, with table rows)."""
    analysis, scheme, info, algorithm, kv = work.analysis, work.scheme, work.info, work.algorithm, work.kv
    target = {**tc.to_dict(), "warnings": scheme_warnings(tc, scheme, kv)}
    rows = []
    if tc.target is not None:
        serving = resources.serving_fit(analysis, resources.output_bytes(analysis, scheme, info), kv,
                                        tc.target.memory_gb, tc.budget)
        target["serving_fit"] = serving.to_dict()
        stated = "from your goal" if tc.budget else "assumed: state one in the goal, e.g. 'fit one MI300X with 32k context'"
        need = gb(serving.weights_bytes + serving.kv_cache_bytes)
        value = f"{serving.devices_needed} x {tc.target.label}" if serving.devices_needed else f"{need} of RAM"
        rows.append({"decision": "serving fit", "value": value,
                     "reason": f"{resources.serving_text(serving, tc.target.label, kv)} (context and batch {stated})"})
    speedup = decode_speed.plan_prediction(analysis, resources.output_bytes(analysis, scheme, info), kv, tc, scheme)
    target["decode_speedup"] = speedup.as_dict()  # the speed tier's report puts its measured gain beside it
    rows.append({"decision": "expected decode speed-up", "value": f"{speedup.speedup:.2f}x",
                 "reason": f"bytes moved per generated token: {speedup.text()}"})
    host = host_memory.host_capacity(env, output_dir)
    rerun = resource_rows.rerun_command(analysis.model["model_path"], output_dir, scheme, algorithm, kv, work.calibration,
                                    tc.target.name if tc.target else None)
    fit = host_fit.assess(work, host, rerun, engine=engine)
    fit["rows"] = rows + resource_rows.decision_rows(fit)
    return target, fit


def _exclusions(req: PlanRequest, analysis: ModelAnalysis) -> tuple[list[str], str, str]:
    """Layers kept unquantized, who chose them, and why."""
    if req.exclude_layers is not None and not req.exclude_layers and not req.no_exclusions:
        raise UsageError("An empty exclusion list would quantize every layer, lm_head included.",
                         "Pass --no-exclusions to mean that, or omit --exclude to keep the template defaults.")
    if req.no_exclusions:
        return [], "user", "you disabled all exclusions explicitly (--no-exclusions)"
    if req.exclude_layers:
        return list(req.exclude_layers), "user", "your patterns replace the template defaults"
    return list(analysis.template["exclude_layers"]), "template_default", \
        f"Quark's {analysis.model_type} template defaults"


def _fitting_scheme(analysis: ModelAnalysis, env: HostEnv, req: PlanRequest, catalog: QuarkCatalog,
                    tc: Deployment) -> tuple[str, str]:
    """The scheme the request and target ask for, held against every quantized linear's group and
    block sizes: a planner's choice falls back to the nearest that fits, a named one is refused."""
    scheme, why = choose_scheme(req, env, catalog, tc, _budget_check(tc, analysis, catalog, req))
    return fit_to_model(analysis.model["model_path"], SchemeChoice(scheme, why, bool(req.scheme), target_fallbacks(tc)),
                        req.layer_quant_config, _exclusions(req, analysis)[0], catalog["schemes"])


def settle_plan_groups(model_path: str, scheme: str, overrides: dict[str, str], excludes: list[str], widen: bool,
                       known: list[str]) -> Settled:
    """Overrides and exclusions along vLLM's fused groups (plan/groups.py): a split is refused, or widened
    when asked, the widened overrides then held against the linears they now match."""
    names = list(linear_shapes(model_path, []))  # no local headers: nothing to hold the groups against
    settled = settle_groups(names, scheme, overrides, excludes, widen)
    if settled.widened:
        fit_to_model(model_path, SchemeChoice(scheme), settled.overrides, settled.excludes, known)
    return settled


def regroup(plan: QuantPlan, widen: bool, known: list[str]) -> QuantPlan:
    """``plan`` after a step that changed its overrides or exclusions (a sensitivity proposal), held to the
    groups as make_plan holds the user's."""
    settled = settle_plan_groups(plan.model["model_path"], plan.global_scheme, plan.layer_quant_config,
                                 list(plan.exclude_layers), widen, known)
    if settled.widened:
        plan.layer_quant_config, plan.exclude_layers = settled.overrides, settled.excludes
        for key, value in (("layer_quant_config", plan.layer_quant_config), ("exclude_layers", plan.exclude_layers)):
            if (row := plan.decision(key)) is not None:
                row.value = value
        plan.decisions += _groups_row(settled)
    return plan


def _grouped_choices(req: PlanRequest, analysis: ModelAnalysis, scheme: str,
                     catalog: QuarkCatalog) -> tuple[Settled, str, str]:
    """The exclusions (who chose them, why) and overrides, settled along vLLM's fused groups."""
    excludes, source, why = _exclusions(req, analysis)
    settled = settle_plan_groups(analysis.model["model_path"], scheme, req.layer_quant_config, excludes,
                                 req.widen_groups, catalog["schemes"])
    return settled, source, why


def _expert_warnings(analysis: ModelAnalysis, tc: Deployment, scheme: str, overrides: dict[str, str],
                     excludes: list[str]) -> list[str]:
    """A warning when the plan puts an MoE's routed experts in a format the target's vLLM does not load for experts
    (plan/targets.py ``expert_refusal``: the rule the budget search and the sensitivity proposal follow)."""
    if not analysis.architecture.get("is_moe") or tc.family is None or tc.family.moe is None:
        return []  # nothing to read: no routed experts, or no rule for the target
    names = list(linear_shapes(analysis.model["model_path"], []))
    refused = refused_experts(names, scheme, overrides, excludes, tc.family)
    if not refused:
        return []
    (given, why), layers = next(iter(refused.values())), len(refused)
    fix = f"keep them unquantized ({keep_experts_unquantized(excludes)})"
    if tc.family.moe:
        fix = (f"give them a format it serves (--layer-quant-scheme '*mlp.experts*' {tc.family.moe[0]}, a pattern "
               f"that also matches the fused-MoE module vLLM reads them by) or {fix}")
    return [f"the routed experts of {layers} MoE layer(s) are planned in {given}, but {why}: to serve it on "
            f"{tc.name}, {fix}"]


def _groups_row(settled: Settled) -> list[Decision]:
    if not settled.widened:
        return []
    return [Decision("deployment_groups", settled.widened,
                     f"--widen-groups: {len(settled.widened)} group(s) vLLM fuses widened to one scheme each: "
                     + "; ".join(settled.widened[:3]) + (" ..." if len(settled.widened) > 3 else ""))]


def _plan_calibration(req: PlanRequest, analysis: ModelAnalysis, analysis_ref: Path, accelerator: str,
                      info: SchemeInfo, algorithm: str | None, kv: str | None) -> tuple[PlannedCalibration, str, str, str]:
    """The calibration source and its size, the text read and tokenized now (before anything runs)."""
    calibration, why = _calibration(req, accelerator, read_model_config(analysis.model.get("model_path")))
    size_why = _calibration_size(req, calibration, info, algorithm, kv, accelerator)
    size_why, size = check_calibration_text(calibration, req, analysis, Path(analysis_ref).parent, size_why)
    return calibration, why, size, size_why


def _warning_rows(target: dict[str, Any], more: list[str], scheme: str) -> list[Decision]:
    """The target's warnings, with the routed experts' (added to the target's list), as plan rows."""
    target["warnings"] += more
    return [Decision("warning", scheme, w) for w in target["warnings"]]


def make_plan(analysis: ModelAnalysis, env: HostEnv, req: PlanRequest, catalog: QuarkCatalog, analysis_ref: Path,
              output_dir: Path) -> QuantPlan:
    model_type = analysis.model_type
    accelerator, arch = gpu_of(env)
    tc = deployment_of(req.target, req.goal, env)
    scheme, scheme_why = _fitting_scheme(analysis, env, req, catalog, tc)
    info = catalog["scheme_info"].get(scheme, {})
    algorithm, algo_why = choose_algorithm(req, info, analysis.template.get("algorithms"))
    kv, kv_why = _choose_kv(req, tc, catalog, analysis)
    check_compatible(model_type, scheme, algorithm, kv, req.layer_quant_config, analysis, catalog)
    groups, ex_source, ex_why = _grouped_choices(req, analysis, scheme, catalog)
    excludes, overrides = groups.excludes, groups.overrides
    if analysis.model.get("has_custom_code") and not req.trust_remote_code and not analysis.template["available"]:
        raise UsageError("This model needs its own code to load and --trust-remote-code was not given.",
                         "Review the model repository's code, then pass --trust-remote-code.")
    calibration, calib_why, calib_size, calib_size_why = _plan_calibration(req, analysis, analysis_ref, accelerator,
                                                                           info, algorithm, kv)
    device = _device(req, env, analysis.size["bytes"])
    # The engines registry decides (plan/engines/): its automatic choice and its constraints.
    engine, engine_why = choose_engine(req.engine, accelerator, calibration, device.device == "cpu")
    work = resources.QuantizeWorkload(analysis, scheme, info, algorithm, calibration, device, kv)
    engine, engine_why = host_fit.engine_for_host(work, engine, engine_why, req.engine, env)  # file2file when too big
    get_engine(engine).check_constraints(info, algorithm, device)
    reading = source_reading.decide(analysis, engine, device, Path(analysis_ref).parent)  # FP8 / .bin sources
    hw = f"{accelerator}{' ' + arch if arch else ''}"
    decisions = [
        Decision("target", tc.name, f"{tc.label}; {tc.source}; priority: {tc.priority}"),
        Decision("global_scheme", scheme, _scheme_reason(scheme_why, tc, scheme)),
        Decision("algorithm", algorithm, algo_why),
        Decision("kv_cache_scheme", kv, kv_why),
        Decision("exclude_layers", excludes, ex_why),
        Decision("layer_quant_config", overrides, "your per-pattern overrides" if req.layer_quant_config else
                 "no overrides"),
        *_groups_row(groups),
        Decision("calibration", calibration.source_file or calibration.dataset,
                 calib_why + source_note(calibration)),
        Decision("calibration_size", calib_size, calib_size_why),
        Decision("device", device.device + (" (multi-device)" if device.multi_device else ""),
                 "explicit" if req.device else f"detected {hw}"),
        Decision("engine", engine, engine_why),
        *([Decision.of(source_reading.decision_row(reading))] if reading.staged else []),
        Decision("trust_remote_code", req.trust_remote_code,
                 "approved explicitly (--trust-remote-code)" if req.trust_remote_code else
                 "off: nothing from the model repository is executed"),
        Decision("evaluation_intent", req.evaluation_intent, "Phase 3 asks before running"),
        Decision("output_format", "Hugging Face safetensors (Quark format)", "what vLLM/transformers load"),
    ]
    target, fit = _target_and_fit(work, tc, env, output_dir, engine)
    decisions += _warning_rows(target, _expert_warnings(analysis, tc, scheme, overrides, excludes), scheme)
    decisions += [Decision.of(row) for row in fit.pop("rows") + source_reading.disk_problem(reading, fit)]
    plan = QuantPlan(
        model={"model_type": model_type, "analysis_ref": str(analysis_ref), "model_path": analysis.model["model_path"]},
        global_scheme=scheme, exclude_layers=excludes, exclude_source=ex_source,
        layer_quant_config=overrides, algorithm=algorithm, kv_cache_scheme=kv,
        calibration=calibration, device_strategy=device, engine=PlanEngine(engine, engine_why),
        trust_remote_code=req.trust_remote_code, evaluation_intent=req.evaluation_intent, decisions=decisions,
        requires_confirmation=True, output_dir=str(output_dir), target=target, resources=fit,
        source_reading=reading,
    )
    return plan


def check_plan(plan: QuantPlan, analysis: ModelAnalysis, catalog: QuarkCatalog) -> None:
    """Re-check a (hand-edited) plan against the installed Quark, as make_plan does."""
    check_compatible(analysis.model_type, plan.global_scheme, plan.algorithm, plan.kv_cache_scheme,
                      plan.layer_quant_config, analysis, catalog)
    fit_to_model(analysis.model["model_path"], SchemeChoice(plan.global_scheme), plan.layer_quant_config,
                 list(plan.exclude_layers), catalog["schemes"])
    settle_plan_groups(analysis.model["model_path"], plan.global_scheme, plan.layer_quant_config,
                       list(plan.exclude_layers), False, catalog["schemes"])  # an edited plan is refused, never widened
    engine = ENGINES.get(plan.engine.name)
    if engine is not None and engine.reads_text_file and plan.calibration.source == "local_file":
        check_text_source(plan.calibration.path or "", "calibration data")
