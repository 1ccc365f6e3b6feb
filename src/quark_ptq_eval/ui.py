"""Everything the user reads goes to stderr (stdout is kept for --json); rich on a terminal,
plain text elsewhere."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


class Reporter:
    def __init__(self, quiet: bool = False, stream=None):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.rich = self.stream.isatty() and not quiet
        if self.rich:
            from rich.console import Console

            self._console = Console(file=self.stream)

    def info(self, msg: str) -> None:
        if not self.quiet:
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
