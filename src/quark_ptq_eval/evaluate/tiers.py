"""The evaluation tiers as a registry: what each one measures, what it costs, which module runs it.

Adding a tier is one row here plus one module that keeps the contract below (see
docs/extending.md). Nothing else names tiers: ``--eval-tier`` choices, the checkpoint's message,
its continue command and the report's title are derived from this table.

The contract of a tier is a class: its module subclasses ``context.TierRunner`` (``prepare`` a pilot that measures
and asks nothing, ``score``, ``section`` for the report), or ``context.TextScorer`` where it scores a text and
``context.TaskScorer`` where it scores lm-eval tasks in this process (what compare scores through). The row names
the subclass as ``"module:Class"``: :func:`check_tier` checks at registration that the module defines it (from its
source, without importing it: its dependencies are heavy), ``context.tier_runner`` when the tier runs that it
subclasses the base its row promises and leaves no abstract method undefined. A tier's own options
(``options``, optional) are ``"module:Class"``, a dataclass whose fields declare their own flags
(``base.options.flag``): ``--eval-tier``'s commands take them, the tier reads them with ``ctx.options.of(Class)``,
the report's settings show the ones given.
"""

from __future__ import annotations

from dataclasses import dataclass

from quark_ptq_eval.base.registry import InvalidEntry, Registry, defined_names, split_ref


@dataclass(frozen=True)
class Tier:
    name: str  # value of --tier / --eval-tier
    number: str  # as the recipe counts them
    title: str
    method: str
    cost: str
    runner: str | None  # "module:Class", the tier's subclass of context.TierRunner; None: nothing to run
    loads_model: bool  # runs the model in this process (so a pilot can time it)
    choice: str = ""  # a few words shown where the evaluation checkpoint stops for a choice
    scores_text: bool = False  # scores a text (--eval-data, or the held-out part of the calibration text)
    scores_tasks: bool = False  # scores lm-eval tasks (--tasks)
    default: bool = False  # EvalOptions' tier when none is named
    options: str | None = None  # "module:Class": a dataclass of the tier's own options, each declaring its flag


def check_tier(tier: Tier) -> None:
    """Refuse a row that lacks the contract (module docstring), naming every part that is missing."""
    problems = [f"its {what} is empty" for what in ("name", "number", "title") if not getattr(tier, what)]
    if tier.runner is None:
        named = [f for f in ("options", "scores_text", "scores_tasks", "default") if getattr(tier, f)]
        problems += [f"it runs nothing (no runner) but sets {', '.join(named)}"] if named else []
    else:
        problems += _missing_ref(tier.runner, "runner")
        if tier.options is not None:
            problems += _missing_ref(tier.options, "options")
    if problems:
        raise InvalidEntry(f"The evaluation tier {tier.name!r} is refused: {'; '.join(problems)}. A tier's runner "
                           "subclasses context.TierRunner (evaluate/tiers.py); see docs/extending.md.")


def _missing(module: str, names: tuple[str, ...], what: str) -> list[str]:
    try:
        defined = defined_names(module)
    except InvalidEntry as exc:
        return [f"its {what} {exc.message}"]
    lacking = [n for n in names if defined is not None and n not in defined]
    return [f"its {what} {module} defines no {', '.join(lacking)}"] if lacking else []


def _missing_ref(ref: str, what: str) -> list[str]:
    module, attr = split_ref(ref)
    if not attr:
        return [f"its {what} {ref!r} is not \"module:name\""]
    return _missing(module, (attr,), what)


TIERS: Registry[Tier] = Registry("evaluation tier", entry_type=Tier, check=check_tier, entries=(
    Tier(
        "ppl",
        "1",
        "quick",
        "token-level perplexity on wikitext-2 or a given text "
        "(+ KL divergence and top-1 agreement against the baseline)",
        "minutes",
        "quark_ptq_eval.evaluate.ppl.tier:PerplexityTier",
        True,
        "perplexity, minutes",
        scores_text=True,
        default=True,
        options="quark_ptq_eval.evaluate.ppl.options:PplOptions",
    ),
    Tier(
        "lm_eval",
        "2",
        "medium",
        "lm-eval library task benchmarks, model loaded directly",
        "can take hours on full benchmarks",
        "quark_ptq_eval.evaluate.lmeval.tier:LmEvalTier",
        True,
        "task benchmarks, can take hours",
        scores_tasks=True,
    ),
    Tier(
        "vllm",
        "3",
        "full",
        "vLLM server + lm-eval over its OpenAI endpoint (ROCm, or any host's vLLM named with --vllm-python)",
        "fast on a ROCm GPU; without a vLLM the commands are recorded for later",
        "quark_ptq_eval.evaluate.vllm.tier:VllmTier",
        False,
        "vLLM server (ROCm, or --vllm-python)",
        scores_tasks=True,
    ),
    Tier(
        "speed",
        "speed",
        "serving speed",
        "vLLM's own serving benchmark (vllm.benchmarks.serve, random prompts) on the export and, with "
        "--baseline, its source: a warm-up, then --speed-repeats repeats, with a baseline on a CPU vLLM alternately "
        "until the gain is within --speed-precision (needs --vllm-python)",
        "minutes on a CPU with the small default workload; a server start per model",
        "quark_ptq_eval.evaluate.speed.tier:SpeedTier",
        False,
        "vLLM serving throughput and latency (--vllm-python)",
        options="quark_ptq_eval.evaluate.speed.workload:SpeedOptions",
    ),
    Tier("skip", "-", "skip", "no evaluation", "none", None, False),
))
DEFAULT_TIER: str = TIERS.where(lambda t: t.default)[0].name
NO_EVALUATION: str = TIERS.where(lambda t: t.runner is None)[0].name  # what --skip_evaluation means


def text_tier() -> Tier:
    """The tier that scores a text (compare's perplexity, the held-out calibration part)."""
    return TIERS.where(lambda t: t.scores_text)[0]


def task_tier() -> Tier:
    """The tier that scores lm-eval tasks on the model in this process (compare --tasks)."""
    return TIERS.where(lambda t: t.scores_tasks and t.loads_model)[0]


def runs(name: str | None) -> bool:
    """Whether the tier named runs anything (an unknown name is refused with the known ones)."""
    return name is not None and TIERS[name].runner is not None


def scores_text(name: str | None) -> bool:
    return name is not None and TIERS[name].scores_text


def tier_checkpoint() -> tuple[str, str]:
    """The evaluation checkpoint's stop: its message and the flag that continues."""
    runs = "; ".join(f"{t.name} = {t.choice}" for t in TIERS.values() if t.runner is not None)
    skip = [t.name for t in TIERS.values() if t.runner is None]
    message = f"Stopped at the evaluation checkpoint: choose a tier ({runs}) or {' or '.join(skip)}."
    return message, f"--eval-tier {'|'.join(TIERS)}"


def get_tier(name: str) -> Tier:
    return TIERS[name]  # an unknown name: UnknownEntry, a UsageError that lists the known ones
