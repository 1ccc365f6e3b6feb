"""Tier 3, the executor: runs an approved CommandPlan and stops exactly what it started (its
servers by pid, its container by id). Scores come only from results this run wrote."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Protocol

from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.evaluate.context import TierInputs, TierOutcome
from quark_ptq_eval.evaluate.details import ServerDetails
from quark_ptq_eval.evaluate.serving.commands import CommandPlan, shell_line
from quark_ptq_eval.runtime import vllm_server
from quark_ptq_eval.runtime.vllm_host import start_server, stop_group
from quark_ptq_eval.runtime.vllm_server import ServerControl, wait_port_free

HEALTH_TIMEOUT_S = 1800  # large models take a long time to load and compile
PORT_FREE_TIMEOUT_S = 120  # a stopped server releases its port once its workers have exited


class BesideServer(Protocol):
    """More work on each model's server while it is up (the speed tier's benchmark with --speed): ``start``
    when the server starts (its preparation overlaps the server's start and lm-eval), ``run`` after lm-eval on
    the healthy server, ``cancel`` when the server stops (a no-op after ``run``)."""

    def start(self, label: str) -> None: ...

    def run(self, label: str, server_log: Path) -> None: ...

    def cancel(self, label: str) -> None: ...


class Executor:
    """Runs planned commands; keeps handles so exactly what it started can be stopped."""

    def __init__(self, workdir: Path):
        self.workdir = workdir

    def run(self, argv: list[str], timeout: float | None = None, check: bool = True) -> str:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise QpeError(
                f"`{shell_line(argv[:4])} ...` failed (exit {result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-300:]}"
            )
        return result.stdout

    def start(self, argv: list[str], log_name: str) -> subprocess.Popen[bytes]:
        return start_server(argv, self.workdir / log_name)  # its own process group: stopped with its workers

    def port_free(self, port: int) -> bool:
        """Nothing listens on the port (a connection is refused)."""
        return vllm_server.port_free(port)

    def healthy(self, port: int) -> bool:
        return vllm_server.answers_health(port)

    def stop_server(self, process: subprocess.Popen[bytes], pid_file: Path | None, container: str | None) -> None:
        if container and pid_file and pid_file.is_file():
            pid = pid_file.read_text().strip()
            if pid.isdigit():  # the server's own pid inside the container, written by its launcher
                # sh's own kill: a slim image may have no /bin/kill
                subprocess.run(["docker", "exec", container, "sh", "-c", f"kill -TERM {pid}"], capture_output=True)
        stop_group(process)  # the server (or `docker exec`) and whatever it spawned, nothing else

    def control(self, log_name: str, pid_file: Path, container: str | None) -> ServerControl:
        """This executor's start, health check, stop and port check, for runtime/vllm_server.py's lifecycle."""
        return ServerControl(start=lambda argv, _log: self.start(argv, log_name), healthy=self.healthy,
                             stop=lambda process: self.stop_server(process, pid_file, container),
                             port_free=self.port_free)


def run_command_plan(ctx: TierInputs, plan: CommandPlan, executor: Executor, details: ServerDetails,
                     commands: list[dict[str, Any]], beside: BesideServer | None = None) -> TierOutcome:
    """``beside``: more work on each model's server while it is up, after lm-eval (the speed tier's benchmark
    with --speed): each model's server started once for both."""
    from quark_ptq_eval.evaluate.lmeval.tasks import scores_from

    options = ctx.options
    scores: dict[str, dict[str, Any]] = {}
    stderrs: dict[str, dict[str, Any]] = {}
    samples: dict[str, dict[str, Any]] = {}
    directions: dict[str, Any] = {}
    lm_eval_version = None
    container_id = None
    try:
        for command in plan.setup:
            ctx.log(command.purpose)
            output = executor.run(command.argv, timeout=3600)
            if command is plan.setup[0] and plan.create_container:
                container_id = output.strip().splitlines()[-1]  # `docker run -d` prints the new id
        for i, label in enumerate(plan.per_model):
            before = _serve_and_evaluate(ctx, plan, executor, label, beside, i)
            results = results_of_this_run(plan.output_dirs[label], before)
            scores[label], stderrs[label], directions = scores_from(results)
            samples[label] = samples_of_this_run(plan.output_dirs[label], before)
            lm_eval_version = results.get("lm_eval_version") or lm_eval_version
        if plan.per_model:  # the last server's port released too: nothing of ours left listening
            wait_port_free(options.vllm_port, PORT_FREE_TIMEOUT_S, "the next model", executor.port_free)
    finally:
        container_id = container_id or created_container_id(plan)
        if container_id:  # only a container this run created, addressed by its id
            for verb in ("stop", "rm"):
                executor.run(["docker", verb, container_id], timeout=120, check=False)
            if plan.container_id_file is not None:  # our own record of it; the next run needs the name
                plan.container_id_file.unlink(missing_ok=True)
    details.commands, details.lm_eval_version = commands, lm_eval_version
    add_comparison(details, stderrs, samples, directions)
    return TierOutcome(
        quantized=scores.get("quantized", {}),
        baseline=scores.get("baseline"),
        directions=directions,
        details=details,
        artifacts={f"lm_eval {k} results": str(v) for k, v in plan.output_dirs.items()},
    )


def add_comparison(details: ServerDetails, stderrs: dict[str, Any], samples: dict[str, Any],
                   directions: dict[str, Any]) -> None:
    """lm-eval's standard errors, the verdict's noise and, with a baseline, the paired per-document
    tests, as Tier 2 reports them."""
    from quark_ptq_eval.evaluate.paired_tests import noise_from_stderr, paired_tests

    details.stderr = stderrs
    details.noise = noise_from_stderr(stderrs.get("quantized", {}), stderrs.get("baseline"))
    if samples.get("baseline") and samples.get("quantized"):
        details.paired_tests = paired_tests(samples["baseline"], samples["quantized"], directions)


def created_container_id(plan: CommandPlan) -> str | None:
    """The id docker recorded for the container this run created, if it got as far as creating one."""
    path = plan.container_id_file
    if not (plan.create_container and path and path.is_file()):
        return None
    return path.read_text().strip() or None


def _serve_and_evaluate(ctx: TierInputs, plan: CommandPlan, executor: Executor, label: str,
                        beside: BesideServer | None, index: int) -> dict[Path, int]:
    """``label``'s server (runtime/vllm_server.py), lm-eval on it and the work beside it, the server stopped
    however this ends; lm-eval's results files before its run. Never health-checks someone else's server: the
    previous one must have let go of the port."""
    serve, _health, evaluate_cmd = plan.per_model[label]
    log_name, options = f"vllm_{label}.log", ctx.options
    wait_port_free(options.vllm_port, PORT_FREE_TIMEOUT_S if index else 0, f"the {label} model", executor.port_free)
    ctx.log(f"{serve.purpose}: {shell_line(serve.argv)}")
    control = executor.control(log_name, ctx.workdir.resolve() / f"vllm_{label}.pid", plan.container)
    try:  # the work beside it is cancelled however this ends (a failed start of it included)
        with vllm_server.vllm_server(serve.argv, options.vllm_port, ctx.workdir / log_name,
                                     getattr(options, "vllm_health_timeout_s", HEALTH_TIMEOUT_S),
                                     what=f"the {label} model", control=control,
                                     while_starting=(lambda: beside.start(label)) if beside is not None else None):
            try:
                ctx.log(f"{evaluate_cmd.purpose}: {shell_line(evaluate_cmd.argv)}")
                before = results_files(plan.output_dirs[label])
                executor.run(evaluate_cmd.argv)
                if beside is not None:
                    beside.run(label, ctx.workdir / log_name)
            finally:
                if beside is not None:
                    beside.cancel(label)
    finally:
        if beside is not None:
            beside.cancel(label)  # a no-op once cancelled
    return before


def results_files(output: Path) -> dict[Path, int]:
    """lm_eval's results files under ``output`` now, with their modification times."""
    return {p: p.stat().st_mtime_ns for p in output.rglob("results_*.json")} if output.is_dir() else {}


def samples_of_this_run(output: Path, before: dict[Path, int]) -> dict[str, Any]:
    """The per-document scores (per_sample_scores) from the samples files lm_eval's --log_samples wrote
    with this run's results file (``samples_<task>_<stamp>.jsonl`` next to ``results_<stamp>.json``)."""
    from quark_ptq_eval.evaluate.lmeval.tasks import per_sample_scores

    results = _fresh_results(output, before)
    stamp = results.stem.removeprefix("results_")
    rows: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(results.parent.glob(f"samples_*_{stamp}.jsonl")):
        task = path.name.removeprefix("samples_").removesuffix(f"_{stamp}.jsonl")
        with path.open(encoding="utf-8") as lines:
            rows.setdefault(task, []).extend(json.loads(line) for line in lines if line.strip())
    return per_sample_scores(rows)


def results_of_this_run(output: Path, before: dict[Path, int]) -> dict[str, Any]:
    """The newest results file lm_eval wrote after ``before`` was taken: a file an earlier run
    left in the same directory is never read as this run's scores."""
    results: dict[str, Any] = json.loads(_fresh_results(output, before).read_text(encoding="utf-8"))
    return results


def _fresh_results(output: Path, before: dict[Path, int]) -> Path:
    fresh = [(mtime, p) for p, mtime in results_files(output).items() if before.get(p) != mtime]
    if not fresh:
        raise QpeError(f"lm_eval wrote no new results under {output} in this run; see its output above.")
    return max(fresh)[1]
