"""Run an approved ``python -m MODULE ...`` engine command inside this process, for callers that
run many engines in a row (the family matrix): ``import quark.torch`` (~20 s) is paid once, not
per run. Same contract as :func:`runner.run_command`: the full log under the work dir, the last
lines as the tail the failure classifier reads, a traceback there when the engine raised.

A command that is not ``python -m MODULE`` (``quark-cli``) still runs as a child process.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
import traceback
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from quark_ptq_eval.base.ui import streams_to
from quark_ptq_eval.execute.runner import LineSink, RunResult, run_command


class _Sink:
    """sys.stdout / sys.stderr while the engine runs: every line to the log, the tail and the echo.
    Once closed, what still writes to it (a handler a library kept) goes to ``after`` instead."""

    def __init__(self, log: TextIO, tail: deque[str], echo: LineSink | None, after: TextIO):
        self.log: TextIO | None = log
        self.tail, self.echo, self.after = tail, echo, after
        self._buf = ""

    def write(self, text: str) -> int:
        if self.log is None:
            return self.after.write(text)
        self.log.write(text)
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self.tail.append(line)
            if self.echo is not None:
                self.echo.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        (self.log or self.after).flush()

    def close(self) -> None:
        self.write("\n")
        self.log = None

    def isatty(self) -> bool:
        return False


class InProcessRunner:
    """An engine runner for ``Recipe(engine_runner=...)``; ``last_error`` keeps the exception the last
    engine raised (with its traceback), for callers that classify it by its frames."""

    def __init__(self) -> None:
        self.last_error: BaseException | None = None

    def __call__(self, argv: list[str], env_extra: dict[str, str], log_path: Path, cwd: Path,
                 echo: LineSink | None = None) -> RunResult:
        self.last_error = None
        if len(argv) < 3 or argv[1] != "-m":
            return run_command(argv, env_extra, log_path, cwd, echo=echo)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        tail: deque[str] = deque(maxlen=200)
        start = time.monotonic()
        with open(log_path, "a", encoding="utf-8", errors="replace") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {argv} (in this process)\n")
            sink = _Sink(log, tail, echo, sys.stderr)
            with _environment(env_extra), streams_to(sink, sink):
                returncode, interrupted = self._main(argv[2], argv[3:])
            sink.close()
        return RunResult(returncode, time.monotonic() - start, log_path, list(tail), interrupted)

    def _main(self, module: str, args: list[str]) -> tuple[int, bool]:
        """(exit code, interrupted) of ``module.main(args)``; an exception is printed as the child's would be."""
        try:
            return int(importlib.import_module(module).main(args) or 0), False
        except SystemExit as exc:  # argparse and sys.exit in the engine
            return (exc.code if isinstance(exc.code, int) else 1), False
        except KeyboardInterrupt:
            print("=== interrupted: the engine was stopped")
            return -2, True
        except Exception as exc:  # noqa: BLE001 - the engine's failure, reported as its exit would be
            self.last_error = exc
            traceback.print_exc(file=sys.stdout)
            return 1, False


@contextlib.contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    """The command's environment variables for the engine's run, then as they were."""
    saved = {k: os.environ.get(k) for k in [*extra, "PYTHONUNBUFFERED"]}
    os.environ.update({**extra, "PYTHONUNBUFFERED": "1"})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
