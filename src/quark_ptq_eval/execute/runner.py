"""Run the approved engine command as a child process: argument list, own process group,
streamed progress, full log under the work dir; Ctrl-C / SIGTERM stop the whole group."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, Protocol

from quark_ptq_eval.base.errors import Interrupted
from quark_ptq_eval.base.process_exit import die_with_parent
from quark_ptq_eval.execute.engine_client import HostedChild, start_hosted
from quark_ptq_eval.execute.engine_host import HOST_ENV


@dataclass
class RunResult:
    returncode: int
    seconds: float
    log: Path
    tail: list[str]
    interrupted: bool = False


class LineSink(Protocol):
    """Where the engine's lines are echoed: a text stream, or an EngineEcho."""

    def write(self, line: str, /) -> object: ...


class EngineRunner(Protocol):
    """(argv, extra environment, log path, working dir, echo) -> how the engine ended: run_command's signature."""

    def __call__(self, argv: list[str], env_extra: dict[str, str], log_path: Path, cwd: Path,
                 echo: LineSink | None = ...) -> RunResult: ...


def _stop_group(proc: subprocess.Popen[str] | HostedChild, grace: float = 10.0) -> None:
    """SIGTERM the child's process group, then SIGKILL what is left after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


SHOWN = re.compile(r"^\[quark-ptq-eval\]|Error|error:|Traceback|Perplexity|exported to|Exporting")
QUARK_INFO = re.compile(r"\[QUARK-(INFO|DEBUG)\]")
# A tqdm line: "Calibrating activations:  50%|█████     | 4/8 [00:01<00:01,  3.2it/s]"
TQDM = re.compile(r"^\s*(?P<desc>[^|]*?):?\s*\d{1,3}%\|[^|]*\|\s*(?P<done>\d+)/(?P<total>\d+)")


class EngineEcho:
    """The engine's output for people: our lines and problems as text, its progress bars
    (calibration, freezing, export) as our progress display; the rest (Quark's INFO lines,
    weight loading) is only in the log, which has everything."""

    def __init__(self, ui: Any):  # a ui.Reporter
        self.ui = ui

    def write(self, line: str) -> None:
        bar = TQDM.search(line)
        if bar:
            desc = bar["desc"].strip() or "engine"
            if not desc.startswith("Loading"):
                self.ui.progress(desc, int(bar["done"]), int(bar["total"]))
        elif SHOWN.search(line) and not QUARK_INFO.search(line):
            self.ui.info(line.rstrip("\n"))

    def close(self) -> None:
        self.ui.end_progress()


def _start(argv: list[str], env: dict[str, str], cwd: Path, log: Any) -> subprocess.Popen[str] | HostedChild:
    """The engine as a child of its own: forked by the warm engine host where one is named and can take it
    (engine_host.py), else a fresh process; the log says which."""
    if os.environ.get(HOST_ENV):
        hosted, why = start_hosted(argv, env, cwd)
        if hosted is not None:
            log.write(f"=== forked by the engine host at {os.environ[HOST_ENV]} (pid {hosted.pid})\n")
            return hosted
        log.write(f"=== started fresh: {why}\n")
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True,
                            preexec_fn=die_with_parent)


def run_command(argv: list[str], env_extra: dict[str, str], log_path: Path, cwd: Path,
                echo: LineSink | None = sys.stderr) -> RunResult:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **env_extra, "PYTHONUNBUFFERED": "1"}
    tail: deque[str] = deque(maxlen=200)
    start = time.monotonic()
    interrupted = False
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(signum: int, frame: FrameType | None) -> NoReturn:  # noqa: ARG001
        raise KeyboardInterrupt

    # line-buffered: the log is what a person (or a test) tails while the engine runs, so it is current
    with open(log_path, "a", encoding="utf-8", errors="replace", buffering=1) as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {argv}\n")
        # The handler goes in before the child exists: a SIGTERM in between must not leave it orphaned.
        signal.signal(signal.SIGTERM, on_signal)
        proc: subprocess.Popen[str] | HostedChild | None = None
        try:
            proc = _start(argv, env, cwd, log)
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                tail.append(line.rstrip("\n"))
                if echo is not None:
                    echo.write(line)
            proc.wait()
        except KeyboardInterrupt:
            interrupted = True
            for s in previous:  # a second Ctrl-C must not abandon stopping the engine
                signal.signal(s, signal.SIG_IGN)
            if proc is not None:
                _stop_group(proc)
            log.write("\n=== interrupted: the engine's process group was stopped\n")
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    returncode = proc.returncode if proc is not None and proc.returncode is not None else -9
    result = RunResult(returncode, time.monotonic() - start,
                       log_path, list(tail), interrupted)
    return result


def raise_if_interrupted(result: RunResult) -> None:
    if result.interrupted:
        raise Interrupted(f"Interrupted; the engine was stopped (log: {result.log}).",
                          "Re-run the same command to resume; the partial output is kept aside until you approve removing it.")
