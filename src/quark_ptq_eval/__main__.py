from quark_ptq_eval.cli.main import entry

entry()
