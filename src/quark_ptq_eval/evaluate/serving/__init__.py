"""The vLLM plumbing of the tiers that serve a model (Tier 3, the speed tier, Tier 1's vLLM check), in one place.

``detect`` (the host: ROCm, docker, a named vLLM), ``commands`` (the exact server and client commands, sized), ``executor`` (running them, stopping exactly what it started), ``multinode`` (a layout over Ray nodes), ``ppl`` (Tier 1's perplexity served by vLLM).
"""
