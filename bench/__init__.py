"""Benchmarks and matrices, run as modules from the repository root (``python -m bench.<name>``) so that
they import each other and tests/fixtures as packages."""
