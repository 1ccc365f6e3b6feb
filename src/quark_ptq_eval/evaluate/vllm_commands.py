"""Tier 3, command planning: the exact argument lists (absolute paths, no shell on the host)
that serve each model with vLLM and run lm_eval over its OpenAI endpoint, for docker or host."""

from __future__ import annotations

import getpass
import json
import re
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .vllm_detect import Environment

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
class CommandPlan:
    """Everything Tier 3 would run, in order, as exact argument lists (shown before approval)."""

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
) -> CommandPlan:
    """Exact argument lists (absolute paths, no shell on the host) for ``runtime``."""
    workdir = workdir.resolve()
    reuse = options.vllm_container
    name = reuse or container or container_name(models[0].path)
    plan = CommandPlan(
        runtime=runtime,
        container=name if runtime == "docker" else None,
        create_container=runtime == "docker" and not reuse,
    )
    _plan_setup(plan, name, options, models, workdir, env)
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


def _plan_setup(plan: CommandPlan, name: str, options, models: list[ServedModel], workdir: Path,
                env: Environment) -> None:
    """The holder container (created, or reused) and lm-eval's API extra inside it."""
    if plan.create_container:
        plan.setup.append(
            PlannedCommand(
                "create the holder container (entrypoint sleep, not vllm)",
                holder_container_argv(name, options.vllm_image, models, workdir),
            )
        )
    elif plan.runtime == "docker":
        plan.notes.append(
            f"Reusing container {name}: it must mount the model(s) and {workdir} at the same paths "
            "(the server's pid file and lm-eval's results are written there)."
        )
    if plan.runtime == "docker":
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
    return shlex.quote(arg)


def shell_line(argv: list[str]) -> str:
    return shlex.join(argv)
