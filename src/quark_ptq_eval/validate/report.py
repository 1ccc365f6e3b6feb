"""The validation report: typed results per check, the recipe's verdict, and its renderings.

``status`` follows Quark's ``validation_report`` contract: ``success`` (every check clean or
skipped), ``partial`` (passes, with benign metadata drift only), ``failed`` (anything else).
Titles and which checks are structural come from the check registry (``registry.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from quark_ptq_eval.base.errors import ValidationFailed
from quark_ptq_eval.base.fsio import atomic_write_text, write_json

CheckStatus = Literal["pass", "benign", "warn", "fail", "skipped"]  # warn: an advisory check's failures
Side = Literal["quark", "environment"]
SIDE_LABEL = {
    "quark": "Quark (export/quantization)",
    "environment": "environment (versions, loading, paths)",
}
REPORT_MD = "validation_report.md"
REPORT_JSON = "validation_report.json"
MAX_LISTED = 20  # mismatches shown per check in the human report


@dataclass
class Finding:
    """One difference found by a check, triaged as a real failure or benign drift."""

    subject: str  # a tensor/module name, a relative file path or a JSON path
    message: str  # one sentence
    benign: bool = False
    side: Side | None = None  # who most likely caused a real failure
    evidence: str = ""

    def line(self) -> str:
        tag = "benign" if self.benign else "FAIL"
        side = f" [{SIDE_LABEL[self.side]}]" if self.side and not self.benign else ""
        evidence = f" Evidence: {self.evidence}" if self.evidence else ""
        return f"{tag}{side} {self.subject}: {self.message}{evidence}"


@dataclass
class CheckResult:
    name: str  # a registry check's name
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # informative, never change the verdict
    skipped_reason: str | None = None
    seconds: float = 0.0
    title: str = ""  # set from the registry by the runner
    advisory: bool = False  # set from the registry: its failures are reported ("warn"), the run goes on
    structural: bool = False  # set from the registry: a failure means the weights are wrong
    next_action: str = ""  # set from the registry: the advice when it fails
    fixable: bool = False  # set from the registry: its failures are files the fix gate re-copies
    for_evaluation: list[str] = field(default_factory=list)  # evidence Phase 3 shows (the report's for_evaluation)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if not f.benign]

    @property
    def status(self) -> CheckStatus:
        if self.skipped_reason is not None:
            return "skipped"
        if self.failures:
            return "warn" if self.advisory else "fail"
        return "benign" if self.findings else "pass"

    def summary(self) -> str:
        counts = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in self.stats.items()
                           if isinstance(v, int) and not isinstance(v, bool))
        if self.status == "skipped":
            return f"skipped: {self.skipped_reason}"
        benign = len(self.findings) - len(self.failures)
        verdict = {"pass": "pass", "benign": f"pass with {benign} benign drift(s)",
                   "fail": f"FAIL ({len(self.failures)} mismatch(es))",
                   "warn": f"WARN ({len(self.failures)} finding(s); advisory, the run goes on)"}[self.status]
        return f"{verdict}; {counts}" if counts else verdict

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "status": self.status,
            "summary": self.summary(),
            "seconds": round(self.seconds, 4),
            "skipped_reason": self.skipped_reason,
            "stats": self.stats,
            "notes": self.notes,
            "findings": [asdict(f) for f in self.findings],
        }


@dataclass
class ValidationReport:
    source: Path
    quantized: Path
    checks: list[CheckResult]
    exclude_patterns: list[str] = field(default_factory=list)
    exclusions_from: str = "quantization_config"  # or "plan"
    applied_fixes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    structural: tuple[str, ...] = ()  # the registry's structural checks, as the runner ran them
    calibration: str | None = None  # the calibration actually used (the plan's count of the text)

    def check(self, name: str) -> CheckResult:
        return next(c for c in self.checks if c.name == name)

    @property
    def status(self) -> Literal["success", "partial", "failed"]:
        statuses = {c.status for c in self.checks}
        if "fail" in statuses:
            return "failed"
        return "partial" if "benign" in statuses else "success"

    @property
    def structural_failure(self) -> bool:
        return any(c.status == "fail" for c in self.checks if c.structural or c.name in self.structural)

    @property
    def failures(self) -> list[tuple[str, Finding]]:
        return [(c.name, f) for c in self.checks if not c.advisory for f in c.failures]

    def one_line(self) -> str:
        parts = "; ".join(f"{c.name} {c.status}" for c in self.checks)
        if self.status == "success":
            return f"Validation passed in {self.seconds:.2f}s ({parts})."
        if self.status == "partial":
            n = sum(len(c.findings) for c in self.checks)
            return f"Validation passed with {n} benign metadata drift(s) in {self.seconds:.2f}s ({parts})."
        return f"Validation FAILED: {len(self.failures)} mismatch(es) ({parts})."

    def next_actions(self) -> list[str]:
        if self.status == "success":
            return ["Continue: the quantized model is structurally sound; evaluate it if you wish."]
        if self.status == "partial":
            return ["Continue: only known metadata drift from a newer transformers re-serializing was found."]
        actions: list[str] = []
        if self.structural_failure:
            actions.append(
                "Stop: the weights do not match the plan; inspect the failing tensors above, re-check the "
                "exclusions and scheme, and re-run quantization (Phase 1) before using this output."
            )
        sides = {f.side for _, f in self.failures if f.side}
        if "environment" in sides:
            actions.append("Check the environment evidence above (paths, copies, transformers version).")
        actions += [c.next_action for c in self.checks if c.next_action and c.status == "fail"]
        return actions or ["Inspect the failures above, fix their cause and validate again."]

    def evidence(self) -> list[str]:
        lines = [f"{c.title}: {c.summary()}" for c in self.checks]
        for name, finding in self.failures[:50]:
            lines.append(f"{name}: {finding.line()}")
        return lines

    def summary(self) -> str:
        return self.one_line()

    def to_contract(self) -> dict[str, Any]:
        """Quark's ``validation_report`` contract plus a ``checks`` detail section."""
        return {
            "status": self.status,
            "summary": self.summary(),
            "evidence": self.evidence(),
            "applied_fixes": list(self.applied_fixes),
            "next_actions": self.next_actions(),
            "source_model_dir": str(self.source),
            "quantized_model_dir": str(self.quantized),
            "exclude_patterns": list(self.exclude_patterns),
            "exclusions_from": self.exclusions_from,
            "calibration": self.calibration,
            "seconds": round(self.seconds, 4),
            "checks": {c.name: c.to_dict() for c in self.checks},
            "for_evaluation": [line for c in self.checks for line in c.for_evaluation],
        }

    def to_markdown(self) -> str:
        out = [
            "# Validation report",
            "",
            f"- Source: `{self.source}`",
            f"- Quantized: `{self.quantized}`",
            f"- Status: **{self.status}**: {self.summary()}",
            f"- Exclusions ({self.exclusions_from}): {', '.join(self.exclude_patterns) or '(none)'}",
        ]
        if self.calibration:
            out.append(f"- Calibration used: {self.calibration}")
        if self.applied_fixes:
            out.append(f"- Applied fixes: {'; '.join(self.applied_fixes)}")
        for c in self.checks:
            out += ["", f"## {c.title or c.name}: {c.status}", "", c.summary()]
            for finding in c.findings[:MAX_LISTED]:
                out.append(f"- {finding.line()}")
            out += [f"- note: {n}" for n in c.notes[:MAX_LISTED]]
            if len(c.findings) > MAX_LISTED:
                out.append(f"- ... and {len(c.findings) - MAX_LISTED} more (see validation_report.json)")
        out += ["", "## Next actions", ""] + [f"- {a}" for a in self.next_actions()]
        return "\n".join(out) + "\n"

    def write(self, workdir: str | Path) -> tuple[Path, Path]:
        workdir = Path(workdir)
        md = atomic_write_text(workdir / REPORT_MD, self.to_markdown())
        js = write_json(workdir / REPORT_JSON, self.to_contract())
        return md, js

    def raise_for_status(self) -> None:
        """Raise :class:`ValidationFailed` (exit 4) when the recipe says stop."""
        if self.status != "failed":
            return
        failing = [c for c in self.checks if c.status == "fail"]
        first_check, first = self.failures[0]
        kind = "structural" if self.structural_failure else "non-benign metadata"
        raise ValidationFailed(
            f"Validation failed ({kind}): {', '.join(c.name for c in failing)} check(s) found "
            f"{len(self.failures)} mismatch(es), first: {first.subject}: {first.message}",
            f"See {REPORT_MD} for every mismatch and its likely cause.",
        )

