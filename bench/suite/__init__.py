"""Suite tools: where the test suite's time and CPU go (python -m bench.suite.suite_cpu)."""
