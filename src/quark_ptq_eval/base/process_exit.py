"""Leave a finished command at once.

After importing torch, transformers and Quark, CPython's own teardown (freeing every module, then the C++
libraries' static objects) takes 1.6-2.3 s on this host for no output: measured with `python -c "import torch,
transformers"` (7.3 s, 5.6 s with ``os._exit``) and with Quark imported (10.7 s, 8.3 s). Every command and engine
child we start pays it (mypy exits the same way for the same reason). The library exit hooks still run first
(``atexit``: logging's flush, Ray's shutdown of a cluster it started, tempfile's and multiprocessing's cleanups),
and a command that leaves a non-daemon thread running exits the usual way, which joins it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn


def exit_now(code: int | None) -> NoReturn:
    """``sys.exit(code)`` without the interpreter's teardown, once the exit hooks have run."""
    status = int(code or 0)
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(status)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            stream.flush()
    os._exit(status)


def die_with_parent() -> None:
    """In a child we start: if its parent is SIGKILLed, the kernel sends the child SIGTERM (Linux
    PR_SET_PDEATHSIG), so an engine cannot go on writing an output nobody will verify."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


READY_LINE = "[quark-ptq-eval] engine ready after "  # an engine's line once its imports are done (engine logs)


def process_age_s() -> float | None:
    """Seconds since this process began (a forked one: since its fork), from /proc; None where there is none."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22, starttime, in clock ticks


def say_ready() -> None:
    """An engine's start-up (its imports, or a fork from a warm host) in its log: what a warm in-process engine
    would not pay (flows/recipe/remedy_cost.run_cost reads it back with ``ready_after_s``)."""
    age = process_age_s()
    if age is not None:
        print(f"{READY_LINE}{age:.1f} s", flush=True)


def ready_after_s(log: Path) -> float | None:
    """The last ``say_ready`` figure in an engine's log (None: no log, or an engine that says none)."""
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith(READY_LINE)]
        return float(lines[-1][len(READY_LINE):].split()[0]) if lines else None
    except (OSError, ValueError):
        return None
