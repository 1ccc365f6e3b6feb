"""Tier 3, the executor: runs an approved CommandPlan and stops exactly what it started (its
servers by pid, its container by id). Scores come only from results this run wrote."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from ..errors import QpeError
from .context import TierContext, TierOutcome
from .vllm_commands import CommandPlan, shell_line

HEALTH_TIMEOUT_S = 1800  # large models take a long time to load and compile
PORT_FREE_TIMEOUT_S = 120  # a stopped server releases its port once its workers have exited


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

    def start(self, argv: list[str], log_name: str) -> subprocess.Popen:
        log = (self.workdir / log_name).open("ab")
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def port_free(self, port: int) -> bool:
        """Nothing listens on the port (a connection is refused)."""
        with socket.socket() as sock:
            sock.settimeout(2)
            return sock.connect_ex(("127.0.0.1", port)) != 0

    def healthy(self, port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def stop_server(self, process: subprocess.Popen, pid_file: Path | None, container: str | None) -> None:
        if container and pid_file and pid_file.is_file():
            pid = pid_file.read_text().strip()
            if pid.isdigit():  # the server's own pid inside the container, written by its launcher
                # sh's own kill: a slim image may have no /bin/kill
                subprocess.run(["docker", "exec", container, "sh", "-c", f"kill -TERM {pid}"], capture_output=True)
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def execute_plan(ctx: TierContext, plan: CommandPlan, executor: Executor, details: dict,
                 commands: list[dict]) -> TierOutcome:
    from .tier_lmeval import scores_from

    options = ctx.options
    scores: dict[str, dict] = {}
    directions: dict = {}
    container_id = None
    try:
        for command in plan.setup:
            ctx.log(command.purpose)
            output = executor.run(command.argv, timeout=3600)
            if command is plan.setup[0] and plan.create_container:
                container_id = output.strip().splitlines()[-1]  # `docker run -d` prints the new id
        for i, (label, (serve, _health, evaluate_cmd)) in enumerate(plan.per_model.items()):
            # Never health-check someone else's server: the previous one must have let go of the port.
            _wait_port_free(executor, options.vllm_port, label, PORT_FREE_TIMEOUT_S if i else 0)
            process = executor.start(serve.argv, f"vllm_{label}.log")
            try:
                _wait_healthy(executor, process, options.vllm_port, ctx.workdir / f"vllm_{label}.log")
                ctx.log(evaluate_cmd.purpose)
                before = results_files(plan.output_dirs[label])
                executor.run(evaluate_cmd.argv)
            finally:
                executor.stop_server(process, ctx.workdir.resolve() / f"vllm_{label}.pid", plan.container)
            scores[label], _, directions = scores_from(results_of_this_run(plan.output_dirs[label], before))
    finally:
        container_id = container_id or created_container_id(plan)
        if container_id:  # only a container this run created, addressed by its id
            for verb in ("stop", "rm"):
                executor.run(["docker", verb, container_id], timeout=120, check=False)
            plan.container_id_file.unlink(missing_ok=True)  # our own record of it; the next run needs the name
    return TierOutcome(
        quantized=scores.get("quantized", {}),
        baseline=scores.get("baseline"),
        directions=directions,
        details=details | {"commands": commands},
        artifacts={f"lm_eval {k} results": str(v) for k, v in plan.output_dirs.items()},
    )


def created_container_id(plan: CommandPlan) -> str | None:
    """The id docker recorded for the container this run created, if it got as far as creating one."""
    path = plan.container_id_file
    if not (plan.create_container and path and path.is_file()):
        return None
    return path.read_text().strip() or None


def _wait_port_free(executor: Executor, port: int, label: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not executor.port_free(port):
        if time.monotonic() >= deadline:
            raise QpeError(f"Port {port} is still in use, so the {label} model's vLLM server cannot start: "
                           "stop what holds it, or choose another --vllm-port, and rerun.")
        time.sleep(1)


def _wait_healthy(executor: Executor, process, port: int, log_path: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if executor.healthy(port):
            return
        if process.poll() is not None:
            raise QpeError(
                f"The vLLM server exited (code {process.returncode}) before it was healthy; see {log_path}."
            )
        time.sleep(5)
    raise QpeError(f"The vLLM server was not healthy after {HEALTH_TIMEOUT_S} s.")


def results_files(output: Path) -> dict[Path, int]:
    """lm_eval's results files under ``output`` now, with their modification times."""
    return {p: p.stat().st_mtime_ns for p in output.rglob("results_*.json")} if output.is_dir() else {}


def results_of_this_run(output: Path, before: dict[Path, int]) -> dict:
    """The newest results file lm_eval wrote after ``before`` was taken: a file an earlier run
    left in the same directory is never read as this run's scores."""
    fresh = [(mtime, p) for p, mtime in results_files(output).items() if before.get(p) != mtime]
    if not fresh:
        raise QpeError(f"lm_eval wrote no new results under {output} in this run; see its output above.")
    return json.loads(max(fresh)[1].read_text(encoding="utf-8"))
