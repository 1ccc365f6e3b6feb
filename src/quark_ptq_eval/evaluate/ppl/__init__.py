"""Tier 1 (`--tier ppl`): perplexity, KL divergence and top-1 agreement on a text, the model in this process.

``tier`` (the tier's contract), ``data`` (the text and its windows), ``kernels`` (per-token NLL, KL, Δp), ``pilot`` (the timed pilot), ``stats`` (intervals and paired tests), ``text`` (what compare scores through), ``kld_report`` (llama.cpp's figures), ``baseline_cache`` (the baseline's top-K log-probabilities, cached).
"""
