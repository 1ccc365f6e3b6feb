"""A warm engine host: torch, transformers and Quark imported once, each engine command a forked child.

An engine child spends ~15 s of a tiny model's 17 s importing torch, transformers and Quark before it
quantizes for 2 s (measured on this CPU host; forked from a host that has them imported, the same command
takes 2.6 s). For many runs in a row on one CPU host (a CI runner, a script of runs, this project's test
suite) ``python -m quark_ptq_eval.execute.engine_host --socket PATH`` keeps them imported, and runs with
``QUARK_PTQ_EVAL_ENGINE_HOST=PATH`` in their environment ask it for each engine of ours. Each engine is
still a process of its own: its own process group, its output on our pipe, stopped with the run that
asked for it (the host stops it when that run's connection closes, as PR_SET_PDEATHSIG does for a child).

The host takes a command only where the forked child is what a fresh child would be (``admission``):
the same interpreter and user, one of our engine modules, no variable that the imported libraries read
at import changed, limits and scheduling the host can grant; else the run starts the engine fresh and
its log says why. It never runs a tensor operation itself (a child forked after an OpenMP region has
run hangs in its own first one), and it refuses to start where a GPU is visible: a parent that has
touched the GPU runtime cannot hand it to a forked child, so GPU hosts start each engine fresh.
"""

from __future__ import annotations

import argparse
import contextlib
import io
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

HOST_ENV = "QUARK_PTQ_EVAL_ENGINE_HOST"
ENGINE_MODULES = ("quark_ptq_eval.execute.quark_api_engine", "quark_ptq_eval.execute.engines.file2file")
# Read by the imported libraries when they import (huggingface_hub's offline flag, torch's and OpenMP's
# threads, CUDA's devices...): a command whose environment differs in one of these is started fresh.
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "CUDA", "HIP", "ROCR", "ROCM",
                        "OMP_", "KMP_", "MKL_", "OPENBLAS", "GOMP", "QUARK", "PYTHON", "LD_", "TOKENIZERS", "TRITON",
                        "XDG_", "HOME", "TMPDIR", "MALLOC", "JEMALLOC", "NUMEXPR", "VECLIB")
# Not read at import, or read at import only for what an engine never does: PYTHONUNBUFFERED (the child's streams
# are line-buffered anyway), PYTHONBREAKPOINT (read at each breakpoint()), HF_XET_HIGH_PERFORMANCE (a Hub download's
# transfer mode; lm_eval's import sets it in the asking run, and an engine reads a local directory).
RUNTIME_ONLY = {"PYTHONUNBUFFERED", "PYTHONBREAKPOINT", "HF_XET_HIGH_PERFORMANCE", HOST_ENV}
STARTING_ENV: dict[str, str] = {}  # the host's environment as it started, before the imports that set some
KILL_GRACE_S = 10.0


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
    if not is_engine_module(argv):
        return "not one of our engine modules"
    if os.path.abspath(argv[0]) != os.path.abspath(sys.executable):
        return f"another interpreter ({argv[0]}; the host runs {sys.executable})"
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


def is_engine_module(argv: list[str]) -> bool:
    """``argv`` is ``PYTHON -m`` one of our engine modules (what a host may fork; quark-cli keeps its own process)."""
    return len(argv) >= 3 and argv[1] == "-m" and argv[2] in ENGINE_MODULES


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

def become_engine(req: dict[str, Any], out_fd: int) -> None:
    """In the forked child: never returns (the process exits with the engine's code)."""
    code = 1
    try:
        _inherit(req, out_fd)
        code = _run_module(req["argv"][2], req["argv"][3:])
    except BaseException:  # noqa: BLE001 - the child must not return into the host's loop
        import traceback

        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        _finish(code)


def _inherit(req: dict[str, Any], out_fd: int) -> None:
    os.setsid()  # its own process group, as start_new_session gives a fresh child
    from quark_ptq_eval.base.process_exit import die_with_parent

    die_with_parent()  # the host gone, the engine goes too
    _signals_as_exec(set(req["ignored_signals"]))
    for name, limits in req["rlimits"].items():
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(getattr(resource, name), tuple(limits))
    os.setpriority(os.PRIO_PROCESS, 0, req["nice"])
    os.sched_setaffinity(0, req["affinity"])
    os.umask(req["umask"])
    os.chdir(req["cwd"])
    # what the imports set in the host (KMP_INIT_AT_FORK, TORCHINDUCTOR_CACHE_DIR...) a fresh engine's would set
    set_by_imports = {k: v for k, v in os.environ.items() if k not in STARTING_ENV}
    os.environ.clear()
    os.environ.update({**set_by_imports, **req["env"]})
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    for fd in (devnull, out_fd):
        os.close(fd)
    _fresh_streams()
    _forget_host_exit_hooks()


def _signals_as_exec(ignored: set[int]) -> None:
    """Dispositions as exec leaves them (handled ones default, ignored ones kept), then Python's own start."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(ValueError, OSError):
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # what CPython ignores at start-up
        signal.signal(sig, signal.SIG_IGN)


def _fresh_streams() -> None:
    """sys.stdout / sys.stderr on fds 1 / 2, and the logging handlers that held the host's streams."""
    from quark_ptq_eval.base.ui import swap_handler_streams

    def stream(fd: int) -> io.TextIOWrapper:
        return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                line_buffering=True, write_through=True)

    out, err = stream(1), stream(2)
    old = {id(sys.stdout): out, id(sys.__stdout__): out, id(sys.stderr): err, id(sys.__stderr__): err}
    swap_handler_streams(old)
    sys.stdout, sys.stderr = out, err
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - the process's stdin


def _forget_host_exit_hooks() -> None:
    """The host's exit hooks and finalizers are the host's (its temp dirs): not run when this child exits."""
    import atexit
    import weakref

    atexit._clear()
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        finalizer.atexit = False
    weakref.finalize._registered_with_atexit = False  # type: ignore[attr-defined]


def _run_module(module: str, args: list[str]) -> int:
    import runpy

    sys.argv = [module, *args]
    sys.modules.pop(module, None)  # run as __main__ afresh (runpy warns of a copy already imported); its imports stay
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def _finish(code: int) -> None:
    from quark_ptq_eval.base.process_exit import exit_now

    with contextlib.suppress(BaseException):
        exit_now(code)  # exit hooks, flushed streams, os._exit
    os._exit(code)


# --- the host -------------------------------------------------------------------------------------------

@dataclass
class _Hosted:
    conn: socket.socket
    pid: int
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
            why = admission(req, _peer_uid(conn)) if len(fds) == 1 else "no output pipe was passed"
            if why:
                _reply(conn, {"refused": why})
            else:
                self._fork(conn, req, fds[0])
                return
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                _reply(conn, {"refused": f"unreadable request ({exc})"})
        conn.close()
        for fd in fds:
            os.close(fd)

    def _fork(self, conn: socket.socket, req: dict[str, Any], out_fd: int) -> None:
        pid = os.fork()
        if pid == 0:
            self.listener.close()
            for hosted in self.by_pid.values():
                hosted.conn.close()
            conn.close()
            become_engine(req, out_fd)
        os.close(out_fd)
        self.by_pid[pid] = _Hosted(conn, pid)
        with contextlib.suppress(OSError):  # an asker gone already: _asker_gone stops its engine
            _reply(conn, {"pid": pid})

    def _asker_gone(self, conn: socket.socket) -> None:
        """Its run's process closed the connection (killed, or done with it): stop the engine's group."""
        with contextlib.suppress(OSError):
            if conn.recv(4096):
                return  # nothing else is expected from it: ignored
        for hosted in self.by_pid.values():
            if hosted.conn is conn:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(hosted.pid, signal.SIGTERM)
                hosted.kill_at = time.monotonic() + KILL_GRACE_S

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
    for module in ENGINE_MODULES:
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



if __name__ == "__main__":
    sys.exit(main())
