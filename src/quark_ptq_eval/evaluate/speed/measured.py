"""What the speed tier says of a measurement and of a server that would not serve: shared by the one-at-a-time
tier (tier.py) and the alternating measurement (precision.py)."""

from __future__ import annotations

from pathlib import Path

from quark_ptq_eval.evaluate.speed import stats
from quark_ptq_eval.evaluate.speed.bench import RequestsFailed
from quark_ptq_eval.evaluate.speed.record import Measured
from quark_ptq_eval.runtime.vllm_host import failure_reason
from quark_ptq_eval.runtime.vllm_server import ServerNotHealthy

PORT_FREE_TIMEOUT_S = 120


def measured_from(files: list[Path], server_log: Path) -> Measured:
    """The medians, spread and repeats of vLLM's result files, with what the server said about its KV cache."""
    summary = stats.summarize(stats.read_repeats(files)) | {"server_memory": stats.server_capacity(server_log)}
    return Measured.from_dict(summary)


def server_refusal(exc: ServerNotHealthy, log_path: Path) -> str:
    """A server that exited before it was healthy, in one sentence."""
    return f"vLLM does not serve it: {(exc.reason or 'it exited before it was healthy').rstrip('.')} (log: {log_path})."


def requests_refusal(exc: RequestsFailed, log_path: Path) -> str:
    """A healthy server whose engine died on the first forward (a kernel fault), in one sentence, with its cause."""
    cause = failure_reason(log_path)
    return f"vLLM does not serve it: {exc.message}" + (f"; {cause.rstrip('.')}" if cause else "") \
        + f" (log: {log_path})."
