"""Tier 1's text policy: offline with no ``--eval-data`` and no cached wikitext-2, Tier 1 could only
fail, so the recipe refuses it before any gate or asks for a local text at the evaluation checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.first_use import wikitext_cached

if TYPE_CHECKING:
    from quark_ptq_eval.base.gates import Approver, Gatekeeper


TIER1_NO_TEXT = ("Tier 1 needs text to score and wikitext-2 is not in the datasets cache (offline); pass "
                 "--eval-data FILE with a local .txt, .jsonl or .parquet text.")


def offline_now(offline: bool | None) -> bool:
    return bool(offline) or "1" in (os.environ.get("HF_DATASETS_OFFLINE"), os.environ.get("HF_HUB_OFFLINE"))


def tier1_lacks_text(eval_options: dict[str, Any], offline: bool | None) -> bool:
    """Tier 1 with no --eval-data, offline, and no wikitext-2 on disk: it could only fail."""
    return not eval_options.get("eval_data") and offline_now(offline) and not wikitext_cached()


def ask_tier1_text(approver: Approver | Gatekeeper, default: str | None) -> str | None:
    """At the evaluation checkpoint: a local text path for Tier 1 (Enter takes ``default``),
    asked through the gatekeeper; None when there is no one to ask or no usable answer came."""
    from quark_ptq_eval.base.gates import as_gatekeeper

    default = default if default and Path(default).is_file() else None
    question = ("Tier 1 scores a text and wikitext-2 is not cached (offline). Local text to score "
                "(.txt/.jsonl/.parquet)" + (" [Enter: your calibration text; it flatters the scores, "
                                             "held-out text is better]" if default else ""))
    return as_gatekeeper(approver).ask_path("eval", question, default)
