"""What an evaluation run is asked to do: one dataclass shared by the CLI, the pipeline and the API."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.options import concern, extensions, flag, nested
from quark_ptq_eval.evaluate.tiers import DEFAULT_TIER

T = TypeVar("T")

DEFAULT_SEQ_LEN = 2048  # Tier 1's window when --seq-len is not given (Quark's ppl_eval default)
LONG_RUN_S = 15 * 60  # above this the user is asked again before the tier starts
BASELINE_FROM_SOURCE = Path("<source>")  # `--baseline` without a path: the source model of the run
SERVING = "serving"  # the concern of the vLLM-server options a command that serves models takes (compare --speed)


def _tier_choices() -> list[str]:
    from quark_ptq_eval.evaluate.tiers import TIERS

    return list(TIERS)


def _tier_help() -> str:
    from quark_ptq_eval.evaluate.tiers import TIERS

    return "; ".join(f"{t.name}: tier {t.number}, {t.method} ({t.cost})" for t in TIERS.values())


def _tier_option_classes() -> list[type]:
    """The options dataclasses the tiers declare (their rows' ``options``): imported when a parser is built."""
    from quark_ptq_eval.base.registry import load
    from quark_ptq_eval.evaluate.tiers import TIERS

    return [load(t.options) for t in TIERS.values() if t.options]


def _task_list(text: str | list[str]) -> list[str]:
    """"a, b" (the command line) or ["a", "b"] (the Python API) -> ["a", "b"]."""
    items = text.split(",") if isinstance(text, str) else text
    return [t.strip() for t in items if t.strip()]


def _references(items: list[str]) -> dict[str, dict[str, float]]:
    from quark_ptq_eval.evaluate.reference import parse_reference

    return parse_reference(items)


@dataclass
class Thresholds:
    """Relative degradation (percent, direction-aware) that separates the verdicts."""

    healthy_pct: float = field(default=2.0, metadata=flag(  # at most this much worse: healthy
        "--healthy-pct", type=float, help="at most this much worse is healthy (default 2)"))
    hurt_pct: float = field(default=5.0, metadata=flag(  # more than this much worse: quantization hurt the model
        "--hurt-pct", type=float, help="more than this much worse is hurt (default 5)"))

    def __post_init__(self) -> None:
        if not 0 <= self.healthy_pct <= self.hurt_pct:
            raise UsageError(
                f"Thresholds must satisfy 0 <= healthy ({self.healthy_pct}) <= hurt ({self.hurt_pct}) percent."
            )


@dataclass
class EvalOptions:
    """Field order is the order of the flags in ``--help``. `run` already owns --batch-size, --device
    and --trust-remote-code (calibration): the eval versions are --eval-batch-size / --eval-device,
    and the standalone `eval` command also accepts the short names."""

    tier: str = field(default=DEFAULT_TIER, metadata=flag(
        "--eval-tier", "--tier", dest="eval_tier", choices=_tier_choices, help=_tier_help))
    trust_remote_code: bool = field(default=False, metadata=flag(
        "--trust-remote-code", action="store_true", standalone_only=True))
    eval_data: Path | None = field(default=None, metadata=flag(  # None: wikitext-2 test split through `datasets`
        "--eval-data", type=Path, metavar="PATH",
        help="local text (.txt/.jsonl/.parquet or a saved datasets dir); default wikitext-2 test") | concern("windows"))
    seq_len: int | None = field(default=None, metadata=flag(  # None: DEFAULT_SEQ_LEN within the model's context
        "--seq-len", type=int, help="Tier 1 window length in tokens (default 2048 like Quark, or the model's "
                                    "context when shorter; longer than the context is refused)") | concern("windows"))
    max_windows: int | None = field(default=None, metadata=flag(
        "--max-windows", type=int, help="Tier 1: score at most this many windows") | concern("windows"))
    eval_text_limit: int | None = field(default=None, metadata=flag(
        "--eval-text-limit", type=int, metavar="DOCS", help="use only the first DOCS documents") | concern("windows"))
    batch_size: int | None = field(default=None, metadata=flag(  # None: chosen from the vocabulary and seq_len
        "--eval-batch-size", dest="eval_batch_size", standalone_names=("--batch-size",), type=int,
        help="windows / requests per forward (default: auto)") | concern("compute"))
    device: str = field(default="auto", metadata=flag(  # "auto": cuda/rocm when present, else cpu
        "--eval-device", dest="eval_device", standalone_names=("--device",), help="auto (default), cpu, cuda") | concern("compute"))
    baseline: Path | None = field(default=None, metadata=flag(  # evaluated only when set (explicit opt-in)
        "--baseline", nargs="?", const=BASELINE_FROM_SOURCE, metavar="SRC",
        help="also evaluate the unquantized model (about double the time); no value: the source"))
    reference: dict[str, dict[str, float]] = field(default_factory=dict, metadata=flag(  # task -> metric -> value
        "--reference", action="append", metavar="TASK:METRIC=VALUE", convert=_references,
        help="a published score to compare with (repeatable), e.g. gsm8k:exact_match=0.62"))
    tasks: list[str] = field(default_factory=list, metadata=flag(
        "--tasks", convert=_task_list, help="Tier 2/3 lm-eval tasks, comma-separated (e.g. gsm8k,arc_easy)") | concern("tasks"))
    num_fewshot: int | None = field(default=None, metadata=flag("--num-fewshot", type=int) | concern("tasks"))
    limit: float | None = field(default=None, metadata=flag(
        "--limit", type=float, help="lm-eval: documents per task (a fraction when below 1)") | concern("tasks"))
    include_path: Path | None = field(default=None, metadata=flag(
        "--include-path", type=Path, help="directory of local lm-eval task YAMLs") | concern("tasks"))
    max_gen_toks: int | None = field(default=None, metadata=flag(  # None: task default, large for reasoning models
        "--max-gen-toks", type=int, help="generation budget (default: task's; large for reasoning models)") | concern("tasks"))
    thresholds: Thresholds = field(default_factory=Thresholds, metadata=nested(Thresholds))
    remedies: int = field(default=0, metadata=flag(  # after Tier 1 against a baseline (flows/recipe/remedies_side.py)
        "--remedies", type=int, metavar="N",
        help="when Tier 1 (with --baseline) finds the model not healthy: quantize, validate and score the N most "
             "promising remedies (the plan's algorithm removed or added, the worst block kept unquantized, more "
             "calibration data, a wider format) on the same windows, and recommend the best measured one"))
    confirm_above_s: float = LONG_RUN_S  # ask the "eval" gate again when the estimate exceeds this
    vllm_runtime: str = field(default="auto", metadata=flag(
        "--vllm-runtime", choices=("auto", "docker", "host"), help="Tier 3 runtime (default auto)"))
    vllm_image: str = field(default="vllm/vllm-openai-rocm:latest", metadata=flag(
        "--vllm-image", help="Tier 3 docker image (default vllm/vllm-openai-rocm:latest)"))
    vllm_container: str | None = field(default=None, metadata=flag(
        "--vllm-container", help="Tier 3: reuse this running container"))
    vllm_port: int = field(default=8080, metadata=flag(
        "--vllm-port", type=int, help="Tier 3 server port (default 8080)"))
    vllm_python: Path | None = field(default=None, metadata=flag(  # None: runtime/vllm_host.vllm_python's
        "--vllm-python", type=Path, metavar="PYTHON",
        help="Tier 3 and the serving check on this host: the interpreter of a vLLM environment "
             "(e.g. .venv-vllm/bin/python from `make vllm-env`; default $QUARK_PTQ_EVAL_VLLM_PYTHON, else this "
             "checkout's .venv-vllm)") | concern(SERVING))
    vllm_health_timeout_s: float = field(default=1800.0, metadata=flag(
        "--vllm-health-timeout", type=float, metavar="SECONDS",
        help="Tier 3: give up on a server not healthy after this long (default 1800)") | concern(SERVING))
    vllm_args: list[str] = field(default_factory=list, metadata=flag(  # over the sized ones (runtime/vllm_sizing.py)
        "--vllm-arg", action="append", metavar="ARG",
        help="an argument for every vLLM server this run starts (repeatable; with '=': "
             "--vllm-arg=--max-model-len=512); it replaces the sized argument of the same flag") | concern(SERVING))
    # the options a tier declares itself (its row's `options`), as given: field name -> value; read with of()
    tier_options: dict[str, Any] = field(default_factory=dict, metadata=extensions(_tier_option_classes))

    def of(self, cls: type[T]) -> T:
        """A tier's own options (``cls``, its row's ``options`` dataclass): the ones given, the rest defaults."""
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in self.tier_options.items() if k in names})

    def __post_init__(self) -> None:
        if self.seq_len is not None and self.seq_len < 2:
            raise UsageError(f"--seq-len must be at least 2 tokens, not {self.seq_len}.")
        if self.remedies < 0:
            raise UsageError(f"--remedies must not be negative, not {self.remedies}.")
        if self.batch_size is not None and self.batch_size < 1:
            raise UsageError(f"--batch-size must be a positive integer, not {self.batch_size}.")
        if self.eval_data is not None:
            self.eval_data = Path(self.eval_data)
        if self.baseline is not None:
            self.baseline = Path(self.baseline)
        if self.include_path is not None:
            self.include_path = Path(self.include_path)
        if self.vllm_python is not None:
            self.vllm_python = Path(self.vllm_python)
        self.vllm_args = [self.vllm_args] if isinstance(self.vllm_args, str) else list(self.vllm_args)
        from quark_ptq_eval.runtime.vllm_sizing import parse_user_args

        parse_user_args(self.vllm_args)  # a value that is no vLLM flag is refused now, before anything runs
        if not self.vllm_health_timeout_s > 0:
            raise UsageError(f"--vllm-health-timeout must be a positive number of seconds, not {self.vllm_health_timeout_s}.")
        for task, metrics in self.reference.items():
            for metric, value in metrics.items():
                if not isinstance(value, int | float) or not math.isfinite(value):
                    raise UsageError(
                        f"The reference {task}:{metric}={value} is not a finite number: give the published score."
                    )
