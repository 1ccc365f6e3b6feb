"""The scan behind test_types.py's seam test: every function of one package of src/ that another package
uses (imports it by name, or reaches it as ``module.function``), and which of its parameters or its return
carry a ``dict[str, Any]``: what crosses a package boundary says what it holds (a dataclass, a TypedDict,
a named alias), so the caller's and the callee's reading of it cannot drift apart unseen.

``scan(sources)`` works on source text (module name -> source), so a test can feed it a planted module;
``src_sources()`` reads the real tree. Pure AST: nothing is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT_PACKAGE = "quark_ptq_eval"
SRC = Path(__file__).resolve().parents[2] / "src" / ROOT_PACKAGE
Function = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True, order=True)
class Seam:
    """``function`` (defined in ``module``) used from ``caller``, another package, with ``part`` (a
    parameter's name, or "return") typed as a ``dict[str, Any]``."""

    module: str
    function: str
    part: str
    caller: str

    def __str__(self) -> str:
        return f"{self.module}.{self.function} ({self.part}), used from {self.caller}"


def src_sources(src: Path = SRC) -> dict[str, str]:
    """Module name -> source of every module under ``src`` (a package's ``__init__`` named as the package)."""
    sources = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        sources[name] = path.read_text(encoding="utf-8")
    return sources


def package_of(module: str) -> str:
    """The top-level package of src/ a module belongs to (``flows.compare.x`` is ``flows``'s)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""  # "": the root's __init__ (the public API's re-exports)


def annotation_expr(annotation: ast.expr | None) -> ast.expr | None:
    """The annotation as an expression, a string annotation (``'Path | None'``) parsed."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return ast.parse(annotation.value, mode="eval").body
    return annotation


def any_dict(annotation: ast.expr | None) -> bool:
    """A ``dict[str, Any]`` (``Dict``, ``Mapping``, ``MutableMapping`` too) anywhere in ``annotation``."""
    annotation = annotation_expr(annotation)
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if not isinstance(node, ast.Subscript) or _name(node.value) not in ("dict", "Dict", "Mapping", "MutableMapping"):
            continue
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if len(args) == 2 and _name(args[1]) == "Any":
            return True
    return False


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def any_dict_parts(function: Function) -> list[str]:
    """The parameters (and "return") of ``function`` typed as a ``dict[str, Any]``."""
    a = function.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []), *([a.kwarg] if a.kwarg else [])]
    return [p.arg for p in params if any_dict(p.annotation)] + (["return"] if any_dict(function.returns) else [])


class _Tree:
    """The parsed modules: their functions, their imports, and where a name they export is defined."""

    def __init__(self, sources: dict[str, str]):
        self.trees = {name: ast.parse(text) for name, text in sources.items()}
        self.functions = {name: {n.name: n for n in tree.body if isinstance(n, Function)}
                          for name, tree in self.trees.items()}
        self.reexports = {name: self._module_imports(tree) for name, tree in self.trees.items()}

    def _module_imports(self, tree: ast.Module) -> dict[str, tuple[str, str]]:
        """Module-level ``from M import n as a``: a -> (M, n)."""
        return {(a.asname or a.name): (_absolute(n.module, n.level, ""), a.name) for n in tree.body
                if isinstance(n, ast.ImportFrom) and n.module for a in n.names}

    def resolve(self, module: str, name: str, seen: frozenset[str] = frozenset()) -> tuple[str, Function] | None:
        """Where ``name`` read from ``module`` is defined as a function (following re-exports)."""
        if module in seen or module not in self.trees:
            return None
        if name in self.functions[module]:
            return module, self.functions[module][name]
        if f"{module}.{name}" in self.trees:
            return None  # a submodule, not a function
        source = self.reexports[module].get(name)
        return self.resolve(source[0], source[1], seen | {module}) if source else None

    def uses(self, module: str) -> Iterator[tuple[str, str]]:
        """(module, name) of every function of src/ that ``module`` imports by name or reaches as
        ``alias.name`` through an imported module (at module level or inside a function)."""
        modules: dict[str, str] = {}  # alias -> module of src/
        for node in ast.walk(self.trees[module]):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                source = _absolute(node.module, node.level, module)
                for alias in node.names:
                    if f"{source}.{alias.name}" in self.trees:
                        modules[alias.asname or alias.name] = f"{source}.{alias.name}"
                    else:
                        yield source, alias.name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in self.trees and alias.asname:
                        modules[alias.asname] = alias.name
        for node in ast.walk(self.trees[module]):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                yield modules[node.value.id], node.attr


def _absolute(module: str, level: int, importer: str) -> str:
    if not level:
        return module
    base = importer.split(".")[: -level]
    return ".".join([*base, module] if module else base)


def scan(sources: dict[str, str]) -> list[Seam]:
    """Every cross-package use of a function whose signature carries a ``dict[str, Any]``."""
    tree = _Tree(sources)
    found = set()
    for caller in tree.trees:
        for module, name in tree.uses(caller):
            if not module.startswith(ROOT_PACKAGE):
                continue
            where = tree.resolve(module, name)
            if where is None or package_of(where[0]) == package_of(caller):
                continue
            found |= {Seam(where[0], name, part, caller) for part in any_dict_parts(where[1])}
    return sorted(found)


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if _name(target) == "dataclass":
            return True
    return False


def dict_fields(sources: dict[str, str]) -> list[tuple[str, str, str]]:
    """(module, class, field) of every dataclass field in ``sources`` annotated with a ``dict[str, Any]``
    (the records a dataclass carries, where they stay open)."""
    found = []
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and _is_dataclass(node):
                found += [(module, node.name, st.target.id) for st in node.body if isinstance(st, ast.AnnAssign)
                          and isinstance(st.target, ast.Name) and any_dict(st.annotation)]
    return sorted(found)
