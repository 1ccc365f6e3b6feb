"""One source for options: each option's flag, type and help live on its dataclass field.

    scheme: str | None = field(default=None, metadata=flag("--scheme", help="exact Quark scheme name"))

``add_flags`` turns a dataclass's flagged fields into argparse arguments, ``given`` reads back the
ones the user actually gave (by field name, and the dataclass they build), so the CLI, the Python API
and ``docs/cli.md`` (generated from the parser) cannot drift apart. Every generated argument
defaults to ``None``: "not given" stays distinguishable from a default, which ``resume`` needs.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

_KEY = "cli"
_NESTED = "cli_nested"  # a field holding another dataclass whose fields carry flags (e.g. thresholds)
_CONCERN = "concern"  # the concern an option belongs to (see ``concern``)
_EXTENSIONS = "cli_extensions"  # a dict field holding the options of dataclasses declared elsewhere (see ``extensions``)


class DataclassInstance(Protocol):
    """Any dataclass (as typeshed's own protocol, which is no module at run time)."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


OptionsT = TypeVar("OptionsT", bound=DataclassInstance)  # an options dataclass whose fields declare their flags


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    help: str | Callable[[], str] | None = None
    dest: str | None = None  # argparse dest when the field name clashes with another command's option
    convert: Callable[[Any], Any] | None = None  # parsed value -> field value (e.g. "a,b" -> ["a", "b"])
    standalone_names: tuple[str, ...] = ()  # extra spellings where no clash exists (the `eval` command)
    standalone_only: bool = False  # only on the standalone command (its owner elsewhere adds it otherwise)
    argparse: dict[str, Any] = dataclasses.field(default_factory=dict)


def flag(*names: str, help: str | Callable[[], str] | None = None, dest: str | None = None,  # noqa: A002
         convert: Callable[[Any], Any] | None = None, standalone_names: tuple[str, ...] = (),
         standalone_only: bool = False, **argparse_kwargs: Any) -> dict[str, Flag]:
    """Field metadata declaring the field's command-line option (argparse keywords pass through)."""
    return {_KEY: Flag(names, help, dest, convert, standalone_names, standalone_only, argparse_kwargs)}


def nested(cls: type) -> dict[str, type]:
    """Field metadata: the field is a ``cls`` built from ``cls``'s own flags, added at this position."""
    return {_NESTED: cls}


def extensions(classes: Callable[[], Iterable[type]]) -> dict[str, Callable[[], Iterable[type]]]:
    """Field metadata: the field is a dict (field name -> value) of the options given of the dataclasses
    ``classes()`` returns (each field declaring its flag), added at this position: options that
    extensions declare themselves (an evaluation tier's own), read only when a parser is built."""
    return {_EXTENSIONS: classes}


def concern(name: str) -> dict[str, str]:
    """Field metadata naming the concern an option belongs to (merge it into ``flag(...)`` with ``|``):
    a command that takes only part of a dataclass selects its options by concern, never by a list of names."""
    return {_CONCERN: name}


@dataclass(frozen=True)
class Part:
    """The options of ``cls`` a command takes: those of the ``concerns`` given (all when None), less
    those of ``skip_concerns``."""

    cls: type
    concerns: tuple[str, ...] | None = None
    skip_concerns: tuple[str, ...] = ()

    def takes(self, field: dataclasses.Field[Any]) -> bool:
        owned = field.metadata.get(_CONCERN, "")
        return (self.concerns is None or owned in self.concerns) and owned not in self.skip_concerns

    def add_flags(self, group: argparse._ActionsContainer, *, standalone: bool = False) -> None:
        add_flags(group, self.cls, standalone=standalone, only=self.names())

    def given(self, args: argparse.Namespace) -> dict[str, Any]:
        return _given_values(self.cls, args, only=self.names())

    def names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.cls) if self.takes(f)]

    def values(self, options: Any) -> dict[str, Any]:
        """The taken fields' values of ``options`` (a ``cls``), as keywords for another ``cls``."""
        return {name: getattr(options, name) for name in self.names()}

    def dests(self) -> set[str]:
        """The argparse dests (also the Python API's keywords) of the flagged options taken."""
        wanted = set(self.names())
        return {flag_dest(f, spec) for f, spec in flagged_fields(self.cls) if f.name in wanted}


def flagged_fields(cls: type) -> list[tuple[dataclasses.Field[Any], Flag]]:
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def flag_dest(field: dataclasses.Field[Any], spec: Flag) -> str:
    return spec.dest or field.name


def add_flags(group: argparse._ActionsContainer, cls: type, *, standalone: bool = False,
              only: Iterable[str] | None = None, skip: Iterable[str] = ()) -> None:
    """Add ``cls``'s flagged fields to ``group`` in field order (``only``/``skip`` select by field name)."""
    wanted = set(only) if only is not None else None
    for field in dataclasses.fields(cls):
        if (wanted is not None and field.name not in wanted) or field.name in skip:
            continue
        if _NESTED in field.metadata:
            add_flags(group, field.metadata[_NESTED], standalone=standalone)
            continue
        for extension in field.metadata.get(_EXTENSIONS, list)():
            add_flags(group, extension, standalone=standalone)
        spec = field.metadata.get(_KEY)
        if spec is None or (spec.standalone_only and not standalone):
            continue
        kwargs = {k: v() if callable(v) and k == "choices" else v for k, v in spec.argparse.items()}
        kwargs.setdefault("default", None)
        if kwargs.get("action") in (None, "store", "append") and not {"metavar", "choices"} & kwargs.keys():
            kwargs["metavar"] = spec.names[0].lstrip("-").replace("-", "_").upper()  # the flag's, not the field's
        help_text = spec.help() if callable(spec.help) else spec.help
        names = spec.names + (spec.standalone_names if standalone else ())
        group.add_argument(*names, dest=flag_dest(field, spec), help=help_text, **kwargs)


@dataclass(frozen=True)
class Given(Generic[OptionsT]):
    """The options of one dataclass a command line gave: their values by field name (converted; every other
    field not given: "not given" is not "the default", which a `resume` needs) and the dataclass they build."""

    cls: type[OptionsT]
    values: Mapping[str, object]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.values)

    def build(self, **more: object) -> OptionsT:
        """``cls`` from the options given (and ``more``: fields no flag sets), the rest at their defaults."""
        return build(self.cls, {**self.values, **more})


def given(cls: type[OptionsT], args: argparse.Namespace, *, only: Iterable[str] | None = None) -> Given[OptionsT]:
    """The flagged fields of ``cls`` present in ``args`` and not None, converted to field values."""
    return Given(cls, _given_values(cls, args, only=only))


def _given_values(cls: type, args: argparse.Namespace, *, only: Iterable[str] | None = None) -> dict[str, Any]:
    wanted = set(only) if only is not None else None
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if wanted is not None and field.name not in wanted:
            continue
        if _NESTED in field.metadata:
            inner = _given_values(field.metadata[_NESTED], args)
            if inner:
                values[field.name] = field.metadata[_NESTED](**inner)
            continue
        extended = {k: v for cls_ in field.metadata.get(_EXTENSIONS, list)() for k, v in _given_values(cls_, args).items()}
        if extended:
            values[field.name] = extended
        spec = field.metadata.get(_KEY)
        if spec is None:
            continue
        value = getattr(args, flag_dest(field, spec), None)
        if value is not None:
            values[field.name] = spec.convert(value) if spec.convert else value
    return values


def build(cls: type[OptionsT], values: Mapping[str, object]) -> OptionsT:
    """``cls`` from field values; a dataclass-typed field given as a dict (as JSON stores it) is rebuilt."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    built = {}
    for name, value in values.items():
        inner = fields[name].metadata.get(_NESTED) if name in fields else None
        built[name] = build(inner, value) if inner is not None and isinstance(value, dict) else value
    return cls(**built)


def json_values(values: Mapping[str, object]) -> dict[str, object]:
    """Field values as JSON holds them (a state file): paths as absolute strings, dataclasses as dicts."""
    import os

    def plain(value: object) -> object:
        if isinstance(value, os.PathLike):
            return os.path.abspath(os.path.expanduser(os.fspath(value)))
        return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value

    return {k: plain(v) for k, v in values.items()}


def check_names(cls: type, names: Iterable[str], what: str) -> None:
    """Refuse keyword names ``cls`` has no field for (the API's typo guard: nothing is silently ignored)."""
    from quark_ptq_eval.base.errors import UsageError

    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise UsageError(f"Unknown {what} option(s) {', '.join(unknown)}: use {', '.join(sorted(known))}.")


OFFLINE_HELP = "Hugging Face offline mode for this run and every child process"


def add_offline_flag(group: argparse._ActionsContainer) -> None:
    """``--offline``: one spelling and one help for every command that could touch the Hub."""
    group.add_argument("--offline", action="store_true", default=None, help=OFFLINE_HELP)


OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def apply_offline(offline: bool | None) -> None:
    """Offline for this process and every child it starts (Hub, datasets, transformers)."""
    import os

    if offline:
        os.environ.update(OFFLINE_ENV)
        offline_if_imported()


def offline_if_imported() -> None:
    """The Hub libraries read their offline flag once, at import: where this process has them imported already (a
    command forked by the engine host, execute/engine_host.py), their flags are set too, as the import would have."""
    import sys

    for name, flags in (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
                        ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))):
        module = sys.modules.get(name)
        for flag_name in flags if module is not None else ():
            setattr(module, flag_name, True)
