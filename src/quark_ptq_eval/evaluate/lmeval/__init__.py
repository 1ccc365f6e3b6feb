"""Tier 2 (`--tier lm_eval`): lm-eval task benchmarks with the model loaded in this process.

``tier`` (the tier's contract), ``tasks`` (lm-eval's task index, scores and per-document samples), ``estimate`` (the runtime estimate).
"""
