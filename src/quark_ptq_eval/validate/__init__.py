"""Phase 2: structural validation of a Quark export against its source model and plan.

The checks are a registry (``checks.CHECKS``), cheapest first: layout against the plan
(headers and shapes), the shard index, auxiliary files and tokenizer behaviour, ``config.json``,
byte identity of every tensor that must not change, then (on request) loading the export and
running a probe. Importing this package pulls in neither torch, transformers nor quark; only
the load check imports them, when it runs.
"""

from quark_ptq_eval.validate.cli import add_validate_arguments, cmd_validate
from quark_ptq_eval.validate.fixes import Fix, apply_fixes, fix_and_revalidate, propose_fixes
from quark_ptq_eval.validate.report import CheckResult, Finding, ValidationReport
from quark_ptq_eval.validate.runner import validate_model

__all__ = [
    "CheckResult", "Finding", "Fix", "ValidationReport", "add_validate_arguments", "apply_fixes", "cmd_validate",
    "fix_and_revalidate", "propose_fixes", "validate_model",
]
