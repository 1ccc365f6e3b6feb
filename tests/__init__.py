"""The test suite: one folder per package of src/quark_ptq_eval, cross-cutting suites beside them."""
