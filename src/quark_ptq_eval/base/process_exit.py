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
