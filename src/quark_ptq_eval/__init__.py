"""quark-ptq-eval: quantize -> validate -> evaluate Hugging Face causal LLMs with AMD Quark.

The public API is imported lazily so that ``import quark_ptq_eval`` (and the CLI's start-up)
never pays for torch or Quark.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "analyze_model": "flows.api", "plan_quantization": "flows.api", "build_manifest": "flows.api", "execute_plan": "flows.api",
    "validate_model": "flows.api", "evaluate_model": "flows.api", "run": "flows.api", "compare": "flows.api",
    "ModelAnalysis": "base.artifacts", "QuantPlan": "base.artifacts", "RunManifest": "base.artifacts",
    "Approver": "base.gates", "FlagApprover": "base.gates", "TerminalApprover": "base.gates",
    "CallbackApprover": "base.gates", "Gate": "base.gates",
    "QpeError": "base.errors", "CheckpointPending": "base.errors", "ValidationFailed": "base.errors", "ExitCode": "base.errors",
    "Recipe": "flows.recipe.pipeline", "RunOptions": "flows.recipe.pipeline",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'quark_ptq_eval' has no attribute {name!r}")
