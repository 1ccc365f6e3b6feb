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
importing it (reading the table stays cheap and free of import cycles).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Callable, Iterable, Iterator, Mapping
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


def defined_names(module: str) -> set[str] | None:
    """The names ``module`` binds at its top level (functions, classes, assignments, imports), read
    from its source without running it; None when it has no Python source to read (then only
    loading it can tell). A module that does not exist: :class:`InvalidEntry`."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise InvalidEntry(f"{module} does not exist")
    if not spec.origin or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names
