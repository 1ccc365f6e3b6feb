"""A warm engine host: torch, transformers and Quark imported once, each engine command a forked child.

An engine child spends ~15 s of a tiny model's 17 s importing torch, transformers and Quark before it
quantizes for 2 s (measured on this CPU host; forked from a host that has them imported, the same command
takes 2.6 s). For many runs in a row on one CPU host (a CI runner, a script of runs, this project's test
suite) ``python -m quark_ptq_eval.execute.engine_host --socket PATH`` keeps them imported, and runs with
``QUARK_PTQ_EVAL_ENGINE_HOST=PATH`` in their environment ask it for each engine of ours. Each engine is
still a process of its own: its own process group, its output on our pipe, stopped with the run that
asked for it (the host stops it when that run's connection closes, as PR_SET_PDEATHSIG does for a child).
A whole ``quark-ptq-eval`` command can be forked the same way (engine_client.forward_command, opt-in with
``QUARK_PTQ_EVAL_HOST_COMMANDS=1`` and never for a terminal): its process stands in for it, passing its stdin,
stdout, stderr and signals, and the host SIGKILLs the command when that stand-in is SIGKILLed.

The host takes a command only where the forked child is what a fresh child would be (``admission``):
the same interpreter and user, one of our engine modules or the CLI, no variable that the imported libraries
read at import changed, limits and scheduling the host can grant, our code unchanged on disk since the host
imported it; else the run starts the engine (or runs the command) fresh, and an engine's log says why. It never runs a tensor operation itself (a child forked after an OpenMP region has
run hangs in its own first one), and it refuses to start where a GPU is visible: a parent that has
touched the GPU runtime cannot hand it to a forked child, so GPU hosts start each engine fresh.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.execute.engine_child import COMMAND_MODULE, STARTING_ENV, become_engine

HOST_ENV = "QUARK_PTQ_EVAL_ENGINE_HOST"
ENGINE_MODULES = ("quark_ptq_eval.execute.quark_api_engine", "quark_ptq_eval.execute.engines.file2file")
# `quark-ptq-eval ARGS` itself, forked too where its process asks (engine_client.forward_command): a script's or a
# CI runner's command pays no import of torch, transformers and Quark either. Opt-in, and never for a terminal.
COMMANDS_ENV = "QUARK_PTQ_EVAL_HOST_COMMANDS"
COMMAND_IMPORTS = ("quark_ptq_eval.cli.main", "quark_ptq_eval.cli.commands")  # by name: the CLI is the layer above
# Read by the imported libraries when they import (huggingface_hub's offline flag, torch's and OpenMP's
# threads, CUDA's devices...): a command whose environment differs in one of these is started fresh.
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "CUDA", "HIP", "ROCR", "ROCM",
                        "OMP_", "KMP_", "MKL_", "OPENBLAS", "GOMP", "QUARK", "PYTHON", "LD_", "TOKENIZERS", "TRITON",
                        "XDG_", "HOME", "TMPDIR", "MALLOC", "JEMALLOC", "NUMEXPR", "VECLIB")
# Not read at import, or read at import only for what an engine never does: PYTHONUNBUFFERED (the child's streams
# are line-buffered anyway), PYTHONBREAKPOINT (read at each breakpoint()), HF_XET_HIGH_PERFORMANCE (a Hub download's
# transfer mode; lm_eval's import sets it in the asking run, and an engine reads a local directory).
RUNTIME_ONLY = {"PYTHONUNBUFFERED", "PYTHONBREAKPOINT", "HF_XET_HIGH_PERFORMANCE", HOST_ENV, COMMANDS_ENV}
KILL_GRACE_S = 10.0
CODE_AT_START: list[tuple[int, int]] = []  # the host's code_stamp() before its imports (main)


# --- what the asking process hands over, and whether the host can honour it -----------------------------

def request_for(argv: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """What a fresh child of this process would inherit beyond its argv, env and working dir."""
    return {"argv": argv, "env": env, "cwd": str(cwd), "umask": _umask(),
            "rlimits": {name: resource.getrlimit(getattr(resource, name)) for name in _rlimit_names()},
            "nice": os.getpriority(os.PRIO_PROCESS, 0), "affinity": sorted(os.sched_getaffinity(0)),
            "cgroup": _cgroup(), "ignored_signals": _ignored_signals()}


def admission(req: dict[str, Any], uid: int) -> str | None:
    """Why this host cannot run ``req`` as a fresh child would run (None: it can)."""
    argv = req["argv"]
    if uid != os.getuid():
        return "another user asked"
    if not (is_engine_module(argv) or is_command(argv)):
        return "not one of our engine modules or commands"
    if os.path.abspath(argv[0]) != os.path.abspath(sys.executable):
        return f"another interpreter ({argv[0]}; the host runs {sys.executable})"
    if CODE_AT_START and code_stamp() != CODE_AT_START[0]:  # modules it imported then, files read now: a mix
        return "our code changed on disk since the host started (restart the host to use it)"
    changed = _env_changes(req["env"])
    if changed:
        return f"its environment differs from the host's in {', '.join(changed[:4])}"
    if req["cgroup"] != _cgroup():
        return "it runs in another cgroup (its memory and CPU limits would not apply)"
    if req["nice"] < os.getpriority(os.PRIO_PROCESS, 0):
        return "it runs at a higher priority than the host"
    for name, (_soft, hard) in req["rlimits"].items():
        host_hard = resource.getrlimit(getattr(resource, name))[1]
        if host_hard != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > host_hard):
            return f"its {name} is above the host's"
    return None


def code_stamp() -> tuple[int, int]:
    """This package's Python files as the host sees them: how many, and the latest change (an upgrade or an edit
    after the host imported them shows in either)."""
    files = list(Path(__file__).resolve().parents[1].rglob("*.py"))
    return len(files), max((f.stat().st_mtime_ns for f in files), default=0)


def is_engine_module(argv: list[str]) -> bool:
    """``argv`` is ``PYTHON -m`` one of our engine modules (what a host may fork; quark-cli keeps its own process)."""
    return len(argv) >= 3 and argv[1] == "-m" and argv[2] in ENGINE_MODULES


def is_command(argv: list[str]) -> bool:
    """``argv`` is ``PYTHON -m quark_ptq_eval ARGS``: a whole command, with its own stdin, stdout and stderr."""
    return len(argv) >= 3 and argv[1] == "-m" and argv[2] == COMMAND_MODULE


def streams_for(argv: list[str]) -> int:
    """The descriptors a request passes: a command's stdin, stdout and stderr; an engine's one output pipe."""
    return 3 if is_command(argv) else 1


def _env_changes(env: dict[str, str]) -> list[str]:
    """The variables read at import whose value in ``env`` is not the host's. What the host's own imports set
    (KMP_INIT_AT_FORK...) may be absent from ``env`` (a fresh engine's imports set it) or hold the same value."""
    before = STARTING_ENV or dict(os.environ)
    by_imports = {k: v for k, v in os.environ.items() if k not in before}
    keys = (set(env) | set(before)) - RUNTIME_ONLY
    return sorted(k for k in keys if k.startswith(IMPORT_TIME_PREFIXES) and env.get(k) != before.get(k)
                  and not (k in by_imports and env.get(k) in (None, by_imports[k])))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _rlimit_names() -> list[str]:
    return [n for n in dir(resource) if n.startswith("RLIMIT_")]


def _cgroup() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/self/cgroup").read_text()
    return ""


def _ignored_signals() -> list[int]:
    return [int(s) for s in signal.valid_signals() if _handler(s) == signal.SIG_IGN]


def _handler(sig: int) -> Any:
    with contextlib.suppress(ValueError, OSError):
        return signal.getsignal(sig)
    return None


# --- the forked child: become the engine a fresh `python -m MODULE ARGS` would have been -------------------


# --- the host -------------------------------------------------------------------------------------------

@dataclass
class _Hosted:
    conn: socket.socket
    pid: int
    command: bool = False  # a whole command (is_command), not an engine
    kill_at: float | None = None  # once its run's connection closed: SIGKILL what is left then


@dataclass
class Host:
    listener: socket.socket
    by_pid: dict[int, _Hosted] = field(default_factory=dict)

    def serve_forever(self) -> None:
        while True:
            conns = [h.conn for h in self.by_pid.values() if h.kill_at is None]
            # idle, it sleeps until asked; with engines running it wakes to reap them and to stop overdue ones
            readable, _, _ = select.select([self.listener, *conns], [], [], 0.2 if self.by_pid else None)
            for sock in readable:
                if sock is self.listener:
                    self._accept()
                else:
                    self._asker_gone(sock)
            self._reap()
            self._kill_overdue()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        fds: list[int] = []
        try:  # one asker's broken request or early hang-up must not end the host
            req, fds = _receive(conn)
            wanted = streams_for(req.get("argv", []))
            why = admission(req, _peer_uid(conn)) if len(fds) == wanted else f"not {wanted} streams passed"
            if why:
                _reply(conn, {"refused": why})
            else:
                self._fork(conn, req, fds)
                return
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                _reply(conn, {"refused": f"unreadable request ({exc})"})
        conn.close()
        for fd in fds:
            os.close(fd)

    def _fork(self, conn: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
        pid = os.fork()
        if pid == 0:
            self.listener.close()
            for hosted in self.by_pid.values():
                hosted.conn.close()
            conn.close()
            become_engine(req, fds)
        for fd in fds:
            os.close(fd)
        self.by_pid[pid] = _Hosted(conn, pid, command=is_command(req["argv"]))
        with contextlib.suppress(OSError):  # an asker gone already: _asker_gone stops its engine
            _reply(conn, {"pid": pid})

    def _asker_gone(self, conn: socket.socket) -> None:
        """Its run's process closed the connection (killed, or done with it): stop the engine's group. A command's
        asker forwards every signal it can catch (engine_client.forward_command), so it went by SIGKILL: the
        command goes the same way at once, as a fresh process killed so would have."""
        with contextlib.suppress(OSError):
            if conn.recv(4096):
                return  # nothing else is expected from it: ignored
        for hosted in self.by_pid.values():
            if hosted.conn is conn:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(hosted.pid, signal.SIGKILL if hosted.command else signal.SIGTERM)
                hosted.kill_at = time.monotonic() + (0.0 if hosted.command else KILL_GRACE_S)

    def _reap(self) -> None:
        while self.by_pid:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            hosted = self.by_pid.pop(pid, None)
            if hosted is not None:
                with contextlib.suppress(OSError):
                    _reply(hosted.conn, {"exit": os.waitstatus_to_exitcode(status)})
                hosted.conn.close()

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        for hosted in self.by_pid.values():
            if hosted.kill_at is not None and now >= hosted.kill_at:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(hosted.pid, signal.SIGKILL)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(10)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise ValueError("the request ended early")
        data += more
    conn.settimeout(None)
    return json.loads(data), list(fds)


def _reply(conn: socket.socket, doc: dict[str, Any]) -> None:
    conn.sendall(json.dumps(doc).encode() + b"\n")


def _peer_uid(conn: socket.socket) -> int:
    import struct

    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _prepare() -> None:
    """Import what the engines import, and refuse a host that sees a GPU (see the module's docstring)."""
    import importlib

    import torch

    if torch.cuda.is_available():
        raise UsageError("A GPU is visible here: the engine host serves CPU engines only (GPU runs start each "
                         "engine fresh); unset QUARK_PTQ_EVAL_ENGINE_HOST on this machine.")
    from quark_ptq_eval.base.quark_import import import_quark_torch

    import_quark_torch()
    for module in (*ENGINE_MODULES, *COMMAND_IMPORTS):
        importlib.import_module(module)


def refuse_if_served(path: Path) -> None:
    """A socket another host still serves is left alone; one a dead host left is removed."""
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink()
        return
    finally:
        probe.close()
    raise UsageError(f"{path} is already served by another engine host; stop it or name another --socket.")


def listen(path: Path) -> socket.socket:
    """The host's socket at ``path``, for this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    refuse_if_served(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mask = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(mask)
    listener.listen(64)
    return listener


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quark_ptq_eval.execute.engine_host",
                                     description="Keep Quark imported and fork each engine run asked for on SOCKET.")
    parser.add_argument("--socket", required=True, type=Path, help=f"the path runs name in ${HOST_ENV}")
    args = parser.parse_args(argv)
    started = time.monotonic()
    STARTING_ENV.update(os.environ)
    CODE_AT_START.append(code_stamp())
    try:
        refuse_if_served(args.socket)  # before the imports: a second host says so at once
        _prepare()
        listener = listen(args.socket)
    except UsageError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"engine host ready on {args.socket} after {time.monotonic() - started:.1f} s", flush=True)
    try:
        Host(listener).serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            args.socket.unlink()
    return 0

# --- asking the host (the runner's side) ------------------------------------------------------------------


if __name__ == "__main__":
    sys.exit(main())
