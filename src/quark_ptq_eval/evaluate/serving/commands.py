"""Tier 3, command planning: the exact argument lists (absolute paths, no shell on the host)
that serve each model with vLLM and run lm_eval over its OpenAI endpoint, for docker or host."""

from __future__ import annotations

import getpass
import math
import re
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.artifacts import PlanJson
from quark_ptq_eval.evaluate.serving.detect import Environment
from quark_ptq_eval.evaluate.serving.model_facts import (
    DEFAULT_TASKS,
    generation_budget,
    is_generation_task,
    model_traits,
)
from quark_ptq_eval.evaluate.serving.multinode import parallel_args
from quark_ptq_eval.runtime.vllm_host import HostVllm, host_server_argv, lm_eval_command
from quark_ptq_eval.runtime.vllm_sizing import ServerArg, ServerSizing, sized_for

if TYPE_CHECKING:
    from quark_ptq_eval.evaluate.options import EvalOptions

VLLM_KV_DTYPES = {"fp8": "fp8"}  # Quark's KV-cache scheme -> vLLM's --kv-cache-dtype
LM_EVAL_CONCURRENT = 32  # requests lm-eval keeps in flight: the sequences a server's KV cache is sized for


@dataclass
class PlannedCommand:
    purpose: str
    argv: list[str]
    background: bool = False  # a server: started, then stopped by this run

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ServedModel:
    label: str  # "quantized" or "baseline"
    path: Path
    served_name: str
    tensor_parallel: int | None = None  # devices from the plan's serving fit; None: vLLM's default
    kv_cache_dtype: str | None = None  # "fp8" where the plan quantized the KV cache
    max_model_len: int | None = None  # the context the user's serving budget states
    reasons: dict[str, str] = field(default_factory=dict)  # vLLM flag -> why the plan sets it


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
    # `docker run --cidfile` writes the id the moment the container exists: an interrupt before `run`
    # printed it still leaves cleanup something to address
    container_id_file: Path | None = None
    sizing: dict[str, ServerSizing] = field(default_factory=dict)  # label -> its server's arguments and why

    def all_commands(self) -> list[PlannedCommand]:
        return [*self.setup, *(c for cmds in self.per_model.values() for c in cmds), *self.teardown]


# ---------------------------------------------------------------- model facts


# ---------------------------------------------------------------- planning


def served_models(model_dir: Path, baseline: Path | None, plan: PlanJson | None) -> tuple[list[ServedModel], list[str]]:
    """The models Tier 3 serves, sized by the plan's serving fit (tensor parallelism, KV-cache dtype),
    and a note on where the sizes come from."""
    plan = plan or PlanJson()
    target = plan.get("target") or {}
    fit = target.get("serving_fit") or {}
    kv = VLLM_KV_DTYPES.get(plan.get("kv_cache_scheme") or "")
    tp = fit.get("devices_needed") or None
    context = fit.get("context") if target.get("budget") else None  # served at the context the goal states
    why = {"--max-model-len": "the context your goal states", "--kv-cache-dtype": "the plan quantized the KV cache "
           f"({plan.get('kv_cache_scheme')}): vLLM reads the export's KV scales only then",
           "--tensor-parallel-size": f"the plan's serving fit on {target.get('label')}"}
    models = [ServedModel("quantized", Path(model_dir).resolve(), "quantized", tp, kv, context, why)]
    if baseline is not None:  # the unquantized source, KV cache in the model dtype
        models.append(ServedModel("baseline", Path(baseline).resolve(), "baseline",
                                  _baseline_devices(Path(baseline), fit, kv) if tp else None, None, context,
                                  why | {"--tensor-parallel-size": "the baseline's weights on disk and a model-dtype "
                                         f"KV cache on {target.get('label')}, sized as the plan's serving fit"}))
    notes = []
    if tp:
        gib = (fit["weights_bytes"] + fit["kv_cache_bytes"]) / 2**30
        notes.append(f"Serving fit from the plan: the quantized model needs {tp} x {target.get('label')} "
                     f"({gib:.1f} GiB of weights and KV cache at {fit['context']} tokens x batch {fit['batch']}): "
                     + ", ".join(f"{m.label} {shlex.join(parallel_args(m.tensor_parallel))}" for m in models)
                     + (f"; --max-model-len {context}, the context your goal states." if context else "."))
    elif not plan:
        notes.append("No quantization plan with this evaluation: vLLM's defaults (one device, KV cache in the "
                     "model dtype); evaluate through `run` to size the servers from the plan's serving fit.")
    if plan.get("kv_cache_scheme") and not kv:
        notes.append(f"The plan's KV-cache scheme {plan['kv_cache_scheme']} has no vLLM --kv-cache-dtype: "
                     "the server keeps the KV cache in the model dtype.")
    return models, notes


def _baseline_devices(path: Path, fit: dict[str, Any], kv: str | None) -> int:
    """Devices for the unquantized baseline: its weights on disk plus a model-dtype KV cache."""
    from quark_ptq_eval.plan.resources import HEADROOM

    need = sum(f.stat().st_size for f in path.glob("*.safetensors")) + fit["kv_cache_bytes"] * (2 if kv else 1)
    devices: int = max(1, math.ceil(need / (fit["device_memory_gb"] * 1e9 * HEADROOM)))
    return 1 << (devices - 1).bit_length()  # tensor parallelism goes in powers of two, as in the plan


def container_name(model_dir: Path) -> str:
    safe = re.sub(r"[^a-zA-Z0-9_.-]+", "-", model_dir.name).strip("-") or "model"
    return f"qpe-eval-{safe}-{getpass.getuser()}-{time.strftime('%m%d%H%M')}"


def plan_commands(
    models: list[ServedModel],
    options: EvalOptions,
    workdir: Path,
    runtime: str,
    env: Environment,
    container: str | None = None,
    sequences: int = LM_EVAL_CONCURRENT,
) -> CommandPlan:
    """Exact argument lists (absolute paths, no shell on the host) for ``runtime``; ``sequences``: what each
    server's KV cache is sized to hold at once (lm-eval's requests, or the speed workload's when larger)."""
    workdir = workdir.resolve()
    reuse = options.vllm_container
    name = reuse or container or container_name(models[0].path)
    plan = CommandPlan(
        runtime=runtime,
        container=name if runtime == "docker" else None,
        create_container=runtime == "docker" and not reuse,
    )
    if plan.create_container:
        plan.container_id_file = workdir / f"{name}.cid"

    _plan_setup(plan, name, options, models, workdir, env)
    for model in models:
        out = workdir / "lm_eval_vllm" / model.label
        plan.output_dirs[model.label] = out
        host = env.host_vllm if runtime == "host" else None
        plan.sizing[model.label] = server_sizing(model, options, host, sequences)  # this host's memory, read now
        plan.per_model[model.label] = [
            PlannedCommand(
                f"serve the {model.label} model",
                serve_argv(model, options, runtime, name, workdir, host, plan.sizing[model.label]),
                background=True,
            ),
            PlannedCommand("wait until the server is healthy", health_argv(options.vllm_port)),
            PlannedCommand(
                f"evaluate the {model.label} model over the OpenAI endpoint",
                lm_eval_argv(model, options, runtime, name, out, env.host_vllm is not None),
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


def _plan_setup(plan: CommandPlan, name: str, options: EvalOptions, models: list[ServedModel], workdir: Path,
                env: Environment) -> None:
    """The holder container (created, or reused) and lm-eval's API extra inside it."""
    if plan.create_container:
        plan.setup.append(
            PlannedCommand(
                "create the holder container (entrypoint sleep, not vllm)",
                holder_container_argv(name, options.vllm_image, models, workdir, plan.container_id_file),
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


def holder_container_argv(name: str, image: str, models: list[ServedModel], workdir: Path,
                          id_file: Path | None = None) -> list[str]:
    argv = [
        "docker",
        "run",
        "-d",
        "--name",
        name,
        *(["--cidfile", str(id_file)] if id_file else []),
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


def server_sizing(model: ServedModel, options: EvalOptions, host: HostVllm | None = None,
                  sequences: int = LM_EVAL_CONCURRENT) -> ServerSizing:
    """The model's server arguments and their reasons (runtime/vllm_sizing.py, as the serving check):
    the plan's, on a CPU vLLM (``host``) this host's free memory now, the user's --vllm-arg over them;
    ``sequences``: what the KV cache holds at once (lm-eval's requests; the speed tier's concurrency)."""
    plan = [ServerArg(flag, (value,), model.reasons.get(flag, "beyond one node: pipeline parallel over Ray"), "plan")
            for flag, value in _pairs(parallel_args(model.tensor_parallel))]  # serving.multinode sizes the layout
    if model.kv_cache_dtype:  # vLLM reads the export's KV scales only then
        plan.append(ServerArg("--kv-cache-dtype", (model.kv_cache_dtype,), model.reasons.get("--kv-cache-dtype", ""),
                              "plan"))
    if options.trust_remote_code:
        plan.append(ServerArg("--trust-remote-code", (), "you passed --trust-remote-code", "user"))
    return sized_for(model.path, bool(host and host.cpu), options.vllm_args, model.kv_cache_dtype,
                     sequences=sequences, context=model.max_model_len, plan_args=tuple(plan),
                     context_reason=model.reasons.get("--max-model-len", ""))


def _pairs(argv: list[str]) -> list[tuple[str, str]]:
    return list(zip(argv[::2], argv[1::2], strict=True))


def server_argv(model: ServedModel, options: EvalOptions, host: HostVllm | None = None,
                sizing: ServerSizing | None = None) -> list[str]:
    """The bare ``vllm serve`` line (``host``: that interpreter's server module) with ``sizing``'s arguments."""
    sizing = sizing or server_sizing(model, options, host)
    if host is not None:
        return host_server_argv(host, model.path, options.vllm_port, model.served_name, sizing)
    return ["vllm", "serve", str(model.path.resolve()), "--port", str(options.vllm_port),
            "--served-model-name", model.served_name, *sizing.argv()]


def serve_argv(model: ServedModel, options: EvalOptions, runtime: str, container: str, workdir: Path,
               host: HostVllm | None = None, sizing: ServerSizing | None = None) -> list[str]:
    serve = server_argv(model, options, host if runtime == "host" else None, sizing)
    if runtime == "host":
        return serve
    return ["docker", "exec", container, "sh", "-c", launch_line(serve, pid_file_for(workdir, model))]


def pid_file_for(workdir: Path, model: ServedModel) -> Path:
    """Where a server's pid is kept (the shared workdir): what lets a run stop exactly that server."""
    return workdir / f"vllm_{model.label}.pid"


def launch_line(serve: list[str], pid_file: Path, log: Path | None = None) -> str:
    """An sh line that records its own pid, then becomes the server (``exec`` keeps the pid)."""
    line = f"echo $$ > {shlex.quote(str(pid_file))}; exec {shlex.join(serve)}"
    return line + (f" >> {shlex.quote(str(log))} 2>&1" if log is not None else "")


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


def lm_eval_argv(model: ServedModel, options: EvalOptions, runtime: str, container: str, output: Path,
                 ours: bool = False) -> list[str]:
    """``ours``: lm-eval from this environment (a named host vLLM lives in another), tokenizing locally."""
    traits = model_traits(model.path)
    tasks = options.tasks or DEFAULT_TASKS
    chat = traits["chat"] and all(is_generation_task(t) for t in tasks)  # loglikelihood needs completions
    endpoint = "chat/completions" if chat else "completions"
    model_args = [
        f"model={model.served_name}",
        f"base_url=http://127.0.0.1:{options.vllm_port}/v1/{endpoint}",
        f"num_concurrent={LM_EVAL_CONCURRENT}",
        "max_retries=5",
        "timeout=1800",
        "tokenized_requests=False",
        f"tokenizer={model.path.resolve()}",
        *(["tokenizer_backend=huggingface"] if ours else []),  # the model's own files, not the server's
    ]
    lengths = [n for n in (traits.get("max_model_len"), model.max_model_len) if n]  # the model's, the server's
    if lengths and not chat:
        model_args.append(f"max_length={min(lengths)}")  # lm-eval's 2048 default truncates prompts
    argv = [
        *(lm_eval_command() if ours else ["lm_eval"]),
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


def shell_line(argv: list[str]) -> str:
    return shlex.join(argv)
