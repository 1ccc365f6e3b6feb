"""quark-ptq-eval: quantize -> validate -> evaluate Hugging Face causal LLMs with AMD Quark.

The public API is imported lazily so that ``import quark_ptq_eval`` (and the CLI's start-up)
never pays for torch or Quark.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "analyze_model": "api", "plan_quantization": "api", "build_manifest": "api", "execute_plan": "api",
    "validate_model": "api", "evaluate_model": "api", "run": "api", "compare": "api",
    "ModelAnalysis": "artifacts", "QuantPlan": "artifacts", "RunManifest": "artifacts",
    "Approver": "checkpoints", "FlagApprover": "checkpoints", "TerminalApprover": "checkpoints",
    "CallbackApprover": "checkpoints", "Gate": "checkpoints",
    "QpeError": "errors", "CheckpointPending": "errors", "ValidationFailed": "errors", "ExitCode": "errors",
    "Recipe": "pipeline", "RunOptions": "pipeline",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'quark_ptq_eval' has no attribute {name!r}")
