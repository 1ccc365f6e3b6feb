"""The evaluation tiers as a registry: what each one measures, what it costs, which module runs it.

Adding a tier is one row here plus one module that keeps the contract below (see
docs/extending.md). Nothing else names tiers: ``--eval-tier`` choices, the checkpoint's message,
its continue command and the report's title are derived from this table.

The contract of a tier module (:class:`context.TierRunner`, loaded by ``context.tier_module``):

- **options**: it reads what it needs from ``ctx.options`` (an :class:`EvalOptions`); a new
  option is one field there, its flag declared on the field (options.flag).
- ``prepare(ctx: TierContext)`` -> a prepared object whose ``estimate`` (a
  :class:`RuntimeEstimate`) is *measured* by a pilot on the real model and data (``seconds``
  None when nothing runs on this host); ``pilot_s`` (optional) is the pilot's own time. It
  must not ask anything: the flow shows the estimate and asks the ``eval`` gate when it is long.
- ``run(prepared)`` -> :class:`TierOutcome`: scores (task -> metric -> value), the baseline's
  when asked, each metric's direction, details, notes, deferred commands and files written.
  Any further approval goes through ``as_gatekeeper(ctx.approver)``.
- **report section**: report.py renders the outcome's ``details``, ``deferred_commands`` and
  ``notes``; the tier fills those, it writes no report itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from quark_ptq_eval.base.registry import Registry


@dataclass(frozen=True)
class Tier:
    name: str  # value of --tier / --eval-tier
    number: str  # as the recipe counts them
    title: str
    method: str
    cost: str
    module: str | None  # runs the tier; None: nothing to run
    loads_model: bool  # runs the model in this process (so a pilot can time it)
    choice: str = ""  # a few words shown where the evaluation checkpoint stops for a choice
    scores_text: bool = False  # scores a text (--eval-data, or the held-out part of the calibration text)
    scores_tasks: bool = False  # scores lm-eval tasks (--tasks)
    default: bool = False  # EvalOptions' tier when none is named
    # "module:function" rendering this tier's details as report lines (report.py adds the generic ones)
    report_section: str | None = None


TIERS: Registry[Tier] = Registry("evaluation tier", (
    Tier(
        "ppl",
        "1",
        "quick",
        "token-level perplexity on wikitext-2 or a given text "
        "(+ KL divergence and top-1 agreement against the baseline)",
        "minutes",
        "quark_ptq_eval.evaluate.tier_ppl",
        True,
        "perplexity, minutes",
        scores_text=True,
        default=True,
        report_section="quark_ptq_eval.evaluate.report:perplexity_section",
    ),
    Tier(
        "lm_eval",
        "2",
        "medium",
        "lm-eval library task benchmarks, model loaded directly",
        "can take hours on full benchmarks",
        "quark_ptq_eval.evaluate.tier_lmeval",
        True,
        "task benchmarks, can take hours",
        scores_tasks=True,
        report_section="quark_ptq_eval.evaluate.report:task_section",
    ),
    Tier(
        "vllm",
        "3",
        "full",
        "vLLM server + lm-eval over its OpenAI endpoint (ROCm, or any host's vLLM named with --vllm-python)",
        "fast on a ROCm GPU; without a vLLM the commands are recorded for later",
        "quark_ptq_eval.evaluate.tier_vllm",
        False,
        "vLLM server (ROCm, or --vllm-python)",
        scores_tasks=True,
        report_section="quark_ptq_eval.evaluate.report:server_section",
    ),
    Tier("skip", "-", "skip", "no evaluation", "none", None, False),
))
DEFAULT_TIER: str = TIERS.where(lambda t: t.default)[0].name
NO_EVALUATION: str = TIERS.where(lambda t: t.module is None)[0].name  # what --skip_evaluation means


def text_tier() -> Tier:
    """The tier that scores a text (compare's perplexity, the held-out calibration part)."""
    return TIERS.where(lambda t: t.scores_text)[0]


def task_tier() -> Tier:
    """The tier that scores lm-eval tasks on the model in this process (compare --tasks)."""
    return TIERS.where(lambda t: t.scores_tasks and t.loads_model)[0]


def runs(name: str | None) -> bool:
    """Whether the tier named runs anything (an unknown name is refused with the known ones)."""
    return name is not None and TIERS[name].module is not None


def scores_text(name: str | None) -> bool:
    return name is not None and TIERS[name].scores_text


def tier_checkpoint() -> tuple[str, str]:
    """The evaluation checkpoint's stop: its message and the flag that continues."""
    runs = "; ".join(f"{t.name} = {t.choice}" for t in TIERS.values() if t.module is not None)
    skip = [t.name for t in TIERS.values() if t.module is None]
    message = f"Stopped at the evaluation checkpoint: choose a tier ({runs}) or {' or '.join(skip)}."
    return message, f"--eval-tier {'|'.join(TIERS)}"


def get_tier(name: str) -> Tier:
    return TIERS[name]  # an unknown name: UnknownEntry, a UsageError that lists the known ones
