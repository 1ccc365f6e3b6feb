"""Compare quantization schemes in one run: one intake, the plans approved together, each scheme
quantized, validated and evaluated against a baseline evaluated once, one report and a recommendation.

    from quark_ptq_eval import compare, FlagApprover
    result = compare("path/to/model", ["int8", "fp8", "int4_wo_128"], "out/",
                     approver=FlagApprover(all_gates=True), calib_data="calib.txt", eval_data="eval.txt")
    result["recommendation"]["reason"]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quark_ptq_eval.base.gates import Approver, FlagApprover
from quark_ptq_eval.flows.compare.options import CompareOptions

PLAN_KEYS = ("goal", "target", "algorithm", "kv_cache_scheme", "exclude_layers", "no_exclusions",
             "layer_quant_config", "calib_data", "calib_dataset", "num_calib_samples", "calib_seq_len",
             "batch_size", "device", "multi_device", "engine", "trust_remote_code", "evaluation_intent")


def compare(model: str | Path | None, schemes: list[str] | str | None, out_root: str | Path, *,
            approver: Approver | None = None, quiet: bool = True, progress=None, eval_data: str | Path | None = None,
            seq_len: int | None = None, max_windows: int | None = None, eval_batch_size: int | None = None,
            eval_device: str | None = None, top_k: int | None = None, max_kl: float | None = None,
            max_ppl_increase_pct: float | None = None, tasks: list[str] | str | None = None,
            include_path: str | Path | None = None, limit: float | None = None, num_fewshot: int | None = None,
            max_task_drop_pct: float | None = None, offline: bool | None = None, overwrite: bool = False,
            **plan_request: Any) -> dict[str, Any]:
    """Run (or resume) the comparison in ``out_root``; returns comparison.json's content. Raises
    ``CheckpointPending`` at a gate the approver refuses: call again (same ``out_root``) to go on.
    ``plan_request`` takes the PlanRequest fields shared by every scheme (algorithm, calib_data, ...).
    ``tasks`` adds Tier 2: lm-eval task scores per scheme with paired tests against the baseline."""
    from quark_ptq_eval.base.ui import Reporter
    from quark_ptq_eval.flows.compare.flow import Comparison

    unknown = set(plan_request) - set(PLAN_KEYS)
    if unknown:
        raise TypeError(f"compare() got unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    if isinstance(schemes, str):
        schemes = [s.strip() for s in schemes.split(",") if s.strip()]
    if isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    given = {"eval_data": str(Path(eval_data).resolve()) if eval_data else None, "seq_len": seq_len,
             "max_windows": max_windows, "batch_size": eval_batch_size, "device": eval_device, "top_k": top_k,
             "max_kl": max_kl, "max_ppl_increase_pct": max_ppl_increase_pct, "tasks": list(tasks) if tasks else None,
             "include_path": str(Path(include_path).resolve()) if include_path else None, "limit": limit,
             "num_fewshot": num_fewshot, "max_task_drop_pct": max_task_drop_pct}
    if model and Path(model).exists():
        model = Path(model).resolve()  # stored for a resume from another directory
    options = CompareOptions(model=str(model) if model else None, schemes=list(schemes or []),
                             out_root=str(out_root), plan=dict(plan_request), offline=offline, overwrite=overwrite,
                             **{k: v for k, v in given.items() if v is not None})
    comparison = Comparison(out_root, approver or FlagApprover(), Reporter(quiet=quiet), progress)
    return comparison.run(options)


__all__ = ["CompareOptions", "compare"]
