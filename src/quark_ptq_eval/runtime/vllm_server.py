"""One vLLM server's life, for every caller (Tier 3's executor, the speed tier, Tier 1's vLLM cross-check, the
serving check): ``vllm_server`` starts it with the sized arguments
(vllm_host.py, vllm_sizing.py), waits for /health with a deadline, hands the running server over and stops it with
everything it spawned however the work on it ends; its log is kept.

A server that is not healthy is a :class:`ServerNotHealthy`: the server's own reason from its log when it exited
(vllm_host.failure_reason), the timeout when it did not; each caller words it as its own (a refusal, a finding).
Also here, once for the whole package: the health check and the check that nothing listens on a port; and what a
later user of the same model's server answers (``ServerHandover``: compare --speed gives one to a cell's serving
check, through the recipe and validate_model, so each cell's export is served once).
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.runtime.vllm_host import failure_reason, start_server, stop_group

if TYPE_CHECKING:
    from quark_ptq_eval.runtime.vllm_sizing import ServerSizing

HEALTH_POLL_S = 0.25  # a refused connection costs microseconds: a short poll starts the work sooner
PORT_POLL_S = 1.0  # a stopped server releases its port once its workers have exited


def answers_health(port: int) -> bool:
    """The server on ``port`` of this host answers /health with 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def port_free(port: int) -> bool:
    """Nothing listens on ``port`` of this host (a connection is refused)."""
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", port)) != 0


def wait_port_free(port: int, timeout_s: float, what: str, is_free: Callable[[int], bool] = port_free) -> None:
    """Until nothing listens on ``port`` (a server is never health-checked on someone else's); else one sentence.
    ``what``: whose server is to start there ("the quantized model")."""
    deadline = time.monotonic() + timeout_s
    while not is_free(port):
        if time.monotonic() >= deadline:
            raise QpeError(f"Port {port} is still in use, so {what}'s vLLM server cannot start: stop what holds it, "
                           "or choose another --vllm-port, and rerun.")
        time.sleep(PORT_POLL_S)


class ServerProcess(Protocol):
    """What this module needs of a started server's process (a Popen; a test's stand-in)."""

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...


@dataclass(frozen=True)
class ServerControl:
    """How a server is started, asked and stopped: here on this host by default; Tier 3's executor gives its own
    (a server inside a container, stopped by the pid its launcher wrote, then its ``docker exec``)."""

    start: Callable[[list[str], Path], subprocess.Popen[bytes]] = start_server
    healthy: Callable[[int], bool] = answers_health
    stop: Callable[[subprocess.Popen[bytes]], None] = stop_group
    port_free: Callable[[int], bool] = port_free


LOCAL = ServerControl()


@dataclass(frozen=True)
class VllmServer:
    """A running, healthy server handed to its user."""

    argv: list[str]
    port: int
    log_path: Path
    process: subprocess.Popen[bytes]
    healthy_after_s: float  # from its start


class ServerNotHealthy(QpeError):
    """The server exited before /health answered (``returncode``, and its own ``reason`` when its log holds one),
    or was not healthy within ``timeout_s`` (stopped). The message says which, in one sentence."""

    def __init__(self, what: str, log_path: Path, timeout_s: float, returncode: int | None, seconds: float):
        self.what, self.log_path, self.timeout_s, self.returncode, self.seconds = (what, log_path, timeout_s,
                                                                                    returncode, seconds)
        self.reason = failure_reason(log_path)
        if self.exited:
            message = (f"The vLLM server for {what} exited (code {returncode}) before it was healthy"
                       + (f": {self.reason.rstrip('.')}" if self.reason else "") + f"; its log is {log_path}.")
        else:
            message = (f"The vLLM server for {what} was not healthy after {timeout_s:g} s, so it was stopped; see "
                       f"{log_path}, or allow more time with --vllm-health-timeout.")
        super().__init__(message)

    @property
    def exited(self) -> bool:
        return self.returncode is not None


def wait_healthy(process: ServerProcess, port: int, timeout_s: float,
                 healthy: Callable[[int], bool] = answers_health) -> bool:
    """Until /health answers (True), the server exits or the time is up (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if healthy(port):
            return True
        if process.poll() is not None:
            return False
        time.sleep(min(HEALTH_POLL_S, max(0.1, deadline - time.monotonic())))
    return False


@contextmanager
def vllm_server(argv: list[str], port: int, log_path: Path, health_timeout_s: float, *, what: str = "the model",
                control: ServerControl = LOCAL, while_starting: Callable[[], object] | None = None) -> Iterator[VllmServer]:
    """The server of ``argv`` (listening on ``port``, its output appended to ``log_path``) running and healthy
    inside the ``with``; stopped, its whole process group, however the block ends (a port the caller chose is
    first waited for with ``wait_port_free``; vllm_host.free_port's is fresh). ``while_starting``: work begun
    right after the start, overlapping it (the speed tier's benchmark imports vLLM meanwhile). Raises
    :class:`ServerNotHealthy` (the server stopped) when /health never answered."""
    started = time.monotonic()
    process = control.start(argv, log_path)
    try:
        if while_starting is not None:
            while_starting()
        if not wait_healthy(process, port, health_timeout_s, control.healthy):
            raise ServerNotHealthy(what, log_path, health_timeout_s, process.poll(), time.monotonic() - started)
        yield VllmServer(argv, port, log_path, process, time.monotonic() - started)
    finally:
        control.stop(process)


# ---------------------------------------------------------------- a server handed to a later user
@dataclass(frozen=True)
class ServerPlan:
    """The server a later user needs: its exact command (listening on ``port``, serving ``served_name``), sized
    by ``sizing``; its log; how long it may take to be healthy."""

    argv: list[str]
    port: int
    log_path: Path
    served_name: str
    sizing: ServerSizing
    health_timeout_s: float


class ServerHandover(Protocol):
    """A later user of the server a check starts for the same model: it says which server to start
    (``server_plan``; None: none wanted now, the check starts its own), then gets the healthy server before it
    stops (``take``), or why it never served (``not_served``: the start's failure, or what its first request
    said). Neither raises for the model's own failure: it records it."""

    def server_plan(self) -> ServerPlan | None: ...

    def take(self, server: VllmServer) -> None: ...

    def not_served(self, failure: ServerNotHealthy | str) -> None: ...


# the one hook between a run's caller and its serving check: compare --speed sets it around a cell's run
_HANDOVER: ContextVar[ServerHandover | None] = ContextVar("server_handover", default=None)


@contextmanager
def handing_over(handover: ServerHandover | None) -> Iterator[None]:
    """Within: the serving check of a run hands the server it starts to ``handover`` (None: nobody)."""
    token = _HANDOVER.set(handover)
    try:
        yield
    finally:
        _HANDOVER.reset(token)


def current_handover() -> ServerHandover | None:
    """Who takes the server the serving check starts now (``handing_over``), if anyone."""
    return _HANDOVER.get()
