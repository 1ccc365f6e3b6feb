"""Tier 3: a vLLM server (ROCm) and lm-eval over its OpenAI-compatible endpoint.

Off ROCm nothing runs: the exact commands are planned, printed and recorded for a ROCm host.
On ROCm the plan is executed after approval: a holder container with a non-vLLM entrypoint
(the ROCm image's entrypoint *is* vllm), ``docker exec ... vllm serve`` inside it, a health
wait, lm-eval, then only what this run started is stopped: its server by pid, its container by id.
"""

from __future__ import annotations

import getpass
import importlib.util
import json
import re
import shutil
import subprocess
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoints import require
from ..errors import QpeError, UsageError
from .context import RuntimeEstimate, TierContext, TierOutcome

DEFAULT_TASKS = ["gsm8k"]
GENERATE_TASK_PREFIXES = (
    "gsm8k",
    "math",
    "minerva",
    "humaneval",
    "mbpp",
    "ifeval",
    "bbh",
    "gpqa",
    "aime",
    "drop",
    "triviaqa",
    "nq_open",
    "coqa",
)
REASONING_GEN_TOKS = 32768
HEALTH_TIMEOUT_S = 1800  # large models take a long time to load and compile
LM_EVAL_API_MODULES = ("aiohttp", "tenacity", "tiktoken")  # what lm_eval[api] adds


@dataclass
class Environment:
    rocm: bool
    rocm_evidence: list[str]
    docker: bool
    in_container: bool
    vllm: bool
    lm_eval_api: bool

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class PlannedCommand:
    purpose: str
    argv: list[str]
    background: bool = False  # a server: started, then stopped by this run

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ServedModel:
    label: str  # "quantized" or "baseline"
    path: Path
    served_name: str


@dataclass
class Plan:
    runtime: str  # "docker" or "host"
    container: str | None
    create_container: bool
    setup: list[PlannedCommand] = field(default_factory=list)
    per_model: dict[str, list[PlannedCommand]] = field(default_factory=dict)  # label -> serve, wait, eval
    teardown: list[PlannedCommand] = field(default_factory=list)
    output_dirs: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def all_commands(self) -> list[PlannedCommand]:
        return [*self.setup, *(c for cmds in self.per_model.values() for c in cmds), *self.teardown]


# ---------------------------------------------------------------- detection


def detect_environment() -> Environment:
    evidence = []
    try:
        import torch

        if getattr(torch.version, "hip", None):
            evidence.append(f"torch.version.hip={torch.version.hip}")
    except ImportError:
        pass
    if shutil.which("rocm-smi"):
        evidence.append("rocm-smi on PATH")
    if Path("/opt/rocm").is_dir():
        evidence.append("/opt/rocm present")
    has_gpu_device = Path("/dev/kfd").exists()
    rocm = bool(evidence) and (has_gpu_device or any(e.startswith("torch.version.hip") for e in evidence))
    return Environment(
        rocm=rocm,
        rocm_evidence=evidence,
        docker=_docker_reachable(),
        in_container=_in_container(),
        vllm=importlib.util.find_spec("vllm") is not None,
        lm_eval_api=all(importlib.util.find_spec(m) is not None for m in ("lm_eval", *LM_EVAL_API_MODULES)),
    )


def _docker_reachable() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _in_container() -> bool:
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists():
        return True
    try:
        return bool(re.search(r"docker|containerd|kubepods|libpod", Path("/proc/1/cgroup").read_text()))
    except OSError:
        return False


def choose_runtime(env: Environment, requested: str) -> str:
    if requested in ("docker", "host"):
        return requested
    if env.vllm and (env.in_container or not env.docker):
        return "host"  # already inside a vLLM container, or vLLM installed natively
    return "docker"


# ---------------------------------------------------------------- model facts


def model_traits(model_dir: Path) -> dict[str, Any]:
    """Chat template? Reasoning (thinking) model? Context length? From the model's own files."""
    config = _read_json(model_dir / "config.json")
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    template = str(tok_config.get("chat_template") or "")
    if not template and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8", errors="replace")
    reasoning = "<think>" in template or "enable_thinking" in template
    return {
        "chat": bool(template),
        "reasoning": reasoning,
        "max_model_len": config.get("max_position_embeddings"),
    }


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def is_generation_task(task: str) -> bool:
    return task.startswith(GENERATE_TASK_PREFIXES)


def generation_budget(traits: dict, requested: int | None) -> int | None:
    """Reasoning models think before answering: give them room, bounded by their context length."""
    if requested:
        return requested
    if not traits["reasoning"]:
        return None
    limit = traits.get("max_model_len") or REASONING_GEN_TOKS
    return max(1024, min(REASONING_GEN_TOKS, int(limit) - 2048))


# ---------------------------------------------------------------- planning


def container_name(model_dir: Path) -> str:
    safe = re.sub(r"[^a-zA-Z0-9_.-]+", "-", model_dir.name).strip("-") or "model"
    return f"qpe-eval-{safe}-{getpass.getuser()}-{time.strftime('%m%d%H%M')}"


def plan_commands(
    models: list[ServedModel],
    options,
    workdir: Path,
    runtime: str,
    env: Environment,
    container: str | None = None,
) -> Plan:
    """Exact argument lists (absolute paths, no shell on the host) for ``runtime``."""
    workdir = workdir.resolve()
    reuse = options.vllm_container
    name = reuse or container or container_name(models[0].path)
    plan = Plan(
        runtime=runtime,
        container=name if runtime == "docker" else None,
        create_container=runtime == "docker" and not reuse,
    )
    if plan.create_container:
        plan.setup.append(
            PlannedCommand(
                "create the holder container (entrypoint sleep, not vllm)",
                holder_container_argv(name, options.vllm_image, models, workdir),
            )
        )
    elif runtime == "docker":
        plan.notes.append(
            f"Reusing container {name}: it must mount the model(s) and {workdir} at the same paths "
            "(the server's pid file and lm-eval's results are written there)."
        )
    if runtime == "docker":
        plan.setup.append(
            PlannedCommand(
                "install lm-eval with its OpenAI-API extra in the container",
                ["docker", "exec", name, "python3", "-m", "pip", "install", "lm-eval[api]"],
            )
        )
    elif not env.lm_eval_api:
        plan.notes.append(
            "lm_eval[api] is not installed on this host: pip install 'lm-eval[api]' before the "
            "lm_eval step (not installed automatically on a host)."
        )
    for model in models:
        out = workdir / "lm_eval_vllm" / model.label
        plan.output_dirs[model.label] = out
        plan.per_model[model.label] = [
            PlannedCommand(
                f"serve the {model.label} model",
                serve_argv(model, options, runtime, name, workdir),
                background=True,
            ),
            PlannedCommand("wait until the server is healthy", health_argv(options.vllm_port)),
            PlannedCommand(
                f"evaluate the {model.label} model over the OpenAI endpoint",
                lm_eval_argv(model, options, runtime, name, out),
            ),
        ]
    if any(t.startswith("gsm8k") for t in options.tasks or DEFAULT_TASKS):
        plan.notes.append(
            "gsm8k: read the flexible-extract score; strict-match misses answers that are not "
            "in the exact '#### N' form, which reasoning models often produce."
        )
    if plan.create_container:
        # Run by hand later these address the name; when this run executes the plan, the id it got.
        plan.teardown += [
            PlannedCommand("stop the container this run created", ["docker", "stop", name]),
            PlannedCommand("remove it", ["docker", "rm", name]),
        ]
    return plan


def holder_container_argv(name: str, image: str, models: list[ServedModel], workdir: Path) -> list[str]:
    argv = [
        "docker",
        "run",
        "-d",
        "--name",
        name,
        "--entrypoint",
        "sleep",
        "--network=host",
        "--ipc=host",
        "--shm-size=64g",
        "--group-add",
        "video",
        "--device=/dev/kfd",
        "--device=/dev/dri",
        "--cap-add=SYS_PTRACE",
        "--security-opt",
        "seccomp=unconfined",
    ]
    for model in models:
        path = str(model.path.resolve())
        argv += ["-v", f"{path}:{path}:ro"]
    argv += ["-v", f"{workdir}:{workdir}", image, "infinity"]
    return argv


def serve_argv(model: ServedModel, options, runtime: str, container: str, workdir: Path) -> list[str]:
    serve = [
        "vllm",
        "serve",
        str(model.path.resolve()),
        "--port",
        str(options.vllm_port),
        "--served-model-name",
        model.served_name,
    ]
    if options.trust_remote_code:
        serve.append("--trust-remote-code")
    if runtime == "host":
        return serve
    # The pid file (in the shared workdir) lets this run stop exactly this server later.
    pid_file = workdir / f"vllm_{model.label}.pid"
    script = f"echo $$ > {pid_file}; exec " + " ".join(_quote(a) for a in serve)
    return ["docker", "exec", container, "sh", "-c", script]


def health_argv(port: int) -> list[str]:
    return [
        "curl",
        "-sf",
        "--retry",
        "360",
        "--retry-delay",
        "5",
        "--retry-all-errors",
        f"http://127.0.0.1:{port}/health",
    ]


def lm_eval_argv(model: ServedModel, options, runtime: str, container: str, output: Path) -> list[str]:
    traits = model_traits(model.path)
    tasks = options.tasks or DEFAULT_TASKS
    chat = traits["chat"] and all(is_generation_task(t) for t in tasks)  # loglikelihood needs completions
    endpoint = "chat/completions" if chat else "completions"
    model_args = [
        f"model={model.served_name}",
        f"base_url=http://127.0.0.1:{options.vllm_port}/v1/{endpoint}",
        "num_concurrent=32",
        "max_retries=5",
        "timeout=1800",
        "tokenized_requests=False",
        f"tokenizer={model.path.resolve()}",
    ]
    if traits.get("max_model_len") and not chat:
        model_args.append(f"max_length={traits['max_model_len']}")  # lm-eval's 2048 default truncates prompts
    argv = [
        "lm_eval",
        "--model",
        "local-chat-completions" if chat else "local-completions",
        "--model_args",
        ",".join(model_args),
        "--tasks",
        ",".join(tasks),
        "--output_path",
        str(output),
        "--log_samples",
    ]
    gen = ["temperature=0"]
    budget = generation_budget(traits, options.max_gen_toks)
    if budget and any(is_generation_task(t) for t in tasks):
        gen.append(f"max_gen_toks={budget}")
    argv += ["--gen_kwargs", ",".join(gen)]
    if chat:
        argv.append("--apply_chat_template")
    if options.num_fewshot is not None:
        argv += ["--num_fewshot", str(options.num_fewshot)]
    if options.limit is not None:
        argv += ["--limit", f"{options.limit:g}"]
    if options.include_path:
        argv += ["--include_path", str(Path(options.include_path).resolve())]
    return ["docker", "exec", container, *argv] if runtime == "docker" else argv


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


# ---------------------------------------------------------------- the tier


@dataclass
class Prepared:
    ctx: TierContext
    env: Environment
    plan: Plan
    models: list[ServedModel]
    estimate: RuntimeEstimate


def prepare(ctx: TierContext, env: Environment | None = None) -> Prepared:
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
    return Prepared(ctx, env, plan, models, estimate)


def run(prepared: Prepared, executor: Executor | None = None) -> TierOutcome:
    ctx, plan = prepared.ctx, prepared.plan
    details = {"environment": prepared.env.as_dict(), "runtime": plan.runtime, "container": plan.container}
    commands = [c.as_dict() for c in plan.all_commands()]
    if not prepared.env.rocm:
        ctx.log("Tier 3 needs ROCm; this host has none. Run these later on a ROCm host:")
        for command in plan.all_commands():
            ctx.log(f"  # {command.purpose}\n  {_shell_line(command.argv)}")
        return TierOutcome(
            quantized={},
            details=details,
            deferred_commands=commands,
            notes=[
                "Tier 3 was not run: no ROCm on this host. The exact commands are recorded below.",
                *plan.notes,
            ],
        )
    if plan.runtime == "docker" and not prepared.env.docker:
        raise UsageError(
            "Tier 3 with the docker runtime needs a reachable docker daemon; start it or use --vllm-runtime host."
        )
    if plan.runtime == "host" and not prepared.env.vllm:
        raise UsageError(
            "Tier 3 with the host runtime needs vllm importable here; install it or use --vllm-runtime docker."
        )
    summary = "\n".join(f"{c.purpose}: {_shell_line(c.argv)}" for c in plan.all_commands())
    require("eval", ctx.approver, summary, "re-run with --approve eval to run these exact commands.")
    return execute_plan(prepared, executor or Executor(ctx.workdir), details, commands)


def _shell_line(argv: list[str]) -> str:
    import shlex

    return shlex.join(argv)


class Executor:
    """Runs planned commands; keeps handles so exactly what it started can be stopped."""

    def __init__(self, workdir: Path):
        self.workdir = workdir

    def run(self, argv: list[str], timeout: float | None = None, check: bool = True) -> str:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise QpeError(
                f"`{_shell_line(argv[:4])} ...` failed (exit {result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-300:]}"
            )
        return result.stdout

    def start(self, argv: list[str], log_name: str) -> subprocess.Popen:
        log = (self.workdir / log_name).open("ab")
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

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
                subprocess.run(["docker", "exec", container, "kill", "-TERM", pid], capture_output=True)
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def execute_plan(prepared: Prepared, executor: Executor, details: dict, commands: list[dict]) -> TierOutcome:
    from .tier_lmeval import scores_from

    ctx, plan, options = prepared.ctx, prepared.plan, prepared.ctx.options
    scores: dict[str, dict] = {}
    directions: dict = {}
    container_id = None
    try:
        for command in plan.setup:
            ctx.log(command.purpose)
            output = executor.run(command.argv, timeout=3600)
            if command is plan.setup[0] and plan.create_container:
                container_id = output.strip().splitlines()[-1]  # `docker run -d` prints the new id
        for label, (serve, _health, evaluate_cmd) in plan.per_model.items():
            process = executor.start(serve.argv, f"vllm_{label}.log")
            try:
                _wait_healthy(executor, process, options.vllm_port, ctx.workdir / f"vllm_{label}.log")
                ctx.log(evaluate_cmd.purpose)
                executor.run(evaluate_cmd.argv)
            finally:
                executor.stop_server(process, ctx.workdir.resolve() / f"vllm_{label}.pid", plan.container)
            scores[label], _, directions = scores_from(_latest_results(plan.output_dirs[label]))
    finally:
        if container_id:  # only a container this run created, addressed by its id
            for verb in ("stop", "rm"):
                executor.run(["docker", verb, container_id], timeout=120, check=False)
    return TierOutcome(
        quantized=scores.get("quantized", {}),
        baseline=scores.get("baseline"),
        directions=directions,
        details=details | {"commands": commands},
        artifacts={f"lm_eval {k} results": str(v) for k, v in plan.output_dirs.items()},
    )


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


def _latest_results(output: Path) -> dict:
    found = sorted(output.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise QpeError(f"lm_eval wrote no results under {output}.")
    return json.loads(found[-1].read_text(encoding="utf-8"))
