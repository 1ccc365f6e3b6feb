"""The test suite: one folder per package of src/quark_ptq_eval, cross-cutting suites beside them."""

import os

# The product serves every validated export on the checkout's own vLLM when it finds one
# (runtime/vllm_host.py); a server start costs ~20 s, so the suite's runs have none unless a test names
# it (--vllm-python) or clears this.
# Here, not in conftest.py: this package is imported before it, in the controller and every xdist worker.
os.environ.setdefault("QUARK_PTQ_EVAL_VLLM_PYTHON", "none")
