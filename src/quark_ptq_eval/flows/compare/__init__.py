"""Compare quantization schemes in one run: one intake, the plans approved together, each scheme
quantized, validated and evaluated against a baseline evaluated once, one report and a recommendation.

    from quark_ptq_eval import compare, FlagApprover
    result = compare("path/to/model", ["int8", "fp8", "int4_wo_128"], "out/",
                     approver=FlagApprover(all_gates=True), calib_data="calib.txt", eval_data="eval.txt")
    result["recommendation"]["reason"]
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from quark_ptq_eval.base.gates import Approver, FlagApprover
from quark_ptq_eval.flows.compare.document import ComparisonDocument
from quark_ptq_eval.flows.compare.options import CompareOptions


def compare(model: str | Path | None, schemes: list[str] | str | None, out_root: str | Path, *,
            approver: Approver | None = None, quiet: bool = True,
            progress: Callable[[str, str], None] | None = None, **options: Any) -> ComparisonDocument:
    """Run (or resume) the comparison in ``out_root``; returns comparison.json's content. Raises
    ``CheckpointPending`` at a gate the approver refuses: call again (same ``out_root``) to go on.
    ``options`` are the command's options by their flag's dest (``options.keywords()``): the PlanRequest
    fields every scheme shares (algorithm, calib_data, ...), the Tier 1 options (eval_data, seq_len,
    max_windows, eval_batch_size, eval_device), ``tasks`` and the other lm-eval options for Tier 2,
    ``top_k``, the budget (max_kl, max_ppl_increase_pct, max_task_drop_pct), offline, overwrite and
    ``ray``: run each scheme as a Ray task on the cluster at this address (``"auto"``, ``"local"`` to
    start one here, or ``HOST:PORT``); a driver already connected (``ray.init``) keeps its cluster."""
    from quark_ptq_eval.base.ui import Reporter
    from quark_ptq_eval.flows.compare.flow import Comparison
    from quark_ptq_eval.flows.compare.options import options_from

    opts = options_from(model, schemes, out_root, options)
    if opts.ray is not None:
        from quark_ptq_eval.flows.compare.on_ray import RayComparison

        comparison: Comparison = RayComparison(out_root, approver or FlagApprover(), Reporter(quiet=quiet), progress,
                                               opts.ray)
    else:
        comparison = Comparison(out_root, approver or FlagApprover(), Reporter(quiet=quiet), progress)
    return cast(ComparisonDocument, comparison.run(opts))  # results.py writes it


__all__ = ["CompareOptions", "ComparisonDocument", "compare"]
