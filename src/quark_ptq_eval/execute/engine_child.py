"""The engine host's forked child (engine_host.py): it becomes the engine a fresh ``python -m MODULE ARGS`` would
have been (its own session and process group, the asking run's environment, limits, signals, working directory
and streams, none of the host's exit hooks), runs the module and exits with its code; it never returns into the
host's loop."""

from __future__ import annotations

import contextlib
import io
import os
import resource
import signal
import sys
from typing import Any

COMMAND_MODULE = "quark_ptq_eval"  # `python -m quark_ptq_eval`: the CLI, forked whole as a command (engine_host.is_command)
STARTING_ENV: dict[str, str] = {}  # the host's environment as it started, before the imports that set some
HOSTED = False  # this process is a command the host forked: it runs here, never asks a host again




def become_engine(req: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: never returns (the process exits with the engine's or the command's code). ``fds``: an
    engine's output pipe, or a command's stdin, stdout and stderr."""
    code = 1
    try:
        _inherit(req, fds)
        argv = req["argv"]
        code = _run_command(argv[3:]) if argv[2] == COMMAND_MODULE else _run_module(argv[2], argv[3:])
    except BaseException:  # noqa: BLE001 - the child must not return into the host's loop
        import traceback

        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        _finish(code)


def _inherit(req: dict[str, Any], fds: list[int]) -> None:
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
    stdin, stdout, stderr = fds if len(fds) == 3 else (os.open(os.devnull, os.O_RDONLY), fds[0], fds[0])
    for target, fd in enumerate((stdin, stdout, stderr)):
        os.dup2(fd, target)
    for fd in {stdin, stdout, stderr} - {0, 1, 2}:
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
    # run as __main__ afresh (runpy warns of a copy already imported); its imports stay. A package runs its
    # __main__, which the host never imported: the package itself stays
    sys.modules.pop(module if module != COMMAND_MODULE else f"{module}.__main__", None)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def _run_command(args: list[str]) -> int:
    """``python -m quark_ptq_eval ARGS`` in this process, as a fresh one runs it (its __main__, its exit); the
    command is not handed to a host again from here (``HOSTED``, which engine_client.forward_command reads)."""
    global HOSTED
    HOSTED = True
    return _run_module(COMMAND_MODULE, args)


def _finish(code: int) -> None:
    from quark_ptq_eval.base.process_exit import exit_now

    with contextlib.suppress(BaseException):
        exit_now(code)  # exit hooks, flushed streams, os._exit
    os._exit(code)
