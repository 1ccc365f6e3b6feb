"""One generic registry for every extension point: engines, tiers, checks, source formats, targets.

A registry maps names to typed entries (frozen dataclasses with a ``name``), in registration
order (the order the recipe tries or runs them). Registering a taken name raises
:class:`DuplicateEntry`; looking up an unknown one raises :class:`UnknownEntry`, a
:class:`UsageError` that lists the known names. An entry may name the module that implements it
(``"package.module"`` or ``"package.module:attr"``): :func:`load` imports it only when it is used,
so reading a table (the CLI's choices, the plan schema's enum) stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

from quark_ptq_eval.base.errors import DuplicateEntry, UnknownEntry


class Named(Protocol):
    @property
    def name(self) -> str: ...


E = TypeVar("E", bound=Named)


class Registry(Mapping[str, E]):
    """Name -> entry, in registration order; ``kind`` names the rows in errors ("evaluation tier")."""

    def __init__(self, kind: str, entries: Iterable[E] = ()) -> None:
        self.kind = kind
        self._entries: dict[str, E] = {}
        for entry in entries:
            self.register(entry)

    def register(self, entry: E, *, before: str | None = None) -> E:
        """Add ``entry`` (at the end, or just before the entry named ``before``) and return it."""
        if entry.name in self._entries:
            raise DuplicateEntry(f"Two {self.kind} entries are named {entry.name!r}: rename the new one.")
        if before is None:
            self._entries[entry.name] = entry
            return entry
        self[before]  # an unknown anchor is refused with the known names
        items = list(self._entries.items())
        at = next(i for i, (name, _) in enumerate(items) if name == before)
        self._entries = dict([*items[:at], (entry.name, entry), *items[at:]])
        return entry

    def __getitem__(self, name: str) -> E:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownEntry(f"Unknown {self.kind} {name!r}.", f"Choose one of: {', '.join(self)}.") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self)})"

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def where(self, predicate: Callable[[E], bool]) -> list[E]:
        """The entries a property selects, in order (the structural checks, the tiers that run)."""
        return [e for e in self._entries.values() if predicate(e)]


def load(ref: str) -> Any:
    """The object ``"package.module:attr"`` names (or the module of ``"package.module"``), imported now."""
    module, _, attr = ref.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attr) if attr else loaded
