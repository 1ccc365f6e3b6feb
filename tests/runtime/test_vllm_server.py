"""One server's life (runtime/vllm_server.py) with a stand-in server: a Python process that answers /health, one
that exits with vLLM's kind of error line, one that never answers. Each is stopped, with its whole process group,
however the block ends, and its log is kept."""

from __future__ import annotations

import sys
import textwrap

import pytest

from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.runtime.vllm_host import STARTED, free_port
from quark_ptq_eval.runtime.vllm_server import ServerNotHealthy, port_free, vllm_server, wait_port_free

_HEALTHY = textwrap.dedent("""
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # an engine core of its own
    print("child-pid", child.pid, flush=True)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_healthy_server_is_handed_over_then_stopped_with_what_it_spawned(tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    begun = []
    with vllm_server([sys.executable, "-c", _HEALTHY, str(port)], port, log, 60, what="the stand-in",
                     while_starting=lambda: begun.append(True)) as server:
        assert begun == [True] and server.port == port and server.log_path == log
        assert server.process.poll() is None and not port_free(port) and server.healthy_after_s > 0
        child = int(next(line.split()[1] for line in log.read_text().splitlines() if line.startswith("child-pid ")))
    assert server.process.poll() is not None and port_free(port)
    import time

    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:  # the group's SIGTERM reaches it
        time.sleep(0.1)
    assert not _alive(child)
    assert log.read_text().splitlines()[0].startswith(STARTED)  # the log is kept; each start's first line


def test_a_server_that_exits_says_its_own_reason_and_one_that_hangs_is_stopped_at_its_deadline(tmp_path):
    port, log = free_port(), tmp_path / "exits.log"
    crash = "print('(EngineCore pid=1) ERROR [core.py:1] ValueError: static_scaled_fp8_quant is not supported'); exit(3)"
    with pytest.raises(ServerNotHealthy) as exited, vllm_server([sys.executable, "-c", crash], port, log, 60,
                                                                 what="the fp8 model"):
        raise AssertionError("never handed over")
    assert exited.value.exited and exited.value.returncode == 3
    assert exited.value.reason == "ValueError: static_scaled_fp8_quant is not supported"
    assert exited.value.message == (f"The vLLM server for the fp8 model exited (code 3) before it was healthy: "
                                    f"ValueError: static_scaled_fp8_quant is not supported; its log is {log}.")
    hang = tmp_path / "hangs.log"
    with pytest.raises(ServerNotHealthy, match=r"was not healthy after 0.5 s, so it was stopped; see .*hangs.log, "
                       r"or allow more time with --vllm-health-timeout\.$") as hung, \
            vllm_server([sys.executable, "-c", "import time; time.sleep(600)"], port, hang, 0.5):
        raise AssertionError("never handed over")
    assert not hung.value.exited  # and stopped: the with left nothing running
    assert hung.value.seconds >= 0.5


def test_a_port_held_by_someone_else_is_waited_for_then_refused_in_one_sentence():
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(QpeError, match=rf"^Port {port} is still in use, so the quantized model's vLLM server "
                           "cannot start: stop what holds it, or choose another --vllm-port, and rerun.$"):
            wait_port_free(port, 0, "the quantized model")
    wait_port_free(port, 0, "the quantized model")  # let go: free at once
