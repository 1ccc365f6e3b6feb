"""Tier 3 (`--tier vllm`): a vLLM server and lm-eval over its OpenAI endpoint.

``tier`` (the tier's contract), ``script`` (the commands as a script for a ROCm host); the vLLM plumbing it shares with the speed tier and Tier 1's vLLM check is ``evaluate.serving``.
"""
