"""The serving check: will vLLM load this export? Advisory: its answer never stops the run.

Where a vLLM is found by its interpreter (``--vllm-python``, QUARK_PTQ_EVAL_VLLM_PYTHON, else the checkout's
own ``.venv-vllm``: runtime/vllm_host.vllm_python, as Tier 3 finds it), the export is served for real on a free
local port until /health answers and it answers one 2-token completion (a kernel that kills the engine at its
first forward passes /health), then stopped with everything it spawned: served, or vLLM's refusal in one
sentence (the kernel or scheme it names). Where vLLM is importable in this interpreter instead, the export's ``quantization_config`` is held against vLLM's
own Quark config classes (no server). Elsewhere the report says it was not checked.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.validate.registry import CheckInputs
from quark_ptq_eval.validate.report import CheckResult, Finding

if TYPE_CHECKING:
    from quark_ptq_eval.runtime.vllm_host import HostVllm
    from quark_ptq_eval.runtime.vllm_server import ServerHandover, ServerNotHealthy, ServerPlan

SERVE_TIMEOUT_S = 600.0  # a tiny model is healthy in 20-25 s on 2 CPU cores; large ones load for minutes
MAX_MODEL_LEN = 2048  # the check needs the weights to load, not a long context: keeps the KV cache small


def check_serving(ctx: CheckInputs) -> CheckResult:
    from quark_ptq_eval.runtime.vllm_host import find_host_vllm

    result = CheckResult("serve")
    if ctx.shared.structural_failed:
        result.skipped_reason = "a structural check failed: serving weights known to be wrong proves nothing"
        return result
    if split := _split_of(ctx):  # vLLM's refusal, known without starting it
        result.findings.append(Finding("serving", f"vLLM refuses this export: {split}.", side="quark",
                                       evidence="quantization_config's layer_quant_config and exclude, per linear"))
        return result
    try:
        host = find_host_vllm(ctx.vllm_python)
    except QpeError as exc:
        result.findings.append(Finding("vllm", exc.message, side="environment"))
        return result
    if host is not None:
        from quark_ptq_eval.runtime.vllm_server import current_handover

        _serve(ctx.quantized, host, result, ctx.vllm_args, current_handover())
    elif importlib.util.find_spec("vllm") is not None:
        _against_classes(ctx.qconfig, result)
    else:
        result.skipped_reason = ("not checked: no vLLM on this host (name one with --vllm-python, or build "
                                 "the checkout's own with `make vllm-env`)")
    return result


def _split_of(ctx: CheckInputs) -> str | None:
    from quark_ptq_eval.plan.scheme_fit import linear_shapes

    if not ctx.qconfig or not ctx.source:
        return None
    return fused_split(ctx.qconfig, list(linear_shapes(str(ctx.source), [])))


def fused_split(qconfig: dict[str, Any], names: list[str]) -> str | None:
    """The first group vLLM fuses (plan/groups.py) whose members the export quantizes differently (weights and
    input activations; a KV-cache output quantizer on k/v is vLLM's own business), in words; None: none."""
    import json
    from fnmatch import fnmatchcase

    from quark_ptq_eval.plan.groups import deployment_groups
    from quark_ptq_eval.validate.expectations import module_config

    exclude = list(qconfig.get("exclude") or [])

    def key(name: str) -> str:
        if any(name == p or fnmatchcase(name, p) for p in exclude):
            return "unquantized"
        cfg = module_config(qconfig, name)
        return json.dumps([cfg.weight, cfg.input_tensors] if cfg else None, sort_keys=True, default=str)

    for group in deployment_groups(names):
        if len({key(m) for m in group.members}) > 1:
            return (f"{group.describe()} is one fused layer in vLLM and its members carry different quantization "
                    "configs (vLLM requires all to use the same scheme); plan it along the group (--widen-groups)")
    return None


def _serve(model: Path, host: HostVllm, result: CheckResult, vllm_args: tuple[str, ...] = (),
           handover: ServerHandover | None = None) -> None:
    """Start vLLM on the export (sized as Tier 3 sizes it), wait for health or its exit, ask it for one
    short completion, stop it: served, or its reason. Where a later user of the model's server was named
    (``handover``, compare --speed: the cell's speed measurement), the server is the one it
    asks for, sized for it, and handed to it before it stops: the export is served once for both."""
    from quark_ptq_eval.runtime.vllm_host import failure_reason
    from quark_ptq_eval.runtime.vllm_sizing import ServerDoesNotFit

    plan = handover.server_plan() if handover is not None else None
    if plan is None:
        handover = None
        try:
            plan = _own_plan(model, host, vllm_args)
        except ServerDoesNotFit as exc:
            result.stats.update(served=False, vllm=host.describe())
            result.findings.append(Finding("serving", f"not started: {exc.message}", side="environment"))
            return
    log = plan.log_path
    result.stats["server_args"] = plan.sizing.as_dict()
    result.notes += [f"server argument {line}" for line in plan.sizing.lines()]
    failed, seconds, unanswered = _started(plan, handover)
    served = failed is None and unanswered is None
    result.stats.update(served=served, vllm=host.describe(), seconds_to_healthy=round(seconds, 1), argv=plan.argv)
    result.notes.append(f"command: {' '.join(plan.argv)}")
    if handover is not None:
        result.stats["server_log"] = str(log)
        result.notes.append(f"the server was the speed measurement's, handed to it before it stopped (log: {log})")
    if served:
        result.notes.append(f"served by {host.distribution} {host.version}: healthy after {seconds:.0f} s, "
                            "and it answered a 2-token completion")
        if handover is None:
            log.unlink(missing_ok=True)
        return
    if handover is not None:
        handover.not_served(failed or unanswered or "")
    if unanswered:  # loaded, then failed its first forward: the root cause is in its log, if it logged one
        reason = f"it loads the export but failed its first request ({failure_reason(log) or unanswered})"
    else:
        assert failed is not None
        reason = failed.reason or (f"not healthy after {plan.health_timeout_s:g} s" if not failed.exited
                                   else f"it exited with code {failed.returncode}")
    result.findings.append(Finding(
        "serving", f"{host.distribution} {host.version} does not serve this export: {reason.rstrip('.')}.",
        side="environment", evidence=f"the server's log: {log}"))


def _own_plan(model: Path, host: HostVllm, vllm_args: tuple[str, ...]) -> ServerPlan:
    """The check's own server: a short context (the weights must load), a free port, a scratch log."""
    from quark_ptq_eval.runtime.vllm_host import free_port, host_server_argv
    from quark_ptq_eval.runtime.vllm_server import ServerPlan
    from quark_ptq_eval.runtime.vllm_sizing import sized_for

    sizing = sized_for(model, host.cpu, vllm_args, context=MAX_MODEL_LEN, context_origin="check",
                       context_reason="the check needs the weights to load, not a long context")
    port = free_port()
    log = _scratch_log(port)  # never inside the user's export
    return ServerPlan(host_server_argv(host, model, port, "serve-check", sizing), port, log, "serve-check", sizing,
                      SERVE_TIMEOUT_S)


def _started(plan: ServerPlan, handover: ServerHandover | None) -> tuple[ServerNotHealthy | None, float, str | None]:
    """The server started, asked for one short completion once healthy (then handed over, if it answered), and
    stopped: why it was not healthy (None: it was), the seconds to healthy (or to giving up), and what went
    wrong with the completion."""
    from quark_ptq_eval.runtime.vllm_host import first_completion
    from quark_ptq_eval.runtime.vllm_server import ServerNotHealthy, vllm_server

    try:
        with vllm_server(plan.argv, plan.port, plan.log_path, plan.health_timeout_s, what="the serving check") as server:
            unanswered = first_completion(plan.port, plan.served_name)
            if unanswered is None and handover is not None:
                handover.take(server)
            return None, server.healthy_after_s, unanswered
    except ServerNotHealthy as exc:
        return exc, exc.seconds, None


def _scratch_log(port: int) -> Path:
    """A new empty file for this start: a failed check keeps its log as evidence, and the server
    appends, so a name made of the port alone let a later start on that port read an earlier error."""
    import os
    import tempfile

    handle, name = tempfile.mkstemp(prefix=f"quark-ptq-eval-serve-check-{port}-", suffix=".log")
    os.close(handle)
    return Path(name)


def _against_classes(qconfig: dict[str, Any] | None, result: CheckResult) -> None:
    """vLLM importable here: its Quark config class must accept the export's quantization_config."""
    if not qconfig:
        result.notes.append("no quantization_config: vLLM serves the weights as a plain model")
        return
    try:
        from vllm.model_executor.layers.quantization.quark.quark import QuarkConfig

        QuarkConfig.from_config(qconfig)
    except ImportError as exc:
        result.skipped_reason = f"not checked: vLLM's Quark classes could not be imported ({exc})"
        return
    except Exception as exc:  # noqa: BLE001 - vLLM's own refusal, whatever its type, is the answer
        result.findings.append(Finding("serving", f"vLLM's QuarkConfig refuses this quantization_config: {exc}",
                                       side="environment"))
        return
    result.notes.append("vLLM's QuarkConfig accepts this quantization_config (classes only: nothing was served)")
