"""The evaluation tiers as data: what each one measures, what it costs, which module runs it.

Adding a tier means adding a row here and a module with ``prepare(ctx)`` and ``run(prepared)``;
no caller branches on tier names.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class Tier:
    name: str  # value of --tier / --eval-tier
    number: str  # as the recipe counts them
    title: str
    method: str
    cost: str
    module: str | None  # runs the tier; None: nothing to run
    loads_model: bool  # runs the model in this process (so a pilot can time it)


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
        ),
        Tier(
            "lm_eval",
            "2",
            "medium",
            "lm-eval library task benchmarks, model loaded directly",
            "can take hours on full benchmarks",
            "quark_ptq_eval.evaluate.tier_lmeval",
            True,
        ),
        Tier(
            "vllm",
            "3",
            "full",
            "vLLM server + lm-eval over its OpenAI endpoint (ROCm only)",
            "fast on a ROCm GPU; elsewhere the commands are recorded for later",
            "quark_ptq_eval.evaluate.tier_vllm",
            False,
        ),
        Tier("skip", "-", "skip", "no evaluation", "none", None, False),
    )
}


def get_tier(name: str) -> Tier:
    try:
        return TIERS[name]
    except KeyError:
        raise UsageError(f"Unknown evaluation tier {name!r}; choose one of: {', '.join(TIERS)}.") from None


def tier_module(tier: Tier):
    """The module that runs ``tier`` (imported only now: its dependencies are heavy)."""
    if tier.module is None:
        raise UsageError(f"Tier {tier.name!r} runs nothing.")
    return importlib.import_module(tier.module)
