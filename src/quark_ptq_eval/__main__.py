from quark_ptq_eval.base.process_exit import exit_now
from quark_ptq_eval.flows.cli import main

exit_now(main())
