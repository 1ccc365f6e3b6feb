"""One cell of a comparison as a Ray task: a scheme's recipe from its approved manifest to its
evaluation, on whichever node Ray gives it (on_ray.py dispatches it; this module never imports ray
at its top, so a worker imports only what the cell uses).

The cell is the scheme's typed options (compare's ``RunOptions`` for it, rebuilt here from the
comparison's stored options) and the approvals by name: the driver approved intake, the plans and
the commands for the digests it showed (compare's ``_Delegate`` grants them to the recipe), and the
user's ``--approve`` answers the gates after (result, overwrite). The cell writes only its scheme's
work dir and model dir, under the recipe's work-dir lock and output claim, so a retried attempt
cannot write beside an earlier one; it returns a plain dict and the driver alone writes the
comparison's state. Each attempt is appended to ``ATTEMPTS_FILE`` in the work dir (node, pid,
dispatch token): that is how the driver tells a retry from a first run and names the lost node.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import CheckpointPending, QpeError, WorkdirLocked
from quark_ptq_eval.base.fsio import write_json
from quark_ptq_eval.base.gates import FlagApprover
from quark_ptq_eval.base.ui import Reporter

ATTEMPTS_FILE = "ray_attempts.json"  # in the scheme's work dir
LOCK_WAIT_S = 120.0  # a retry waits this long for a lost attempt's process to let go of the work dir
GRANTED = {"intake", "plan", "execute"}  # approved by the driver for every scheme, as in a local compare


@dataclass(frozen=True)
class CellSpec:
    root: str
    options: dict[str, Any]  # CompareOptions.to_state()
    scheme: str
    approved: tuple[str, ...]  # the user's approvals by gate name (--approve)
    all_gates: bool  # --yes
    token: str  # this dispatch: attempts of an earlier call are not this call's retries


def node_identity() -> dict[str, str]:
    """This worker's Ray node: id and address."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}


def read_attempts(workdir: Path, token: str | None = None) -> list[dict[str, Any]]:
    import json

    try:
        records = json.loads((workdir / ATTEMPTS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    records = [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []
    return [r for r in records if token is None or r.get("token") == token]


def _record_attempt(workdir: Path, spec: CellSpec, node: dict[str, str]) -> int:
    """Attempts run one after another (Ray starts a retry once the last attempt is known lost)."""
    workdir.mkdir(parents=True, exist_ok=True)
    before = read_attempts(workdir)
    attempt = 1 + sum(r.get("token") == spec.token for r in before)
    write_json(workdir / ATTEMPTS_FILE, [*before, {"token": spec.token, "attempt": attempt, "pid": os.getpid(),
                                                   "started_at": time.time(), **node}][-50:])
    return attempt


def warm_worker() -> None:
    """Import what a cell runs in its worker process (validation's load check and Tier 1: torch,
    transformers, Quark's torch API; ~20 s cold; the engine itself is a child process), dispatched
    while the driver builds the baseline cache, so the cells that follow on this worker start warm
    (bench/benchmarks/bench_ray_compare.py)."""
    from quark_ptq_eval.base.quark_import import import_quark_torch

    import_quark_torch()


def run_cell(spec: CellSpec) -> dict[str, Any]:
    """The Ray task's body: the scheme's recipe to its end; what happened, as a dict."""
    from quark_ptq_eval.flows.compare.flow import Comparison
    from quark_ptq_eval.flows.compare.options import CompareOptions

    node = node_identity()
    comparison = Comparison(spec.root, FlagApprover(spec.approved, spec.all_gates), Reporter(quiet=True))
    attempt = _record_attempt(comparison.workdir(spec.scheme), spec, node)
    out: dict[str, Any] = {"scheme": spec.scheme, "attempt": attempt, **node}
    opts = CompareOptions(**spec.options)
    deadline = time.monotonic() + (LOCK_WAIT_S if attempt > 1 else 0.0)
    while True:
        try:
            return {**out, **_recipe_to_end(comparison, opts, spec.scheme)}
        except CheckpointPending as exc:
            return {**out, "status": "pending", "error": exc.message}
        except WorkdirLocked as exc:
            if time.monotonic() < deadline:  # the lost attempt's process is still going away
                time.sleep(2.0)
                continue
            return {**out, **_failure(comparison, spec.scheme, exc)}
        except QpeError as exc:
            return {**out, **_failure(comparison, spec.scheme, exc)}


def _recipe_to_end(comparison, opts, scheme: str) -> dict[str, Any]:
    from quark_ptq_eval.flows.compare.evaluation import BaselineSource, evaluate_scheme

    baseline = BaselineSource(comparison, opts)  # the cache the driver built, on the shared output root
    runs_before = len(comparison._engine_runs(scheme))
    recipe = comparison._recipe(opts, scheme, GRANTED, quiet=True)
    recipe.evaluator = lambda output_dir, source, plan: evaluate_scheme(comparison, opts, scheme, baseline, plan)
    try:
        recipe.run(comparison._run_options(opts, scheme))
    finally:
        comparison._record_timing(scheme, runs_before)
    assert recipe.flow is not None  # the run went through every step
    report = recipe.flow.parts["evaluation"]
    return {"status": "evaluated", "verdict": report.verdict, "report": str(report.report_path),
            "one_line": report.one_line(), "cache_key": baseline.key.id, "tasks_key": baseline.tasks_key,
            "cache_hits": baseline.cache.hits, "cache_writes": baseline.cache.writes}


def _failure(comparison, scheme: str, exc: QpeError) -> dict[str, Any]:
    return {"status": "failed", "step": comparison._failed_step(scheme), "error": exc.message, "hint": exc.hint,
            "exit_code": exc.exit_code}


@dataclass(frozen=True)
class SpeedSpec:
    """One speed cell of compare --speed as a Ray task: the model by its label (a scheme, or the baseline)."""

    root: str
    options: dict[str, Any]  # CompareOptions.to_state()
    label: str
    approved: tuple[str, ...]
    all_gates: bool


def run_speed_cell(spec: SpeedSpec) -> dict[str, Any]:
    """The speed task's body, on the node Ray gave it the GPUs on: the model served on a free port of this
    node and measured (speed.py ``measure_cell``); its record, as a dict. A pending ``eval`` approval is
    returned, not raised: the driver relays it."""
    from quark_ptq_eval.base.state import RunState
    from quark_ptq_eval.flows.compare.flow import Comparison
    from quark_ptq_eval.flows.compare.options import CompareOptions
    from quark_ptq_eval.flows.compare.speed import find_cell, measure_cell

    comparison = Comparison(spec.root, FlagApprover(spec.approved, spec.all_gates), Reporter(quiet=True))
    comparison.state = RunState.load(comparison.root)
    opts = CompareOptions(**spec.options)
    try:
        record = measure_cell(find_cell(comparison, opts, spec.label), opts, comparison.approver, lambda line: None)
    except CheckpointPending as exc:
        return {"label": spec.label, "pending": exc.message}
    return {**record, **node_identity()}
