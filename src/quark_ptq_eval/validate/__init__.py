"""Phase 2: structural validation of a Quark export against its source model and plan.

Four checks, cheapest first, reading safetensors headers and small files only (the MD5 check
alone reads tensor bytes): fuzzy layout, auxiliary files, ``config.json``, MD5 of excluded
tensors. Imports neither torch, transformers nor quark.
"""

from .cli import add_validate_arguments, cmd_validate
from .fixes import Fix, apply_fixes, fix_and_revalidate, propose_fixes
from .report import CheckResult, Finding, ValidationReport
from .runner import validate_model

__all__ = [
    "CheckResult", "Finding", "Fix", "ValidationReport", "add_validate_arguments", "apply_fixes", "cmd_validate",
    "fix_and_revalidate", "propose_fixes", "validate_model",
]
