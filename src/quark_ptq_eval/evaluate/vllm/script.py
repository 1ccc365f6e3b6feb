"""Tier 3 deferred, as a script: ``tier3_deferred.sh`` runs the planned commands top to bottom on a
ROCm host. Each server starts detached, is waited on (health, with a timeout), evaluated, stopped,
and its port seen free before the next model's server starts; a trap stops whatever the script
started (server, container) on any exit, failure included.

The same steps, as exact argument lists, are what the report shows (``script_steps``).
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quark_ptq_eval.base.fsio import atomic_write_text
from quark_ptq_eval.evaluate.serving.commands import (
    CommandPlan,
    PlannedCommand,
    ServedModel,
    health_argv,
    launch_line,
    pid_file_for,
    server_argv,
)
from quark_ptq_eval.evaluate.serving.multinode import script_block

if TYPE_CHECKING:
    from quark_ptq_eval.evaluate.options import EvalOptions

SCRIPT_NAME = "tier3_deferred.sh"

# Shell functions shared by both runtimes; `run_in` and `launch` are defined per runtime above them.
FUNCTIONS = r"""
say() { printf 'tier3_deferred.sh: %s\n' "$*" >&2; }
server_pid() { cat "$SERVER_PID_FILE" 2>/dev/null || true; }

# curl exits 7 when nothing listens on the port: the port is free.
port_free() {
  local rc=0
  curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$PORT/health" || rc=$?
  [ "$rc" -eq 7 ]
}

wait_port_free() {  # seconds
  local deadline=$((SECONDS + $1))
  until port_free; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep "$HEALTH_POLL_S"
  done
}

start_server() {  # label, pid file, log file, launch line
  if ! port_free; then
    say "port $PORT is already in use: stop what holds it (or plan again with another --vllm-port) and rerun."
    return 1
  fi
  SERVER_LABEL=$1 SERVER_PID_FILE=$2 SERVER_LOG=$3
  rm -f "$SERVER_PID_FILE"
  say "starting the $SERVER_LABEL model's vLLM server, detached (log: $SERVER_LOG)"
  launch "$4"
}

wait_healthy() {
  local deadline=$((SECONDS + HEALTH_TIMEOUT_S)) pid
  until curl -sf -o /dev/null --max-time 3 "http://127.0.0.1:$PORT/health"; do
    pid=$(server_pid)
    if [ -n "$pid" ] && ! run_in kill -0 "$pid"; then
      say "the $SERVER_LABEL model's vLLM server exited before it was healthy; see $SERVER_LOG."
      return 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "the $SERVER_LABEL model's vLLM server was not healthy on port $PORT after $HEALTH_TIMEOUT_S s; see $SERVER_LOG (a large model may need HEALTH_TIMEOUT_S=3600)."
      return 1
    fi
    sleep "$HEALTH_POLL_S"
  done
  say "the $SERVER_LABEL model's server is healthy on port $PORT"
}

stop_server() {
  [ -n "$SERVER_PID_FILE" ] || return 0
  local pid
  pid=$(server_pid)
  say "stopping the $SERVER_LABEL model's server${pid:+ (pid $pid)}"
  [ -z "$pid" ] || run_in kill -TERM "$pid" || true
  if ! wait_port_free "$STOP_TIMEOUT_S"; then
    say "the $SERVER_LABEL model's server still holds port $PORT after $STOP_TIMEOUT_S s: killing it"
    [ -z "$pid" ] || run_in kill -KILL "$pid" || true
    wait_port_free 30 || { say "port $PORT is still in use after the kill; free it by hand."; return 1; }
  fi
  SERVER_PID_FILE=""
}

cleanup() {
  local status=$?
  trap - EXIT
  set +e
  stop_server
  # interrupted inside `docker run`: the id is not in CONTAINER_ID yet, but docker wrote it to CIDFILE
  [ -n "$CONTAINER_ID" ] || [ -z "$CIDFILE" ] || [ ! -s "$CIDFILE" ] || CONTAINER_ID=$(cat "$CIDFILE")
  if [ -n "$CONTAINER_ID" ]; then
    say "stopping and removing the container this script created ($CONTAINER_ID)"
    docker stop "$CONTAINER_ID" >/dev/null
    docker rm "$CONTAINER_ID" >/dev/null
    rm -f "$CIDFILE"
  fi
  [ "$status" -eq 0 ] || say "failed (exit $status); what it started is stopped."
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
"""

# `run_in kill ...` uses sh's own kill (a slim image may have no /bin/kill) and silences it inside sh:
# a redirection on a shell function would also swallow the output of a trap that fires during it.
RUNTIME_FUNCTIONS = {
    "docker": 'run_in() { docker exec "$CONTAINER" sh -c \'"$@" 2>/dev/null\' sh "$@"; }\n'
              'launch() { docker exec -d "$CONTAINER" sh -c "$1"; }\n',
    "host": 'run_in() { sh -c \'"$@" 2>/dev/null\' sh "$@"; }\nlaunch() { nohup sh -c "$1" >/dev/null 2>&1 & }\n',
}


@dataclass
class ServerRun:
    """One model's server as the script runs it: a pid file and a log in the shared work dir."""

    model: ServedModel
    pid_file: Path
    log: Path
    launch: str  # sh line: records the server's pid, then becomes the server
    evaluate: PlannedCommand


def server_runs(plan: CommandPlan, models: list[ServedModel], options: EvalOptions, workdir: Path) -> list[ServerRun]:
    workdir = workdir.resolve()
    runs = []
    for model in models:
        pid, log = pid_file_for(workdir, model), workdir / f"vllm_{model.label}.log"
        launch = launch_line(server_argv(model, options), pid, log)
        runs.append(ServerRun(model, pid, log, launch, plan.per_model[model.label][2]))
    return runs


def _in_runtime(plan: CommandPlan, line: str, detached: bool = False) -> list[str]:
    if plan.runtime == "docker":
        return ["docker", "exec", *(["-d"] if detached else []), str(plan.container), "sh", "-c", line]
    return ["nohup", "sh", "-c", line] if detached else ["sh", "-c", line]


def script_steps(plan: CommandPlan, runs: list[ServerRun], port: int) -> list[PlannedCommand]:
    """The script's steps as exact argument lists, in its order (what the report shows)."""
    steps = list(plan.setup)
    for run in runs:
        label = run.model.label
        steps += [
            PlannedCommand(f"serve the {label} model (detached; its pid in {run.pid_file.name})",
                           _in_runtime(plan, run.launch, detached=True), background=True),
            PlannedCommand("wait until the server is healthy", health_argv(port)),
            run.evaluate,
            PlannedCommand(f"stop the {label} model's server, then wait until port {port} is free",
                           _in_runtime(plan, f'kill -TERM "$(cat {shlex.quote(str(run.pid_file))})"')),
        ]
    return steps + list(plan.teardown)


def render_script(plan: CommandPlan, runs: list[ServerRun], port: int, workdir: Path) -> str:
    q = shlex.quote
    lines = [
        "#!/usr/bin/env bash",
        "# Tier 3 of quark-ptq-eval, deferred: serve each model with vLLM (detached), wait for health, evaluate",
        "# it with lm-eval over the OpenAI endpoint, stop it, then the next model; a trap stops what it started.",
        f"# Written {time.strftime('%Y-%m-%d %H:%M')} for a ROCm host: the model(s) and {workdir.resolve()}",
        "# must be at the same paths there. Overrides: HEALTH_TIMEOUT_S, HEALTH_POLL_S, STOP_TIMEOUT_S.",
        "set -euo pipefail",
        "",
        f"PORT={port}",
        'HEALTH_TIMEOUT_S="${HEALTH_TIMEOUT_S:-1800}"  # large models take long to load and compile',
        'HEALTH_POLL_S="${HEALTH_POLL_S:-5}"',
        'STOP_TIMEOUT_S="${STOP_TIMEOUT_S:-120}"',
        f"CONTAINER={q(plan.container or '')}",
        'CONTAINER_ID=""  # set once this script has created the container: cleanup removes it by id',
        f"CIDFILE={q(str(plan.container_id_file or ''))}  # where docker records that id as it creates it",
        'SERVER_PID_FILE="" SERVER_LABEL="" SERVER_LOG=""',
        "",
        RUNTIME_FUNCTIONS[plan.runtime] + FUNCTIONS,
    ]
    for step in plan.setup:
        lines.append(f"# {step.purpose}")
        created = plan.create_container and step is plan.setup[0]
        lines.append(f"CONTAINER_ID=$({shlex.join(step.argv)})" if created else shlex.join(step.argv))
    lines += script_block([run.model.tensor_parallel for run in runs])  # a server wider than one node: Ray
    for run in runs:
        lines += [
            "",
            f"# the {run.model.label} model",
            f"start_server {run.model.label} {q(str(run.pid_file))} {q(str(run.log))} {q(run.launch)}",
            "wait_healthy",
            f"# {run.evaluate.purpose}",
            shlex.join(run.evaluate.argv),
            "stop_server",
        ]
    results = " ".join(str(p) for p in plan.output_dirs.values())
    lines += ["", f"say {q('done: lm-eval results under ' + results)}", ""]
    return "\n".join(lines)


def write_script(plan: CommandPlan, models: list[ServedModel], options: EvalOptions, workdir: Path) -> tuple[Path, list[PlannedCommand]]:
    """Write ``tier3_deferred.sh`` (executable) into ``workdir``; return it and its steps."""
    runs = server_runs(plan, models, options, workdir)
    path = atomic_write_text(Path(workdir) / SCRIPT_NAME, render_script(plan, runs, options.vllm_port, workdir))
    path.chmod(0o755)
    return path, script_steps(plan, runs, options.vllm_port)
