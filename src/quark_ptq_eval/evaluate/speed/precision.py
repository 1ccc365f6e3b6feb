"""The speed tier's stopping rule: the quantized model and its baseline measured alternately until the gain is
known to a stated precision, or a time cap comes first.

Both servers are up at once (each on its own port; on a CPU vLLM an idle server costs nothing), and each
model's benchmark process takes one run at a time (driver.py's ``run NAME SEED PROMPTS``):

1. a warm-up of each (one wave, untimed), then a **pilot** of each at the workload's prompts, timed: a repeat gets
   as many prompts (whole waves of the concurrency) as make the faster model's repeat last
   ``--speed-min-repeat-s`` at least, never fewer than the workload's;
2. pairs of repeats, repeat i of each on the same prompts (seed i), one right after the other, the order turned
   every pair (q b, b q, q b ...) so a drift of the host hits both sides alike;
3. after at least ``--speed-repeats`` pairs, it stops as soon as the gain's paired 95 % interval
   (stats.paired_gain) lies within ``--speed-precision`` % of the median gain either way (``precision``), or
   before a pair that would end past ``--speed-max-s`` from the start of the measurement (``cap``).

Stopping on the first narrow enough interval makes the stated 95 % a little optimistic (a sequential rule's
known cost); the pairs, their files and the interval reached are all recorded.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING

from quark_ptq_eval.evaluate.serving.commands import shell_line
from quark_ptq_eval.evaluate.speed import stats
from quark_ptq_eval.evaluate.speed.bench import PendingBench, RequestsFailed
from quark_ptq_eval.evaluate.speed.commands import result_dir, server_log
from quark_ptq_eval.evaluate.speed.record import Precision
from quark_ptq_eval.evaluate.speed.workload import MIN_REPEAT_S, SpeedOptions, Workload

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from quark_ptq_eval.evaluate.speed.prepared import SpeedPrepared
    from quark_ptq_eval.evaluate.speed.record import SpeedRecord

PILOT_SEED = 1_000_000  # the pilot's prompts: none of a repeat's (seed i) or the warm-up's (seed 0)
# The spread (standard deviation) of one pair's log gain on a 2-core CPU host, where the scheduler moves vLLM's
# processes between repeats (measured: docs/speed.md, "Measured: three runs at load < 1.5"). What the estimate
# before the gate expects (about 40 pairs at +-10 %, so the cap), not what the rule uses: it measures its own.
EXPECTED_SD_LOG_GAIN = 0.3
EXPECTED_REPEAT_FACTOR = 1.5  # a repeat sized for 5 s lasted 5-13 s there (mean 7.9): the pilot's pace is fast
RUN_TIMEOUT_S = 1800.0  # one run's longest wait for its result (a GPU repeat at quant_perf's workload: minutes)
PRECISION, CAP = "precision", "cap"


def stop_reason(quantized: list[float], baseline: list[float], options: SpeedOptions, elapsed_s: float,
                pair_s: float) -> str | None:
    """Why the alternation stops after these pairs (PRECISION, CAP), or None to measure another pair:
    ``elapsed_s`` since the measurement began, ``pair_s`` what the last pair took."""
    pairs = len(quantized)
    if pairs < options.speed_repeats:
        return None
    point, ci = stats.paired_gain(quantized, baseline)
    if stats.distance_pct(point, ci) <= options.speed_precision:
        return PRECISION
    return CAP if elapsed_s + pair_s > options.speed_max_s else None


def repeat_prompts(workload: Workload, pilot_s: list[float], min_repeat_s: float = MIN_REPEAT_S) -> int:
    """A repeat's prompts: whole waves enough for the faster model's repeat to last ``min_repeat_s``, at the pilot's
    pace (``pilot_s``: each model's pilot of ``workload.prompts`` prompts), never fewer than the workload's."""
    per_prompt = min(pilot_s) / workload.prompts
    needed = math.ceil(min_repeat_s / per_prompt) if per_prompt > 0 else workload.prompts
    waves = -(-max(needed, workload.prompts) // workload.concurrency)
    return waves * workload.concurrency


def expected_pairs(options: SpeedOptions, sd_log_gain: float = EXPECTED_SD_LOG_GAIN) -> int:
    """The pairs the rule is expected to need: the fewest n >= --speed-repeats whose paired interval
    t(0.975, n - 1) * sd / sqrt(n) is within the precision (on log scale), at the expected spread."""
    from scipy.stats import t

    target = math.log1p(options.speed_precision / 100.0)
    n = max(options.speed_repeats, 2)
    while float(t.ppf(0.975, n - 1)) * sd_log_gain / math.sqrt(n) > target and n < 1000:
        n += 1
    return n


def measure_alternating(prepared: SpeedPrepared, record: SpeedRecord) -> None:
    """Both servers up at once, the warm-ups, the pilot, then pairs of repeats until the rule stops: each
    model's repeats, result files and server line into ``record`` with how it ended (``record.precision``); a
    model vLLM refuses is recorded so, and the other one measured alone at the fewest repeats."""
    from quark_ptq_eval.evaluate.speed.measured import PORT_FREE_TIMEOUT_S, measured_from, server_refusal
    from quark_ptq_eval.runtime.vllm_server import ServerNotHealthy, vllm_server, wait_port_free

    ctx = prepared.ctx
    started = time.monotonic()
    benches: dict[str, PendingBench] = {}
    logs = {m.label: server_log(ctx.workdir, m.label) for m in prepared.models}
    with ExitStack() as servers:
        for model in prepared.models:
            label, port = model.label, prepared.ports[model.label]
            wait_port_free(port, PORT_FREE_TIMEOUT_S, f"the {label} model")
            ctx.log(f"serve the {label} model: {shell_line(prepared.serve[label])}")
            try:
                servers.enter_context(vllm_server(
                    prepared.serve[label], port, logs[label], ctx.options.vllm_health_timeout_s,
                    what=f"the {label} model",
                    while_starting=_starter(prepared, label, benches)))
            except ServerNotHealthy as exc:
                if (bench := benches.pop(label, None)) is not None:
                    bench.cancel()
                if not exc.exited:
                    raise
                record.refused[label] = server_refusal(exc, logs[label])
                ctx.log(f"speed: the {label} model was not measured: {record.refused[label]}")
        servers.callback(_cancel_all, benches)
        files = _alternate(prepared, record, benches, logs, started)
    for label, paths in files.items():
        if label not in record.refused:
            record.result_files[label] = [str(p) for p in paths]
            record.measured[label] = measured_from(paths, logs[label])


def _starter(prepared: SpeedPrepared, label: str, benches: dict[str, PendingBench]) -> Callable[[], None]:
    """Starts ``label``'s benchmark process (one run at a time) as its server starts: it imports vLLM meanwhile."""
    def start() -> None:
        benches[label] = PendingBench(prepared.bench[label], result_dir(prepared.ctx.workdir, label), 0)
    return start


def _cancel_all(benches: dict[str, PendingBench]) -> None:
    for bench in benches.values():
        bench.cancel()


def _alternate(prepared: SpeedPrepared, record: SpeedRecord, benches: dict[str, PendingBench],
               logs: dict[str, Path], started: float) -> dict[str, list[Path]]:
    """The runs on the servers that are up: each model's repeat files (a model whose requests failed drops out,
    its refusal recorded)."""
    from quark_ptq_eval.evaluate.speed.measured import requests_refusal

    ctx, workload, options = prepared.ctx, prepared.workload, prepared.ctx.options.of(SpeedOptions)
    live = [m.label for m in prepared.models if m.label in benches]
    files: dict[str, list[Path]] = {label: [] for label in live}

    def run(label: str, name: str, seed: int, prompts: int) -> Path | None:
        try:
            return benches[label].one(name, seed, prompts, RUN_TIMEOUT_S)
        except RequestsFailed as exc:
            record.refused[label] = requests_refusal(exc, logs[label])
            ctx.log(f"speed: the {label} model was not measured: {record.refused[label]}")
            live.remove(label)
            return None

    pilot: dict[str, float] = {}
    for label in list(live):
        if run(label, "warmup", 0, workload.warmup_prompts) and (path := run(label, "pilot", PILOT_SEED,
                                                                            workload.prompts)):
            pilot[label] = float(stats.read_result(path)["duration"])
    least = options.speed_min_repeat_s
    prompts = repeat_prompts(workload, list(pilot.values()), least) if pilot else workload.prompts
    ctx.log(f"speed: pilot of {workload.prompts} prompts took "
            + ", ".join(f"{s:.2f} s ({label})" for label, s in pilot.items())
            + f": {prompts} prompts a repeat, so one lasts {least:g} s or more")
    stopped, pairs = "", 0
    while live:
        pair_started = time.monotonic()
        pairs += 1
        for label in (list(live) if pairs % 2 else live[::-1]):
            if path := run(label, f"repeat_{pairs}", pairs, prompts):
                files[label].append(path)
        if len(live) < 2:  # one model left: its fewest repeats, no gain to make precise
            if pairs >= options.speed_repeats:
                break
            continue
        q, b = (_throughputs(files[label]) for label in live)
        now = time.monotonic()
        if reason := stop_reason(q, b, options, now - started, now - pair_started):
            stopped = reason
            point, ci = stats.paired_gain(q, b)
            ctx.log(f"speed: {pairs} pairs, gain {point:.3f}x, 95 % interval {ci[0]:.3f}-{ci[1]:.3f}x: "
                    f"+-{stats.distance_pct(point, ci):.1f} % of the median; stopped: "
                    + ("within the precision asked" if reason == PRECISION else "--speed-max-s reached"))
            break
    if len(files) == 2 and all(label not in record.refused for label in files):
        q, b = (_throughputs(paths) for paths in files.values())
        point, ci = stats.paired_gain(q, b)
        record.precision = Precision(options.speed_precision, options.speed_max_s, stopped or CAP, len(q),
                                     round(time.monotonic() - started, 1), round(stats.distance_pct(point, ci), 2),
                                     workload.prompts, {k: round(v, 3) for k, v in pilot.items()}, prompts,
                                     least)
        record.ci95_method = stats.PAIRED_CI_METHOD
    return files


def _throughputs(paths: list[Path]) -> list[float]:
    return [float(stats.read_result(p)["output_throughput"]) for p in paths]
