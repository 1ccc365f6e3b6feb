"""Tier 3: a vLLM server (ROCm) and lm-eval over its OpenAI-compatible endpoint.

Off ROCm nothing runs: the exact commands are planned, printed and recorded for a ROCm host.
On ROCm the plan is executed after approval: a holder container with a non-vLLM entrypoint
(the ROCm image's entrypoint *is* vllm), ``docker exec ... vllm serve`` inside it, a health
wait, lm-eval, then only what this run started is stopped: its server by pid, its container by id.

One job per module: vllm_detect (the host), vllm_commands (the command plan), vllm_executor
(running it); this module is the tier itself (prepare -> estimate, run -> outcome).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..checkpoints import as_gatekeeper
from ..errors import UsageError
from .context import RuntimeEstimate, TierContext, TierOutcome
from .vllm_commands import DEFAULT_TASKS, CommandPlan, ServedModel, plan_commands, shell_line
from .vllm_detect import Environment, choose_runtime, detect_environment
from .vllm_executor import Executor, execute_plan

__all__ = ["CommandPlan", "Environment", "Executor", "ServedModel", "VllmPrepared", "choose_runtime",
           "detect_environment", "plan_commands", "prepare", "run"]


@dataclass
class VllmPrepared:
    """What prepare() hands to run(): the detected host, the command plan and the estimate."""

    ctx: TierContext
    env: Environment
    plan: CommandPlan
    models: list[ServedModel]
    estimate: RuntimeEstimate


def prepare(ctx: TierContext, env: Environment | None = None) -> VllmPrepared:
    env = env or detect_environment()
    models = [ServedModel("quantized", ctx.model_dir.resolve(), "quantized")]
    if ctx.options.baseline:
        models.append(ServedModel("baseline", Path(ctx.options.baseline).resolve(), "baseline"))
    runtime = choose_runtime(env, ctx.options.vllm_runtime)
    plan = plan_commands(models, ctx.options, ctx.workdir, runtime, env)
    from .loading import model_size_bytes

    size = sum(model_size_bytes(m.path) for m in models)
    where = "ROCm: " + ", ".join(env.rocm_evidence) if env.rocm else "not ROCm: commands deferred"
    estimate = RuntimeEstimate(
        tier="3 (vllm)",
        seconds=None,
        hardware=where,
        model_bytes=size,
        data=f"tasks {', '.join(ctx.options.tasks or DEFAULT_TASKS)}"
        + (f", limit {ctx.options.limit:g}" if ctx.options.limit is not None else ", full benchmarks"),
        basis="no pilot: the server's speed is only known once it runs; on a ROCm GPU this tier is the fastest",
        warning=None if env.rocm else "This host has no ROCm: nothing will run; the commands are recorded.",
        threshold_s=ctx.options.confirm_above_s,
    )
    return VllmPrepared(ctx, env, plan, models, estimate)


def run(prepared: VllmPrepared, executor: Executor | None = None) -> TierOutcome:
    ctx, plan = prepared.ctx, prepared.plan
    details = {"environment": prepared.env.as_dict(), "runtime": plan.runtime, "container": plan.container}
    commands = [c.as_dict() for c in plan.all_commands()]
    if not prepared.env.rocm:
        return _deferred(ctx, plan, details, commands)
    _check_runtime(plan, prepared.env)
    summary = "\n".join(f"{c.purpose}: {shell_line(c.argv)}" for c in plan.all_commands())
    # Bound to the exact commands, container creation included: other commands ask again.
    as_gatekeeper(ctx.approver).require("eval", [c.argv for c in plan.all_commands()], summary,
                                        "to run these exact commands.")
    return execute_plan(ctx, plan, executor or Executor(ctx.workdir), details, commands)


def _deferred(ctx: TierContext, plan: CommandPlan, details: dict, commands: list[dict]) -> TierOutcome:
    ctx.log("Tier 3 needs ROCm; this host has none. Run these later on a ROCm host:")
    for command in plan.all_commands():
        ctx.log(f"  # {command.purpose}\n  {shell_line(command.argv)}")
    return TierOutcome(
        quantized={},
        details=details,
        deferred_commands=commands,
        notes=[
            "Tier 3 was not run: no ROCm on this host. The exact commands are recorded below.",
            *plan.notes,
        ],
    )


def _check_runtime(plan: CommandPlan, env: Environment) -> None:
    if plan.runtime == "docker" and not env.docker:
        raise UsageError(
            "Tier 3 with the docker runtime needs a reachable docker daemon; start it or use --vllm-runtime host."
        )
    if plan.runtime == "host" and not env.vllm:
        raise UsageError(
            "Tier 3 with the host runtime needs vllm importable here; install it or use --vllm-runtime docker."
        )
