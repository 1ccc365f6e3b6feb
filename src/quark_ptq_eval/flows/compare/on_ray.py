"""`compare --ray`: the comparison's cells (one per scheme) as Ray tasks, on whichever node holds
what the scheme's plan asks for. Ray schedules; this module only dispatches, watches and records.

Intake, the plans and the commands are made and approved on the driver exactly as in a local
compare (flow.py); the baseline is evaluated once, here, into the cache under the output root,
which every node must see (checked up front). Each cell (ray_cell.py) runs its recipe to the end
and returns what happened; the driver records it in the comparison's state and writes the same
report as a local compare, plus a Cluster section naming each cell's node and any retry.

Faults: a cell whose node or worker is lost is retried by Ray (``max_retries``) on a node that
holds it, and resumes from its recipe state (work-dir lock and output claim: one writer; the
export is renamed into place only once verified, so a lost attempt leaves no half export). A cell
failing for its own reason (validation exit 4, an engine error) returns normally: it is reported
as failed, never retried, and the other cells go on.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import QuantPlan
from quark_ptq_eval.base.errors import CheckpointPending, QpeError
from quark_ptq_eval.base.fsio import atomic_write_text, write_json
from quark_ptq_eval.base.state import RunState
from quark_ptq_eval.base.step_table import STEP_NAMES
from quark_ptq_eval.flows.compare.flow import Comparison
from quark_ptq_eval.flows.compare.options import CompareOptions
from quark_ptq_eval.flows.compare.ray_cell import (
    CellSpec,
    SpeedSpec,
    read_attempts,
    run_cell,
    run_speed_cell,
    warm_worker,
)
from quark_ptq_eval.flows.compare.ray_cluster import (
    Demand,
    Node,
    alive_nodes,
    check_fits,
    check_shared_root,
    connect,
    demand_of,
    import_ray,
    is_alive,
    node_name,
    speed_demand,
)

MAX_RETRIES = 3  # attempts after a lost node or worker (Ray's system failures); never for a cell's own error
POLL_S = 1.0
WARM_WAIT_S = 300.0  # the warm-ups' imports, at most (then the cells go anyway)


class RayComparison(Comparison):
    def __init__(self, root, approver, reporter=None, progress=None, address: str = "auto"):
        super().__init__(root, approver, reporter, progress)
        self.address = address
        self.cells: dict[str, dict[str, Any]] = {}  # scheme -> what the cluster did with its cell
        self.cluster_address: str | None = None

    def _run_schemes(self, opts: CompareOptions, schemes: list[str], baseline) -> None:
        todo = [s for s in schemes if not self._is_current(s, baseline)]
        if not todo:
            return
        self.cluster_address = connect(self.address)
        nodes = alive_nodes()
        check_shared_root(self.root, nodes)
        demands = {s: demand_of(QuantPlan.load(self.workdir(s))) for s in todo}
        check_fits(demands, nodes)
        warming = self._warm_workers(nodes, demands)  # the cells' imports overlap the baseline's build
        self._baseline_once(opts, baseline)
        self._wait_warm(warming)
        self.ui.headline(f"Compare · {len(todo)} cells on Ray ({len(nodes)} nodes at {self.cluster_address})")
        token = uuid.uuid4().hex
        pending: list[tuple[str, str]] = []

        def finished(scheme: str, result: dict[str, Any]) -> None:  # recorded as each cell ends
            if self._record(scheme, result, demands[scheme], token, baseline):
                pending.append((scheme, result.get("error") or "waiting for approval"))

        self._dispatch(opts, todo, demands, token, finished)
        if pending:
            self._relay(pending[0][0], CheckpointPending(pending[0][1]))

    def _measure_speed(self, opts: CompareOptions, baseline) -> None:
        """compare --speed on Ray, after every accuracy cell ended: each speed cell a Ray task asking for the
        GPUs its server needs (ray_cluster.speed_demand: whole GPUs, which Ray gives no other task while it
        holds them); on a CPU vLLM, one cell at a time."""
        from quark_ptq_eval.flows.compare.speed import is_current, server_devices, speed_cells
        from quark_ptq_eval.runtime.vllm_host import find_host_vllm

        cells = [c for c in speed_cells(self, opts, baseline.source) if not is_current(c, opts)]
        if not cells:
            return
        self.cluster_address = self.cluster_address or connect(self.address)
        host = find_host_vllm(opts.eval.vllm_python)
        gpu = bool(host and not host.cpu)
        first_plan = next((c.plan for c in cells if c.plan is not None), None)
        demands = {c.label: speed_demand(server_devices(c, first_plan), gpu) for c in cells}
        check_fits(demands, alive_nodes())
        self.ui.headline(f"Compare · serving speed: {len(cells)} cells on Ray, "
                         + ("each holding its server's GPUs" if gpu else "one at a time (a CPU vLLM)"))
        waves = [[c.label for c in cells]] if gpu else [[c.label] for c in cells]
        for wave in waves:
            self._speed_wave(opts, wave, demands)

    def _speed_wave(self, opts: CompareOptions, labels: list[str], demands: dict[str, Demand]) -> None:
        ray = import_ray()
        task = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(run_speed_cell)
        approved = tuple(sorted(getattr(self.approver, "approved", ())))
        all_gates = bool(getattr(self.approver, "all_gates", False))
        refs = {label: task.options(**demands[label].options(), name=f"speed:{label}").remote(
            SpeedSpec(str(self.root), opts.to_state(), label, approved, all_gates)) for label in labels}
        for label, ref in refs.items():
            record = ray.get(ref)
            if record.get("pending"):
                self._speed_gate(label, CheckpointPending(record["pending"]))
            where = node_name(record.get("node_id"), record.get("node_ip"))
            self.ui.info(f"{label}: serving speed measured on {where} ({demands[label].text()})"
                         + (f": {record.get('refused') or record.get('error')}" if record.get("refused")
                            or record.get("error") else ""))

    def _warm_workers(self, nodes: list[Node], demands: dict[str, Demand]) -> list[Any]:
        """One warm-up task per node that can hold a cell, with the smallest cell's CPUs (soft
        affinity: a node lost meanwhile costs nothing); Ray hands its warm worker to the next cell."""
        ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cpus = min(d.num_cpus for d in demands.values())
        warm = ray.remote(num_cpus=cpus, max_retries=0)(warm_worker)
        fits = [n for n in nodes if n.resources.get("CPU", 0) >= cpus][: len(demands)]
        return [warm.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=True)).remote()
                for n in fits]

    def _wait_warm(self, refs: list[Any]) -> None:
        """Before dispatch: a cell queued behind a warm-up could be given a fresh (cold) worker."""
        ray = import_ray()
        with contextlib.suppress(Exception):  # a failed warm-up only means a cold cell
            ray.get(refs, timeout=WARM_WAIT_S)

    def _baseline_once(self, opts: CompareOptions, baseline) -> None:
        """The cache built here before any cell starts: every cell reads it, none builds it."""
        if not baseline.cache.has(baseline.key):
            baseline._build()
        if opts.eval.tasks:
            baseline.tasks()

    def _dispatch(self, opts: CompareOptions, todo: list[str], demands: dict[str, Demand], token: str,
                  finished: Callable[[str, dict[str, Any]], None]) -> None:
        ray = import_ray()
        cell = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(run_cell)
        approved = tuple(sorted(getattr(self.approver, "approved", ())))
        all_gates = bool(getattr(self.approver, "all_gates", False))
        refs = {s: cell.options(**demands[s].options(), name=f"compare:{s}").remote(
            CellSpec(str(self.root), opts.to_state(), s, approved, all_gates, token)) for s in todo}
        try:
            self._watch(refs, demands, token, finished)
        except BaseException:  # Ctrl-C (or a failing driver): no cell goes on writing behind its back
            for ref in refs.values():
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            raise

    def _watch(self, refs: dict[str, Any], demands: dict[str, Demand], token: str,
               finished: Callable[[str, dict[str, Any]], None]) -> None:
        """Wait for every cell, printing one progress line per cell whenever it changes."""
        ray = import_ray()
        results: dict[str, dict[str, Any]] = {}
        shown: dict[str, str] = {}
        while len(results) < len(refs):
            waiting = [r for s, r in refs.items() if s not in results]
            ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=POLL_S)
            for scheme, ref in refs.items():
                if scheme not in results and ref in ready:
                    results[scheme] = self._outcome(scheme, ref)
                    self._show(scheme, self._line(scheme, demands[scheme], token, results[scheme]), shown)
                    finished(scheme, results[scheme])
                elif scheme not in results:
                    self._show(scheme, self._line(scheme, demands[scheme], token, None), shown)

    def _show(self, scheme: str, line: str, shown: dict[str, str]) -> None:
        if shown.get(scheme) != line:
            shown[scheme] = line
            self.ui.info(line)

    def _outcome(self, scheme: str, ref: Any) -> dict[str, Any]:
        ray = import_ray()
        try:
            return ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - retries used up, or an error outside the recipe: the cell failed
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            return {"status": "failed", "step": self._failed_step(scheme), "hint": None,
                    "error": f"its Ray task failed ({type(exc).__name__}: {first[:300]})"}

    def _line(self, scheme: str, demand: Demand, token: str, result: dict[str, Any] | None) -> str:
        attempts = read_attempts(self.workdir(scheme), token)
        if not attempts:
            return f"[{scheme}] queued for {demand.text()}"
        last = attempts[-1]
        where = f"on {node_name(last.get('node_id'), last.get('node_ip'))}" + (
            f", attempt {len(attempts)}" if len(attempts) > 1 else "")
        if result is not None:
            return f"[{scheme}] {result['status']} {where}" + (f": {result['error']}" if result.get("error") else "")
        return f"[{scheme}] {where}: {_current_step(self.workdir(scheme))}"

    def _record(self, scheme: str, result: dict[str, Any], demand: Demand, token: str, baseline) -> bool:
        """The cell's outcome into the comparison's state, as a local compare records it; True: it
        waits at a gate the user has to answer."""
        baseline.cache.hits += int(result.get("cache_hits") or 0)  # the cells' reads count as this run's
        baseline.cache.writes += int(result.get("cache_writes") or 0)
        status = result["status"]
        if status == "evaluated":
            self.state.record_step(f"scheme:{scheme}", "evaluated", cache_key=result["cache_key"],
                                   tasks_key=result["tasks_key"], verdict=result["verdict"], report=result["report"])
            self.ui.info(f"{scheme}: {result['one_line']}")
            self.progress("done", scheme)
        elif status == "failed":
            self._failed(scheme, result["step"], QpeError(result["error"], result.get("hint")))
        self.cells[scheme] = self._cell_record(scheme, result, demand, token)
        return status == "pending"

    def _cell_record(self, scheme: str, result: dict[str, Any], demand: Demand, token: str) -> dict[str, Any]:
        attempts = read_attempts(self.workdir(scheme), token)
        lost = [{"node": node_name(a.get("node_id"), a.get("node_ip")),
                 "why": "its node was lost" if not is_alive(a.get("node_id")) else "its worker process died"}
                for a in attempts[:-1]]
        last = attempts[-1] if attempts else {}
        return {"status": result["status"], "node": node_name(last.get("node_id"), last.get("node_ip")) if last else None,
                "node_id": last.get("node_id"), "attempts": len(attempts), "retried": bool(lost), "lost": lost,
                "resources": demand.options(), "resources_text": demand.text(),
                "exit_code": result.get("exit_code")}

    def _run_locked(self, opts: CompareOptions) -> dict[str, Any]:
        doc = super()._run_locked(opts)
        return self._with_cluster(doc) if self.cells else doc

    def _with_cluster(self, doc: dict[str, Any]) -> dict[str, Any]:
        """comparison.json and the report, with the Cluster section (which node ran which cell)."""
        from quark_ptq_eval.evaluate.report import json_safe
        from quark_ptq_eval.flows.compare.results import JSON_NAME, REPORT_NAME, markdown

        doc["cluster"] = {"address": self.cluster_address, "nodes": [n.name for n in alive_nodes()],
                          "cells": self.cells}
        write_json(self.root / JSON_NAME, json_safe(doc))
        atomic_write_text(self.root / REPORT_NAME, markdown(doc).rstrip("\n") + "\n\n" + cluster_section(doc) + "\n")
        for scheme, cell in self.cells.items():
            if cell["retried"]:
                self.ui.info(f"{scheme}: retried on {cell['node']} ({retry_text(cell)}).")
        return doc


def retry_text(cell: dict[str, Any]) -> str:
    return "; ".join(f"attempt {i + 1} on {lost['node']} ended: {lost['why']}" for i, lost in enumerate(cell["lost"]))


def cluster_section(doc: dict[str, Any]) -> str:
    c = doc["cluster"]
    lines = ["## Cluster", "", f"Ran on the Ray cluster at {c['address']}: each scheme's recipe as one Ray task, "
             "with the resources its plan asks for; the baseline evaluated once on the driver into the shared cache.",
             "", "| scheme | node | attempts | resources | note |", "|---|---|---|---|---|"]
    for scheme, cell in c["cells"].items():
        note = (f"retried: {retry_text(cell)}; resumed from its recipe state" if cell["retried"] else "")
        lines.append(f"| {scheme} | {cell['node'] or '-'} | {cell['attempts']} | {cell['resources_text']} | "
                     f"{note or cell['status']} |")
    return "\n".join(lines)


def _current_step(workdir: Path) -> str:
    """The scheme's latest recipe step and its status, from its own state file."""
    try:
        steps = RunState.load(workdir).steps
    except QpeError:
        return "starting"
    for name in reversed(STEP_NAMES):
        if name in steps:
            return f"{name} {steps[name].get('status', '')}".strip()
    return "starting"


__all__ = ["MAX_RETRIES", "RayComparison", "cluster_section"]
