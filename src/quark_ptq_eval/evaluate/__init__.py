"""Phase 3 — evaluate: the tiers behind a checkpoint, a measured runtime estimate, an opt-in
baseline, a direction-aware verdict and eval_report.md.

One sub-package per tier, named as the tier is (``--tier NAME``): ``ppl`` (Tier 1), ``lmeval`` (Tier 2,
``lm_eval``), ``vllm`` (Tier 3), ``speed`` (the speed tier); the vLLM plumbing the serving tiers share in
one place, ``serving``. Here: the registry (``tiers``), the options, the API, the verdict and the reports.

Importing this package stays cheap (no torch, transformers, Quark or lm_eval): each tier imports
its heavy dependencies when it runs, and the API modules load on first use (the CLI parser only
needs the argument definitions).
"""

from __future__ import annotations

import importlib
from typing import Any

from quark_ptq_eval.evaluate.cli import add_eval_arguments, cmd_eval, eval_options_from_args
from quark_ptq_eval.evaluate.options import EvalOptions, Thresholds
from quark_ptq_eval.evaluate.tiers import TIERS, Tier

_LAZY = {
    "BASELINE_FROM_SOURCE": "api",
    "EvalReport": "eval_report",
    "estimate_runtime": "api",
    "evaluate": "api",
    "RuntimeEstimate": "context",
}

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
