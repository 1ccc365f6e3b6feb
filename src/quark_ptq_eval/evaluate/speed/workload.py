"""The speed tier's own options and the workload they resolve to, each value with its reason.

Defaults are fitted to the host: on a GPU Quark's quant_perf workload (1024 input and 1024 output tokens,
64 concurrent requests, and its own rule for the number of prompts); on a CPU vLLM a small one, so a
repeat takes seconds rather than hours. A value the user gives replaces the fitted one and says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.options import concern, flag
from quark_ptq_eval.plan.decode_speed import CPU_WORKLOAD, GPU_WORKLOAD

MIN_REPEATS = 3  # a median and an interval need at least three repeats
MIN_REPEAT_S = 5.0  # a repeat's shortest duration by default: a 0.3 s repeat (8 prompts on a CPU) is mostly start and drain
WITH_TIER3 = "with_tier3"  # the concern of --speed: the speed tier beside Tier 3, on its servers
# Quark quant_perf's 1024/1024/64 on a GPU, a small one on a CPU: the plan predicts the decode speed-up at these
GPU, CPU = GPU_WORKLOAD, CPU_WORKLOAD


@dataclass
class SpeedOptions:
    """The speed tier's flags (None: fitted to the host, see ``fit_workload``)."""

    speed: bool = field(default=False, metadata=flag(
        "--speed", action="store_true",
        help="with Tier 3 (--tier vllm): also measure serving speed (the speed tier's benchmark) on Tier 3's own "
             "servers, each model served once for both") | concern(WITH_TIER3))
    speed_input_len: int | None = field(default=None, metadata=flag(
        "--speed-input-len", type=int, metavar="TOKENS",
        help="speed tier: prompt tokens per request (default 1024 on a GPU like Quark's quant_perf, 32 on a CPU)"))
    speed_output_len: int | None = field(default=None, metadata=flag(
        "--speed-output-len", type=int, metavar="TOKENS",
        help="speed tier: generated tokens per request (default 1024 on a GPU, 16 on a CPU)"))
    speed_concurrency: int | None = field(default=None, metadata=flag(
        "--speed-concurrency", type=int, metavar="N",
        help="speed tier: requests in flight (default 64 on a GPU, 4 on a CPU)"))
    speed_prompts: int | None = field(default=None, metadata=flag(
        "--speed-prompts", type=int, metavar="N",
        help="speed tier: requests per repeat (default: Quark's rule on a GPU, 8 on a CPU)"))
    speed_repeats: int = field(default=MIN_REPEATS, metadata=flag(
        "--speed-repeats", type=int, metavar="N",
        help="speed tier: measured repeats after the warm-up (default 3; with --baseline on a CPU vLLM the fewest, "
             "then more until --speed-precision is met)"))
    speed_precision: float = field(default=10.0, metadata=flag(
        "--speed-precision", type=float, metavar="PCT",
        help="speed tier with --baseline: keep repeating, quantized and baseline alternately, until the gain's 95 percent "
             "interval is within +-PCT percent of its median (default 10), or --speed-max-s is reached"))
    speed_max_s: float = field(default=600.0, metadata=flag(
        "--speed-max-s", type=float, metavar="SECONDS",
        help="speed tier with --baseline: stop repeating after this long even if the precision is not reached "
             "(default 600; the first --speed-repeats pairs always run)"))
    speed_min_repeat_s: float = field(default=MIN_REPEAT_S, metadata=flag(
        "--speed-min-repeat-s", type=float, metavar="SECONDS",
        help=f"speed tier with --baseline: a pilot sizes each repeat to last at least this long (default "
             f"{MIN_REPEAT_S:g}: a CPU repeat of the default 8 prompts lasts ~0.3 s, mostly ramp-up and drain)"))
    speed_target: float | None = field(default=None, metadata=flag(
        "--speed-target", type=float, metavar="GAIN",
        help="speed tier: the throughput gain (quantized / baseline) to meet, e.g. 1.55"))

    def __post_init__(self) -> None:
        for name in ("speed_input_len", "speed_output_len", "speed_concurrency", "speed_prompts"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, not {value}.")
        if self.speed_repeats < MIN_REPEATS:
            raise UsageError(f"--speed-repeats must be at least {MIN_REPEATS} (a median and its interval need "
                             f"three), not {self.speed_repeats}.")
        if not 0 < self.speed_precision < 100:
            raise UsageError(f"--speed-precision must be a percentage between 0 and 100, such as 10, not "
                             f"{self.speed_precision}.")
        if not self.speed_min_repeat_s > 0:
            raise UsageError(f"--speed-min-repeat-s must be a positive number of seconds, not {self.speed_min_repeat_s}.")
        if not self.speed_max_s > 0:
            raise UsageError(f"--speed-max-s must be a positive number of seconds, not {self.speed_max_s}.")
        if self.speed_target is not None and not self.speed_target > 0:
            raise UsageError(f"--speed-target must be a positive gain such as 1.55, not {self.speed_target}.")


@dataclass(frozen=True)
class Workload:
    """What every repeat sends, for the quantized model and the baseline alike."""

    input_len: int
    output_len: int
    concurrency: int
    prompts: int
    repeats: int
    warmup_prompts: int  # one wave of requests: the first compiles and allocates, it is not timed
    reasons: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"dataset": "random (vLLM's RandomDataset), drawn with the model's tokenizer",
                               "ignore_eos": True}

    def lines(self) -> list[str]:
        return [f"speed workload {k}={getattr(self, k)}: {why}" for k, why in self.reasons.items()]


def quark_prompts(concurrency: int, input_len: int, output_len: int) -> int:
    """Quark quant_perf's number of prompts: enough waves to amortise ramp-up and drain."""
    cost = input_len + output_len
    factor = 10 if cost <= 1024 else 5 if cost <= 4096 else 3 if cost <= 16384 else 2
    return concurrency * factor


def fit_workload(options: SpeedOptions, gpu: bool) -> Workload:
    """The workload for this host: the user's values where given, else the host's defaults, each with its reason."""
    host = "a GPU vLLM" if gpu else "a CPU vLLM"
    fitted = GPU if gpu else CPU
    why_fitted = ("Quark quant_perf's default on a GPU" if gpu else
                  "small on a CPU vLLM so each repeat takes seconds (Quark's 1024/1024/64 would take hours here)")
    values: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for key in ("input_len", "output_len", "concurrency"):
        given = getattr(options, f"speed_{key}")
        values[key] = given if given is not None else fitted[key]
        reasons[key] = f"--speed-{key.replace('_', '-')} given" if given is not None else f"{why_fitted} ({host})"
    if options.speed_prompts is not None:
        values["prompts"], reasons["prompts"] = options.speed_prompts, "--speed-prompts given"
    elif gpu:
        values["prompts"] = quark_prompts(values["concurrency"], values["input_len"], values["output_len"])
        reasons["prompts"] = "Quark quant_perf's rule: enough waves of the concurrency to amortise ramp-up and drain"
    else:
        values["prompts"] = max(CPU["prompts"], 2 * values["concurrency"])
        reasons["prompts"] = "two waves of the concurrency on a CPU vLLM: a steady batch, still seconds a repeat"
    reasons["repeats"] = ("--speed-repeats given" if options.speed_repeats != MIN_REPEATS else
                          f"at least {MIN_REPEATS}: a median and a 95 % interval need three")
    warmup = min(values["concurrency"], values["prompts"])
    reasons["warmup_prompts"] = "one wave, untimed: the first requests pay for allocation and compilation"
    return Workload(values["input_len"], values["output_len"], values["concurrency"], values["prompts"],
                    options.speed_repeats, warmup, reasons)
