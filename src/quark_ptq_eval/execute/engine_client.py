"""Asking the engine host (the runner's side, execute/runner.py): the command handed over on the host's socket,
the forked engine's pid and its output read back, waited for as a fresh child's ``Popen`` would be."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from quark_ptq_eval.execute import engine_child
from quark_ptq_eval.execute.engine_host import COMMANDS_ENV, HOST_ENV, is_engine_module, request_for

# What a command's asker passes on to the forked command (SIGKILL it cannot: the host kills the command then).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


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
        reply, rest = _ask(conn, path, request_for(argv, env, cwd), [write_end])
    except (OSError, ValueError) as exc:
        conn.close()
        os.close(read_end)
        return None, f"no engine host answered at {path} ({exc})"
    finally:
        os.close(write_end)  # the host holds its own copy now (or never will)
    if "pid" not in reply:
        conn.close()
        os.close(read_end)
        return None, f"the engine host declined: {reply.get('refused', reply)}"
    conn.settimeout(None)
    stdout = open(read_end, encoding="utf-8", errors="replace")  # noqa: SIM115 - the engine's output, read to its end
    return HostedChild(argv, int(reply["pid"]), conn, stdout, rest), ""


def _ask(conn: socket.socket, path: str, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], bytes]:
    """The host's first reply to ``request`` with ``fds`` passed ({"pid": N} or {"refused": why}), and what came
    after it on the connection; OSError or ValueError where no host answers in time."""
    conn.settimeout(10)
    conn.connect(path)
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
    line, rest = _split_line(conn, b"", 30)
    return json.loads(line), rest


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


def forward_command(args: list[str]) -> int | None:
    """``quark-ptq-eval ARGS`` forked by the engine host, this process its stand-in: the command's exit code (negative:
    the signal that ended it), or None to run the command here. Asked only with ``$QUARK_PTQ_EVAL_HOST_COMMANDS=1``
    beside the host's socket and no terminal on stdin (a script's or a CI runner's command): a terminal's job control
    and Ctrl-C belong to the process the user started. The host declines as it declines an engine (admission); the
    offline switch a command flips at its start is applied to the environment it is judged by."""
    if engine_child.HOSTED or os.environ.get(COMMANDS_ENV) != "1" or not os.environ.get(HOST_ENV) or os.isatty(0):
        return None
    from quark_ptq_eval.base.options import OFFLINE_ENV

    env = {**os.environ, **(OFFLINE_ENV if "--offline" in args else {})}
    argv = [sys.executable, "-m", engine_child.COMMAND_MODULE, *args]
    target: list[int] = []  # the forked command's pid, once the host named it
    pending: list[int] = []  # signals that came before: passed on once it runs, or delivered here if it never does

    def on_signal(number: int, _frame: object) -> None:
        if target:
            _pass_on(target[0], number)
        else:
            pending.append(number)

    before = {sig: signal.signal(sig, on_signal) for sig in FORWARDED_SIGNALS}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        reply, rest = _ask(conn, os.environ[HOST_ENV], request_for(argv, env, Path.cwd()), [0, 1, 2])
        pid = int(reply["pid"]) if "pid" in reply else None
    except (OSError, ValueError):
        pid = None
    if pid is None:  # the command runs here, as without a host
        conn.close()
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for number in pending:
            os.kill(os.getpid(), number)
        return None
    target.append(pid)
    for number in pending:
        _pass_on(pid, number)
    line = _split_line(conn, rest, None)[0]
    return int(json.loads(line)["exit"]) if line else -signal.SIGKILL  # the host gone: the command with it


def _pass_on(pid: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, number)
