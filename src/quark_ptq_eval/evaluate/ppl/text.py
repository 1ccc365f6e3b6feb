"""Tier 1's text policy: offline with no ``--eval-data`` and no cached wikitext-2, Tier 1 could only
fail, so the recipe refuses it before any gate or asks for a local text at the evaluation checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from quark_ptq_eval.base.first_use import wikitext_cached
from quark_ptq_eval.evaluate.tiers import scores_text

if TYPE_CHECKING:
    from quark_ptq_eval.base.gates import Approver, Gatekeeper


TIER1_NO_TEXT = ("Tier 1 needs text to score and wikitext-2 is not in the datasets cache (offline); pass "
                 "--eval-data FILE with a local .txt, .jsonl or .parquet text.")


def offline_now(offline: bool | None) -> bool:
    return bool(offline) or "1" in (os.environ.get("HF_DATASETS_OFFLINE"), os.environ.get("HF_HUB_OFFLINE"))


def tier1_lacks_text(tier: str | None, eval_data: str | Path | None, offline: bool | None) -> bool:
    """``tier`` (None: not chosen yet, it may be Tier 1) scores text, no --eval-data is given, we are
    offline and wikitext-2 is not on disk: Tier 1 could only fail. The one place this is decided."""
    could_score = tier is None or scores_text(tier)
    return could_score and not eval_data and offline_now(offline) and not wikitext_cached()


def refuse_without_tier1_text(tier: str | None, eval_data: str | Path | None, offline: bool | None) -> None:
    """A chosen ``tier`` that would score text and has none is refused (None, not chosen yet, never is)."""
    from quark_ptq_eval.base.errors import UsageError

    if tier is not None and tier1_lacks_text(tier, eval_data, offline):
        raise UsageError(TIER1_NO_TEXT)


def ask_tier1_text(approver: Approver | Gatekeeper, default: str | None) -> str | None:
    """At the evaluation checkpoint: a local text path for Tier 1 (Enter takes ``default``),
    asked through the gatekeeper; None when there is no one to ask or no usable answer came."""
    from quark_ptq_eval.base.gates import as_gatekeeper

    default = default if default and Path(default).is_file() else None
    question = ("Tier 1 scores a text and wikitext-2 is not cached (offline). Local text to score "
                "(.txt/.jsonl/.parquet)" + (" [Enter: your calibration text; it flatters the scores, "
                                             "held-out text is better]" if default else ""))
    return as_gatekeeper(approver).ask_path("eval", question, default)
