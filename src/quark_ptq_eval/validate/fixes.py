"""Safe fixes for real failures, applied only on approval of the ``fix`` gate, then re-validated.

The only fix is re-copying a missing or changed auxiliary file (tokenizer, generation config,
licence, ...) from the source (never its README.md: the export's card is its own, see
auxfiles.OWN_FILES). Files the Quark export wrote (weights, index, ``config.json``) and Quark's
own package are never touched: those failures need a new export.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quark_ptq_eval.base.errors import UnsafeInputError
from quark_ptq_eval.base.fsio import umask_mode
from quark_ptq_eval.base.gates import Approver, Gatekeeper, require
from quark_ptq_eval.base.state import digest
from quark_ptq_eval.validate.report import ValidationReport


@dataclass(frozen=True)
class Fix:
    relative_path: str
    reason: str

    def describe(self) -> str:
        return f"re-copy {self.relative_path} from the source ({self.reason})"

    __str__ = describe


def propose_fixes(report: ValidationReport, source: Path, quantized: Path) -> list[Fix]:
    """One re-copy per auxiliary file that is missing or really changed (benign drift needs none)."""
    fixes = []
    for finding in (f for c in report.checks if c.fixable for f in c.failures):
        if (Path(source) / finding.subject).is_file():
            fixes.append(Fix(finding.subject, finding.message.rstrip(".")))
    return fixes


def apply_fixes(fixes: list[Fix], source: Path, quantized: Path, approver: Approver | None = None) -> list[str]:
    """Ask ``approver`` at the ``fix`` gate, then copy each file atomically; returns what was applied.

    ``approver=None`` is for a caller that has just passed the ``fix`` gate itself (the pipeline
    binds that approval to the fixes' digest); it must never be used to skip the gate.
    """
    if not fixes:
        return []
    summary = "\n".join(f"- {f.describe()}" for f in fixes)
    if approver is not None:
        require("fix", approver, f"Fixes for {quantized}:\n{summary}", "re-run with --approve fix (or answer yes).")
    source, quantized = Path(source).resolve(), Path(quantized).resolve()
    _refuse_quark_package(quantized)
    applied = []
    for fix in fixes:
        _copy_atomic(_inside(source, fix.relative_path), _inside(quantized, fix.relative_path, must_exist=False))
        applied.append(fix.describe())
    return applied


def fix_and_revalidate(report: ValidationReport, gates: Gatekeeper, revalidate: Callable[[], ValidationReport],
                       announce: Callable[[str], None]) -> ValidationReport:
    """The fix gate's one loop (the ``validate`` command and the recipe's validation step): propose
    the safe fixes for a failed ``report``, ``announce`` them (their summary), ask the ``fix`` gate
    bound to that summary, apply them and ``revalidate``; the new report lists what was applied.

    Once only: a failure the re-copy did not cure needs a person, not another round.
    """
    # the fixes re-copy files from the source: none without a local one (a Hub id's run)
    local = report.status == "failed" and report.source is not None
    fixes = propose_fixes(report, report.source, report.quantized) if local else []
    if not fixes:
        return report
    summary = "\n".join(f"- {f.describe()}" for f in fixes)
    announce(summary)
    gates.require("fix", digest(summary), summary)
    applied = apply_fixes(fixes, report.source, report.quantized)  # approval was just bound to these fixes
    again = revalidate()
    again.applied_fixes = [*report.applied_fixes, *applied]
    return again


def _inside(root: Path, relative: str, must_exist: bool = True) -> Path:
    target = (root / relative).resolve(strict=must_exist)
    if not target.is_relative_to(root):
        raise UnsafeInputError(f"Refusing to touch {relative}: it resolves outside {root}.")
    return target


def _refuse_quark_package(target: Path) -> None:
    spec = importlib.util.find_spec("quark")  # locates the package without importing it
    for location in (spec.submodule_search_locations or []) if spec else []:
        if target.is_relative_to(Path(location).resolve()):
            raise UnsafeInputError(f"Refusing to write into Quark's installed package at {location}.")


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copy2(src, tmp)
        os.chmod(tmp, umask_mode())  # the export's mode (execute/file_modes.py), not the source file's
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
