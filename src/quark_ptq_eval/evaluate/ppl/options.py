"""Tier 1's own flags (its row's ``options`` in evaluate/tiers.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from quark_ptq_eval.base.options import flag


@dataclass
class PplOptions:
    """``--stream-blocks``: Tier 1 streamed one decoder block at a time (evaluate/ppl/stream.py). Without it,
    Tier 1 streams on its own when the models it would load do not fit this host's memory."""

    stream_blocks: bool = field(default=False, metadata=flag(
        "--stream-blocks", action="store_true",
        help="Tier 1: stream both checkpoints one decoder block at a time (at most one block of each in memory); "
             "chosen on its own when the models do not fit this host's RAM"))
