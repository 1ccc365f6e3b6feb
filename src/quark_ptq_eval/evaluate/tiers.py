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

from quark_ptq_eval.base.errors import UsageError


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


TIERS: dict[str, Tier] = {
    t.name: t
    for t in (
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
        ),
        Tier("skip", "-", "skip", "no evaluation", "none", None, False),
    )
}


def tier_checkpoint() -> tuple[str, str]:
    """The evaluation checkpoint's stop: its message and the flag that continues."""
    runs = "; ".join(f"{t.name} = {t.choice}" for t in TIERS.values() if t.module is not None)
    skip = [t.name for t in TIERS.values() if t.module is None]
    message = f"Stopped at the evaluation checkpoint: choose a tier ({runs}) or {' or '.join(skip)}."
    return message, f"--eval-tier {'|'.join(TIERS)}"


def get_tier(name: str) -> Tier:
    try:
        return TIERS[name]
    except KeyError:
        raise UsageError(f"Unknown evaluation tier {name!r}; choose one of: {', '.join(TIERS)}.") from None
