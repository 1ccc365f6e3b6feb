"""Phase 1, step 1 — intake: ``model_analysis.json`` from config.json and safetensors headers only."""

from quark_ptq_eval.intake.analyze import analyze_model, resolve_model

__all__ = ["analyze_model", "resolve_model"]
