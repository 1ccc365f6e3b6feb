"""``import quark.torch`` without re-reading all of transformers on every start.

At import, Quark 0.13 (``quark_experts``) AST-parses every ``modeling_*.py`` of the installed
transformers (about 450 files with transformers 5.x) to find the classes decorated with
``use_experts_implementation``: 20-40 s of every process that imports Quark (the engine, the
load check, the scan). The answer depends only on those files' text, so we remember it: while
Quark imports, ``ast.parse`` called *from that module* returns, for a source text seen before,
a module holding just its decorated classes (what Quark reads: ``body``, ``ClassDef.name``,
``decorator_list``). A text not seen before is parsed for real and remembered. The cache is
keyed by the text's hash, so an upgraded transformers is parsed again; nothing else is touched.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.fsio import cache_dir, write_json

SCANNER = "quark.torch.utils.llm.module_replacement.quark_experts"
DECORATOR = "use_experts_implementation"
CACHE_NAME = "quark-import-scan.json"


_SPENT = [0.0]  # seconds this process spent importing quark.torch, torch and transformers (a cold start)


def import_quark_torch(cache_file: Path | None = None) -> None:
    """``import quark.torch``, answering Quark's scan of transformers from the cache where it can."""
    if "quark.torch" in sys.modules:
        return
    started = time.monotonic()
    with remembered_scan(cache_file or cache_dir() / CACHE_NAME):
        import quark.torch  # noqa: F401
    _SPENT[0] += time.monotonic() - started


def import_torch_stack() -> None:
    """``import torch, transformers`` now, timed with quark.torch's import: a step that will import them anyway (the
    load check loads models) takes its cold start here, where it is measured."""
    if "transformers" in sys.modules and "torch" in sys.modules:
        return
    started = time.monotonic()
    import torch  # noqa: F401
    import transformers  # noqa: F401

    _SPENT[0] += time.monotonic() - started


def import_seconds() -> float:
    """What importing quark.torch, torch and transformers (through the two functions above) cost this process so
    far: a cold start, which a process that imported them already does not pay again."""
    return _SPENT[0]


@contextlib.contextmanager
def remembered_scan(cache_file: Path) -> Iterator[None]:
    known = _load(cache_file)
    seen = len(known)
    real_parse = ast.parse

    def parse(source: Any, *args: Any, **kwargs: Any) -> Any:  # the signature of ast.parse
        if sys._getframe(1).f_globals.get("__name__") != SCANNER or not isinstance(source, str) or args or kwargs:
            return real_parse(source, *args, **kwargs)
        key = hashlib.sha1(source.encode("utf-8", "surrogatepass")).hexdigest()
        if key not in known:
            known[key] = _decorated_classes(real_parse(source))
        return _module_of(known[key])

    ast.parse = parse
    try:
        yield
    finally:
        ast.parse = real_parse
        if len(known) != seen:
            _save(cache_file, known)


def _decorated_classes(tree: ast.Module) -> list[str]:
    return [node.name for node in tree.body if isinstance(node, ast.ClassDef) and any(
        (isinstance(d, ast.Name) and d.id == DECORATOR)
        or (isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == DECORATOR)
        for d in node.decorator_list)]


def _module_of(classes: list[str]) -> ast.Module:
    body: list[ast.stmt] = [_class_node(name) for name in classes]
    return ast.Module(body=body, type_ignores=[])


def _class_node(name: str) -> ast.ClassDef:
    node = ast.ClassDef(name=name, bases=[], keywords=[], body=[ast.Pass()],
                        decorator_list=[ast.Name(id=DECORATOR, ctx=ast.Load())])
    if sys.version_info >= (3, 12):
        node.type_params = []  # a field since Python 3.12
    return node


def _load(path: Path) -> dict[str, list[str]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    ok = isinstance(data, dict) and all(isinstance(v, list) for v in data.values())
    return data if ok else {}


def _save(path: Path, known: dict[str, list[str]]) -> None:
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, known)
