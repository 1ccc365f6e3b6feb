"""Benchmarks: each prints its figures beside the peers' and the load average (python -m bench.benchmarks.<name>)."""
