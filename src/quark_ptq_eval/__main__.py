import sys

from quark_ptq_eval.flows.cli import main

sys.exit(main())
