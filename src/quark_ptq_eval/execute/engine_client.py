"""Asking the engine host (the runner's side, execute/runner.py): the command handed over on the host's socket,
the forked engine's pid and its output read back, waited for as a fresh child's ``Popen`` would be."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
from pathlib import Path

from quark_ptq_eval.execute.engine_host import HOST_ENV, is_engine_module, request_for


class HostedChild:
    """An engine the host forked for us, as much of subprocess.Popen as the runner uses."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, stdout: io.TextIOWrapper, buffered: bytes):
        self.args, self.pid, self.stdout = args, pid, stdout
        self.returncode: int | None = None
        self._conn, self._buffer = conn, buffered

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if self.returncode is None:
            try:
                line = _split_line(self._conn, self._buffer, timeout)[0]
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
            # the host gone without a word: its death took the engine with it (PR_SET_PDEATHSIG)
            self.returncode = int(json.loads(line)["exit"]) if line else -signal.SIGTERM
            self._conn.close()
        return self.returncode


def start_hosted(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[HostedChild | None, str]:
    """(the engine forked by the host named in $QUARK_PTQ_EVAL_ENGINE_HOST, "") or (None, why it was not)."""
    path = os.environ.get(HOST_ENV)
    if not path:
        return None, ""
    if not is_engine_module(argv):
        return None, "not one of our engine modules"
    read_end, write_end = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(10)
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request_for(argv, env, cwd)).encode() + b"\n"], [write_end])
        os.close(write_end)
        write_end = -1
        line, rest = _split_line(conn, b"", 30)
        reply = json.loads(line)
    except (OSError, ValueError) as exc:
        conn.close()
        os.close(read_end)
        return None, f"no engine host answered at {path} ({exc})"
    finally:
        if write_end >= 0:
            os.close(write_end)
    if "pid" not in reply:
        conn.close()
        os.close(read_end)
        return None, f"the engine host declined: {reply.get('refused', reply)}"
    conn.settimeout(None)
    stdout = open(read_end, encoding="utf-8", errors="replace")  # noqa: SIM115 - the engine's output, read to its end
    return HostedChild(argv, int(reply["pid"]), conn, stdout, rest), ""


def _split_line(conn: socket.socket, buffered: bytes, timeout: float | None) -> tuple[bytes, bytes]:
    """(the next line, what came after it); an empty line when the host closed the connection first."""
    conn.settimeout(timeout)
    while b"\n" not in buffered:
        more = conn.recv(4096)
        if not more:
            return b"", b""
        buffered += more
    line, _, rest = buffered.partition(b"\n")
    return line, rest
