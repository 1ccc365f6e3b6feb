"""Sensitivity scan: which layers a scheme hurts, and which to keep unquantized to buy accuracy back.

``run_sensitivity(model_dir, scheme, calib_data, out_dir)`` measures every quantizable layer's
KL alone (Quark fake-quant, cached and resumable), proposes the smallest set of layers to keep
unquantized so that the measured KL meets ``max_kl`` (or at a wider scheme, when that measures
within the budget for fewer bytes), and writes sensitivity_report.md/.json/.png.
See docs/sensitivity.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.evaluate.scan_followup import scan_command
from quark_ptq_eval.sensitivity.cache import ScanCache
from quark_ptq_eval.sensitivity.emulation import check_scheme_runs
from quark_ptq_eval.sensitivity.proposal import Proposal, default_max_kl, propose
from quark_ptq_eval.sensitivity.report import write_reports
from quark_ptq_eval.sensitivity.scan import ScanOptions, measure_kl, open_session, scan
from quark_ptq_eval.sensitivity.wider import try_wider, wider_scheme

__all__ = ["Proposal", "ScanOptions", "SensitivityOutcome", "default_max_kl", "propose", "run_sensitivity"]


@dataclass(frozen=True)
class SensitivityOutcome:
    """What run_sensitivity did: ``status`` "complete", or the scan's own status when it stopped
    before its end (``--estimate-only``: no proposal, no reports)."""

    status: str
    result: dict[str, Any]  # the scan, as sensitivity_report.json and the cache hold it
    proposal: Proposal | None = None
    reports: dict[str, Path] = field(default_factory=dict)  # "md", "json", "png"


def run_sensitivity(opts: ScanOptions, out_dir: Path, max_kl: float | None = None,
                    progress: Callable[[str], None] = print, wider: str | None = "auto",
                    served: Callable[[Proposal], Proposal] | None = None) -> SensitivityOutcome:
    """Scan (or reuse the cached scan), propose exclusions for ``max_kl``, measure the same layers at
    ``wider`` ("auto": fp8 for fp4/fp6 formats, int8 for int4; None: exclusions only), write the reports.
    ``served`` holds the proposal to what the target serves before the reports say it (flows/recipe/plan_scan.py)."""
    if not (Path(opts.model_dir) / "config.json").exists():
        raise UsageError(f"The sensitivity scan needs a local model directory; {opts.model_dir} has no config.json.")
    check_scheme_runs(opts.model_dir, opts.scheme, opts.exclude, opts.layer_config)  # before anything loads
    budget = default_max_kl() if max_kl is None else max_kl
    result, session = scan(opts, progress)
    if result["status"] != "complete":
        progress(f"sensitivity: {result['measured']} of {result['layers']} layers measured and kept; "
                 "run again without --estimate-only to finish")
        return SensitivityOutcome(result["status"], result)

    def measure(excluded: set[str]) -> float:
        """KL with every quantized module but those the ``excluded`` patterns name."""
        nonlocal session
        if session is None:  # cached scan, new combination: quantize once more to measure it
            session = open_session(opts, _batches(opts))
        return measure_kl(session, {n for n in session.layers if not any(fnmatchcase(n, p) for p in excluded)})

    known = result.setdefault("combinations", {})
    before = len(known)
    proposal = propose(result, budget, measure)
    try_wider(opts, proposal, result, lambda: _batches(opts), wider_scheme(opts.scheme) if wider == "auto" else wider,
              progress)
    if served is not None:
        proposal = served(proposal)
    if opts.use_cache and len(known) != before:
        ScanCache(result["key"], opts.cache_root).save_final({k: v for k, v in result.items() if k != "cache_hit"})
    command = scan_command(opts.model_dir, opts.scheme, opts.calib_data, out_dir)
    paths = write_reports(Path(out_dir), result, proposal.as_dict(), command)
    return SensitivityOutcome("complete", result, proposal, paths)


def _batches(opts: ScanOptions) -> list[Any]:
    from transformers import AutoTokenizer

    from quark_ptq_eval.base.textdata import load_texts
    from quark_ptq_eval.execute.quark_api_parts import calibration_batches

    tokenizer = AutoTokenizer.from_pretrained(opts.model_dir, trust_remote_code=opts.trust_remote_code)
    return calibration_batches(tokenizer, load_texts(opts.calib_data), opts.seq_len, opts.num_samples, 1, opts.device)
