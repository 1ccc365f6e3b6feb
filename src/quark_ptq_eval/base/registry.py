"""One generic registry for every extension point: engines, tiers, checks, source formats, targets.

A registry maps names to typed entries (frozen dataclasses with a ``name``), in registration
order (the order the recipe tries or runs them). Registering a taken name raises
:class:`DuplicateEntry`; looking up an unknown one raises :class:`UnknownEntry`, a
:class:`UsageError` that lists the known names. An entry may name the module that implements it
(``"package.module"`` or ``"package.module:attr"``): :func:`load` imports it only when it is used,
so reading a table (the CLI's choices, the plan schema's enum) stays cheap.

Like lm-evaluation-harness's registry, which checks each model class against its base class when
it is registered, a registry may be given the type its entries must have and a ``check`` that
refuses an entry lacking its contract: :class:`InvalidEntry`, raised by ``register``, before the
entry is added. :func:`defined_names` lets such a check see what a named module defines without
importing it (from its bytecode: reading the table stays cheap and free of import cycles).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import CodeType
from typing import Any, Protocol, TypeVar

from quark_ptq_eval.base.errors import DuplicateEntry, QpeError, UnknownEntry


class InvalidEntry(QpeError):
    """A row that lacks its contract (a tier without ``run``, a report section that is not there):
    refused when it is registered, naming what is missing."""


class Named(Protocol):
    @property
    def name(self) -> str: ...


E = TypeVar("E", bound=Named)


class Registry(Mapping[str, E]):
    """Name -> entry, in registration order; ``kind`` names the rows in errors ("evaluation tier")."""

    def __init__(self, kind: str, entries: Iterable[E] = (), *, entry_type: type | None = None,
                 check: Callable[[E], None] | None = None) -> None:
        """``entry_type``: the class every entry must be an instance of; ``check``: raises
        :class:`InvalidEntry` (what is missing, what to add) for an entry that lacks its contract."""
        self.kind = kind
        self._entry_type, self._check = entry_type, check
        self._entries: dict[str, E] = {}
        for entry in entries:
            self.register(entry)

    def register(self, entry: E, *, before: str | None = None) -> E:
        """Add ``entry`` (at the end, or just before the entry named ``before``) and return it."""
        if self._entry_type is not None and not isinstance(entry, self._entry_type):
            raise InvalidEntry(f"A {self.kind} entry must be a {self._entry_type.__name__}, not "
                               f"{type(entry).__name__}: {entry!r}.")
        if self._check is not None:
            self._check(entry)
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


def split_ref(ref: str) -> tuple[str, str]:
    """``"package.module:attr"`` -> (module, attr); attr is "" for a module."""
    module, _, attr = ref.partition(":")
    return module, attr


# (source file, its mtime) -> the names it binds: a tier's module and its report section are read once
_NAMES: dict[tuple[str, int], frozenset[str]] = {}


def defined_names(module: str) -> set[str] | None:
    """The names ``module``'s top-level code binds (functions, classes, assignments, imports, also
    under a top-level ``if``/``try``), read without running it; None when it has no Python source to
    read (then only loading it can tell). A module that does not exist: :class:`InvalidEntry`.

    The code comes from the module's loader: importlib's bytecode cache (``__pycache__``) when it
    matches the source, else the source compiled, which is what happens without one
    (``PYTHONDONTWRITEBYTECODE``, a fresh checkout).
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise InvalidEntry(f"{module} does not exist")
    get_code: Callable[[str], CodeType | None] | None = getattr(spec.loader, "get_code", None)
    if not spec.origin or not spec.origin.endswith(".py") or get_code is None:
        return None
    key = (spec.origin, os.stat(spec.origin).st_mtime_ns)
    if key not in _NAMES:
        code = get_code(module)
        _NAMES[key] = frozenset(_stored_names(code) if code is not None else ())
    return set(_NAMES[key])


def _stored_names(code: CodeType) -> set[str]:
    """What a module's code stores by name: every def, class, import and assignment it can run."""
    import dis  # already imported with dataclasses (through inspect): no cost here

    return {i.argval for i in dis.get_instructions(code) if i.opname in ("STORE_NAME", "STORE_GLOBAL")} - {"__doc__"}
