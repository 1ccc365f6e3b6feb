"""`compare --speed` serves each cell's export once: the cell's serving check (validate/servecheck.py) starts the
server its speed measurement needs (the speed tier's exact command and sizing, asked at the ``eval`` gate first)
and hands it over, healthy, before it stops it (``runtime/vllm_server.handing_over`` around the cell's run). The
measurement is the speed tier's on that server (evaluate/speed/alone.py), kept as the cell's speed.json as speed.py keeps it; the
comparison's speed step then measures only the baseline and any cell not measured here (a resumed comparison's,
a gate still to answer, a cell on Ray).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.errors import CheckpointPending, QpeError
from quark_ptq_eval.flows.compare.options import CompareOptions
from quark_ptq_eval.flows.compare.speed import SpeedCell, cell_inputs, is_current, save_record

if TYPE_CHECKING:
    from quark_ptq_eval.evaluate.speed.alone import ModelSpeed, SpeedPrepared
    from quark_ptq_eval.runtime.vllm_server import ServerNotHealthy, ServerPlan, VllmServer


class CellSpeed:
    """The speed measurement of one cell, taking over the server of the cell's serving check
    (runtime/vllm_server.ServerHandover). ``record``: speed.json's content once measured or refused here."""

    def __init__(self, cell: SpeedCell, opts: CompareOptions, approver: Any, log: Callable[[str], None]):
        self.cell, self.opts, self.approver, self.log = cell, opts, approver, log
        self.prepared: SpeedPrepared | None = None
        self.record: dict[str, Any] | None = None
        self.started = 0.0

    def server_plan(self) -> ServerPlan | None:
        """The speed tier's server for this cell, its commands approved; None (the check serves on its own, the
        speed step later measures) when measured before with the same key, or not to be measured now."""
        from quark_ptq_eval.evaluate.speed.alone import prepare_alone
        from quark_ptq_eval.runtime.vllm_server import ServerPlan

        cell = self.cell
        if is_current(cell, self.opts):
            return None
        self.started = time.perf_counter()
        try:
            prepared = prepare_alone(cell_inputs(cell, self.opts, self.approver, self.log), cell.label, ask=True)
        except (CheckpointPending, QpeError):  # the speed step asks again, and stops or records it there
            return None
        self.prepared, options, label = prepared, prepared.ctx.options, cell.label
        log_path = prepared.ctx.workdir.resolve() / "speed" / f"vllm_{label}.log"
        return ServerPlan(prepared.serve[label], options.vllm_port, log_path, label, prepared.sizing[label],
                          options.vllm_health_timeout_s)

    def take(self, server: VllmServer) -> None:
        from quark_ptq_eval.evaluate.speed.alone import measured_on

        assert self.prepared is not None
        try:
            measured = measured_on(self.prepared, self.cell.label, server)
        except QpeError as exc:
            self._save(exc)
            return
        self._save(measured)

    def not_served(self, failure: ServerNotHealthy | str) -> None:
        """vLLM's refusal (the server exited, or its first request failed) or the timeout, as the speed tier
        records it when it starts the server itself."""
        from quark_ptq_eval.evaluate.speed.alone import refused_alone

        assert self.prepared is not None
        log_path = self.prepared.ctx.workdir.resolve() / "speed" / f"vllm_{self.cell.label}.log"
        if isinstance(failure, str):  # healthy, then its engine died on the first forward (a kernel fault)
            from quark_ptq_eval.runtime.vllm_host import failure_reason

            cause = failure_reason(log_path)
            refusal = (f"vLLM does not serve it: its first request failed ({failure.rstrip('.')})"
                       + (f"; {cause.rstrip('.')}" if cause else "") + f" (log: {log_path}).")
        elif not failure.exited:
            self._save(failure)
            return
        else:
            refusal = (f"vLLM does not serve it: {(failure.reason or 'it exited before it was healthy').rstrip('.')} "
                       f"(log: {log_path}).")
        self._save(refused_alone(self.prepared, self.cell.label, refusal))

    def _save(self, measured: ModelSpeed | QpeError) -> None:
        self.record = save_record(self.cell, self.opts, self.started, measured)
