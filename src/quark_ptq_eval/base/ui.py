"""Everything the user reads goes to stderr (stdout is kept for --json); rich on a terminal,
plain text elsewhere.

Long work shows a progress bar with an ETA on a terminal and a milestone line per quarter
elsewhere. Third-party noise written in this process during a run (Quark's INFO lines,
progress bars of libraries, tokenizer length warnings) goes to the run's log file instead of
the terminal (:func:`noise_to_log`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

if TYPE_CHECKING:
    from rich.progress import Progress

MILESTONES = (25, 50, 75, 100)  # percent: the plain-text progress lines


class TextSink(Protocol):
    """What stands in for sys.stdout / sys.stderr: a real stream, a NoiseFilter, an engine's log."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class Reporter:
    def __init__(self, quiet: bool = False, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.rich = self.stream.isatty() and not quiet
        self._bars: dict[str, Any] = {}  # progress key -> rich task id, or (start, last milestone)
        self._live: Progress | None = None
        if self.rich:
            from rich.console import Console

            self._console = Console(file=self.stream)

    def info(self, msg: str) -> None:
        if self.quiet:
            return
        if self.rich:  # through the console, so a live progress bar stays below the text
            self._console.print(msg, markup=False, highlight=False, soft_wrap=True)
        else:
            print(msg, file=self.stream, flush=True)

    def headline(self, msg: str) -> None:
        if self.rich:
            self._console.rule(msg)
        elif not self.quiet:
            print(f"\n== {msg}", file=self.stream, flush=True)

    def table(self, title: str, rows: Iterable[tuple[Any, ...]], columns: tuple[str, ...] = ("", "")) -> None:
        rows = [tuple("-" if v is None else str(v) for v in r) for r in rows]
        if self.quiet:
            return
        if self.rich:
            from rich.table import Table

            t = Table(title=title, show_header=any(columns))
            for c in columns:
                t.add_column(c, overflow="fold")
            for r in rows:
                t.add_row(*r)
            self._console.print(t)
            return
        print(f"{title}:", file=self.stream)
        width = max((len(r[0]) for r in rows), default=0)
        for r in rows:
            print(f"  {r[0]:<{width}}  " + "  |  ".join(r[1:]), file=self.stream)
        self.stream.flush()

    # -- progress of long work --------------------------------------------------------------
    def progress(self, key: str, done: int, total: int) -> None:
        """``done`` of ``total`` units of the work called ``key`` (calibration, export, batches)."""
        if self.quiet or total <= 0:
            return
        if self.rich:
            self._rich_progress(key, done, total)
            return
        start, shown = self._bars.get(key, (time.monotonic(), 0))
        reached = max((m for m in MILESTONES if done * 100 >= m * total), default=0)
        if reached > shown:
            elapsed = time.monotonic() - start
            left = elapsed / done * (total - done) if 0 < done < total else 0.0
            eta = f", about {_duration(left)} left" if left >= 1 else ""  # under a second: nothing to wait for
            print(f"  {key}: {reached}% ({done}/{total}){eta}", file=self.stream, flush=True)
        self._bars[key] = (start, max(reached, shown))

    def _rich_progress(self, key: str, done: int, total: int) -> None:
        if self._live is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            # No redirection of sys.stdout/sys.stderr: the run's noise filter stays in place.
            self._live = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeRemainingColumn(), console=self._console, redirect_stdout=False,
                                  redirect_stderr=False)
            self._live.start()
        if key not in self._bars:
            self._bars[key] = self._live.add_task(key, total=total)
        self._live.update(self._bars[key], completed=done, total=total)

    def end_progress(self) -> None:
        """The long work is over: stop the live bars (they stay on screen as they ended)."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        self._bars.clear()


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


# Lines of libraries we run in this process that belong in the log, not on the terminal.
NOISE = re.compile(
    r"\d+%\|"  # tqdm bars (weight loading, datasets, Quark's calibration loops)
    r"|\[QUARK-(INFO|DEBUG|WARNING)\]"
    r"|Token indices sequence length is longer than"
    r"|^\s*Loading (weights|checkpoint shards)"
    r"|^[IW]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ "  # torch's glog-style info and warning lines
)
# Quark's log records open with a colour code on a line of its own and end with a reset: INFO
# (green), WARNING (yellow) and DEBUG (blue) records go to the log whole; ERROR ones stay visible.
QUARK_RECORD_START = re.compile(r"^\x1b\[3[234]m\r?\n?$")
RECORD_END = "\x1b[0m"


class NoiseFilter:
    """A stand-in for sys.stdout / sys.stderr: noise lines go to the log file (opened only when
    the first one comes), everything else goes on to the real stream unchanged."""

    def __init__(self, real: TextIO, log_path: Path):
        self.real, self.log_path = real, log_path
        self._buf = ""
        self._log: TextIO | None = None
        self._in_record = False  # inside a multi-line Quark log record
        self._bar_open = False  # the last line routed was a progress bar without its newline
        self.closed_log = False

    def write(self, text: str) -> int:
        self._buf += text
        while (cut := _line_end(self._buf)) >= 0:
            line, self._buf = self._buf[: cut + 1], self._buf[cut + 1 :]
            self._route(line)
        return len(text)

    def flush(self) -> None:
        if self._buf:  # a prompt or a bar without its newline: route it as it is now
            line, self._buf = self._buf, ""
            self._route(line)
        self.real.flush()

    def _route(self, line: str) -> None:
        if line == "\r":  # a bar's carriage return: nothing for the terminal
            return
        if QUARK_RECORD_START.match(line):
            self._in_record = True
        # A bar is flushed mid-line; its closing newline comes alone afterwards and is the bar's too.
        noise = self._in_record or NOISE.search(line) or (self._bar_open and line == "\n")
        self._bar_open = bool(noise) and not line.endswith(("\n", "\r"))
        if RECORD_END in line:
            self._in_record = False
        if not noise or self.closed_log:
            self.real.write(line)
            return
        if self._log is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115
        text = line.replace("\r", "\n")
        self._log.write(text if text.endswith("\n") else text + "\n")  # a bar flushed mid-line: one line each
        self._log.flush()

    def close_log(self) -> None:
        self.flush()
        self.closed_log = True
        if self._log is not None:
            self._log.close()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding ... of the real stream
        return getattr(self.real, name)


def _line_end(text: str) -> int:
    ends = [i for i in (text.find("\n"), text.find("\r")) if i >= 0]
    return min(ends) if ends else -1


@contextlib.contextmanager
def noise_to_log(log_path: Path) -> Iterator[None]:
    """While a run works: third-party noise on stdout/stderr goes to ``log_path``."""
    filters = NoiseFilter(sys.stdout, log_path), NoiseFilter(sys.stderr, log_path)
    try:
        with streams_to(*filters):
            yield
    finally:
        for f in filters:
            f.close_log()


@contextlib.contextmanager
def streams_to(out: Any, err: Any) -> Iterator[None]:
    """Meanwhile sys.stdout / sys.stderr, and the logging handlers that write to them, are ``out`` / ``err``
    (noise_to_log's filters; the in-process engine's log, execute/in_process.py)."""
    saved = sys.stdout, sys.stderr
    # Libraries imported before hold the real streams in their logging handlers.
    swapped = swap_handler_streams({id(saved[0]): out, id(saved[1]): err})
    sys.stdout, sys.stderr = out, err
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        for handler, stream in swapped:
            handler.setStream(stream)
        # Handlers created inside (transformers makes its own on first use) hold ours: give them the
        # real streams, or a later run's filter would not recognise them.
        swap_handler_streams({id(out): saved[0], id(err): saved[1]})


def swap_handler_streams(streams: Mapping[int, TextSink]) -> list[tuple[logging.StreamHandler[Any], Any]]:
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    swapped = []
    for handler in {h for lg in loggers for h in lg.handlers}:
        target = streams.get(id(getattr(handler, "stream", None)))
        if target is not None and isinstance(handler, logging.StreamHandler):
            with contextlib.suppress(AttributeError):  # logging's last-resort handler: its stream is sys.stderr
                swapped.append((handler, handler.setStream(target)))
    return swapped
