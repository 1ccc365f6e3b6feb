"""Phase 3 — evaluate: three tiers behind a checkpoint, a measured runtime estimate, an opt-in
baseline, a direction-aware verdict and eval_report.md.

Importing this package stays cheap (no torch, transformers, Quark or lm_eval): each tier imports
its heavy dependencies when it runs.
"""

from __future__ import annotations

from .api import BASELINE_FROM_SOURCE, EvalReport, estimate_runtime, evaluate
from .cli import add_eval_arguments, cmd_eval, eval_options_from_args
from .context import RuntimeEstimate
from .options import EvalOptions, Thresholds
from .tiers import TIERS, Tier

__all__ = [
    "BASELINE_FROM_SOURCE",
    "TIERS",
    "EvalOptions",
    "EvalReport",
    "RuntimeEstimate",
    "Thresholds",
    "Tier",
    "add_eval_arguments",
    "cmd_eval",
    "estimate_runtime",
    "evaluate",
    "eval_options_from_args",
]
