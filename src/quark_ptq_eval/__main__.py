from quark_ptq_eval.flows.cli import entry

entry()
