"""The recipe a newcomer can follow: every step of `run` is a direct call reached from `Recipe.run`
(no step looked up by name), and the steps' signatures are typed: no `dict[str, Any]`, bare `dict`
or `Any` in a step function's signature, nor in the public functions of other packages they call.
Cheap: an AST scan of the sources, nothing runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from quark_ptq_eval.base.step_table import STEP_NAMES, STEPS

SRC = Path(__file__).resolve().parents[2] / "src" / "quark_ptq_eval"
FLOWS = SRC / "flows"
PIPELINE = FLOWS / "recipe" / "pipeline.py"
# Called by every step (or by the flow helpers the steps call) across a package boundary: scanned
# even if a refactoring stopped calling one of them directly.
NAMED_CALLEES = ("execute_manifest", "make_plan", "build_manifest", "validate_model", "evaluate")


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _module_file(module: str) -> Path:
    relative = Path(*module.split(".")[1:])
    package = SRC / relative / "__init__.py"
    return package if package.exists() else (SRC / relative).with_suffix(".py")


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _imports(tree: ast.AST) -> dict[str, str]:
    """Name -> the module it is imported from (module level and inside functions)."""
    return {(a.asname or a.name): n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
            for a in n.names}


def _definition(name: str, module: str, seen: frozenset[str] = frozenset()) -> tuple[str, ast.FunctionDef] | None:
    """Where ``name`` imported from ``module`` is defined (following a package's re-exports)."""
    path = _module_file(module)
    if not path.exists() or module in seen:
        return None
    tree = _parse(path)
    if name in _functions(tree):
        return module, _functions(tree)[name]
    source = _imports(tree).get(name)
    return _definition(name, source, seen | {module}) if source and source.startswith("quark_ptq_eval") else None


def _recipe_methods(tree: ast.Module | None = None) -> dict[str, ast.FunctionDef]:
    recipe = next(n for n in (tree or _parse(PIPELINE)).body if isinstance(n, ast.ClassDef) and n.name == "Recipe")
    return {n.name: n for n in recipe.body if isinstance(n, ast.FunctionDef)}


def _reached_from_run(methods: dict[str, ast.FunctionDef]) -> set[str]:
    """The Recipe methods `run` reaches by direct calls ``self.method(...)``."""
    reached, todo = set(), ["run"]
    while todo:
        name = todo.pop()
        if name in reached or name not in methods:
            continue
        reached.add(name)
        todo += [c.func.attr for c in ast.walk(methods[name]) if isinstance(c, ast.Call)
                 and isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name) and c.func.value.id == "self"]
    return reached


def step_calls(method: ast.FunctionDef) -> list[tuple[str, str]]:
    """(step name, the function called) for each ``self._step("name", ..., lambda: function(...))``, in order."""
    calls = []
    for node in ast.walk(method):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_step":
            name, perform = node.args[0], node.args[-1]
            assert isinstance(name, ast.Constant), ast.unparse(node)
            body = perform.body if isinstance(perform, ast.Lambda) else None
            assert isinstance(body, ast.Call) and isinstance(body.func, ast.Name), \
                f"step {name.value!r} is not a direct call of a function: {ast.unparse(perform)}"
            calls.append((node.lineno, name.value, body.func.id))
    return [(name, function) for _, name, function in sorted(calls)]


def step_functions() -> dict[str, tuple[str, ast.FunctionDef]]:
    """Step name -> (module, definition) of the function `Recipe.run` calls for it."""
    imports = _imports(_parse(PIPELINE))
    found = {}
    for step, function in step_calls(_recipe_methods()["_steps"]):
        where = _definition(function, imports.get(function, ""))
        assert where is not None, f"step {step!r} calls {function}, which is no function of quark_ptq_eval"
        found[step] = where
    return found


def test_every_step_of_run_is_a_direct_call_reached_from_recipe_run():
    methods = _recipe_methods()
    assert "_steps" in _reached_from_run(methods)
    calls = step_calls(methods["_steps"])
    assert [name for name, _ in calls] == list(STEP_NAMES)  # every row of the table has its call, in order
    functions = step_functions()
    assert all(module.startswith("quark_ptq_eval.flows.") for module, _ in functions.values())  # they live with the flow
    assert len({f for _, f in calls}) == len(calls)  # one function per step


def _getattr_on_steps(tree: ast.AST, step_words: set[str]) -> list[str]:
    """``getattr`` that looks a step up by name: an attribute of a step row, a step's name or
    function name, or any name computed at run time (the recipe modules look nothing up)."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"):
            continue
        what = node.args[1] if len(node.args) > 1 else None
        from_row = isinstance(what, ast.Attribute) and (what.attr in ("run", "part", "title") or what.attr == "name"
                                                         and ast.unparse(what.value) in ("step", "row"))
        named = isinstance(what, ast.Constant) and (what.value in step_words or str(what.value).startswith("step_"))
        if from_row or named:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_step_is_looked_up_by_name_in_the_flows():
    words = set(STEP_NAMES) | {f for _, f in step_calls(_recipe_methods()["_steps"])}
    recipe_modules = {module for module, _ in step_functions().values()} | {
        "quark_ptq_eval.flows.recipe.pipeline", "quark_ptq_eval.flows.recipe.recipe_flow", "quark_ptq_eval.flows.recipe.run_options"}
    wrong = []
    for path in sorted(FLOWS.rglob("*.py")):
        tree = _parse(path)
        wrong += [f"{path.relative_to(SRC)}: {w}" for w in _getattr_on_steps(tree, words)]
        module = "quark_ptq_eval." + ".".join(path.relative_to(SRC).with_suffix("").parts)
        if module in recipe_modules:  # nothing computed at run time is looked up in the recipe itself
            wrong += [f"{path.relative_to(SRC)}: line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree)
                      if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr"
                      and not isinstance(n.args[1], ast.Constant)]
    assert wrong == [], "steps looked up by name:\n" + "\n".join(wrong)
    # and the step table names no function: its rows are metadata, the calls are in Recipe._steps
    assert not {v for s in STEPS for v in vars(s).values() if isinstance(v, str)} & words - set(STEP_NAMES)


def untyped(annotation: ast.expr | None) -> bool:
    """``Any`` anywhere, or a bare ``dict`` / ``Dict`` (a ``dict[str, Any]`` has its ``Any``)."""
    from tests.architecture.seams import annotation_expr

    annotation = annotation_expr(annotation)
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Any" or isinstance(node, ast.Attribute) and node.attr == "Any":
            return True
    bare = [n for n in ast.walk(annotation) if isinstance(n, ast.Name) and n.id in ("dict", "Dict")]
    subscripted = [n.value for n in ast.walk(annotation) if isinstance(n, ast.Subscript)]
    return any(all(b is not s for s in subscripted) for b in bare)


def untyped_signature(function: ast.FunctionDef) -> list[str]:
    """The parameters (and "return") of ``function`` that carry an untyped dict or ``Any``."""
    a = function.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []), *([a.kwarg] if a.kwarg else [])]
    found = [p.arg for p in params if untyped(p.annotation)]
    return found + (["return"] if untyped(function.returns) else [])


def test_the_scan_sees_an_untyped_signature():
    bad = _functions(ast.parse("def f(a: dict, b: dict[str, Any], c: int) -> Any: ...\n"
                               "def g(a: dict[str, int], *, b: 'Path | None') -> list[str]: ...\n"
                               "def h(a: JsonValue, b: HostEnv, **c: Unpack[ValidateKeywords]) -> PlanJson: ..."))
    assert untyped_signature(bad["f"]) == ["a", "b", "return"] and untyped_signature(bad["g"]) == []
    assert untyped_signature(bad["h"]) == []  # a named type (an alias, a TypedDict) says what it holds


def _calls_across_packages(module: str, function: ast.FunctionDef, seen: set[str]) -> set[tuple[str, str]]:
    """(module, name) of the functions of other packages that ``function`` calls, directly or
    through the flow's own helpers (followed within flows/)."""
    tree = _parse(_module_file(module))
    imports, local = {**_imports(tree), **_imports(function)}, _functions(tree)
    found: set[tuple[str, str]] = set()
    for call in (n for n in ast.walk(function) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
        name = call.func.id
        if name in local and f"{module}.{name}" not in seen:
            seen.add(f"{module}.{name}")
            found |= _calls_across_packages(module, local[name], seen)
        elif imports.get(name, "").startswith("quark_ptq_eval.flows."):
            where = _definition(name, imports[name])
            if where is not None and f"{where[0]}.{name}" not in seen:
                seen.add(f"{where[0]}.{name}")
                found |= _calls_across_packages(where[0], where[1], seen)
        elif imports.get(name, "").startswith("quark_ptq_eval."):
            found.add((imports[name], name))
    return found


def test_no_untyped_dict_crosses_a_package_boundary_in_the_steps_signatures():
    functions = step_functions()
    for step, (module, function) in functions.items():
        assert untyped_signature(function) == [], f"step {step} ({module}.{function.name})"
    callees: set[tuple[str, str]] = set()
    for module, function in functions.values():
        callees |= _calls_across_packages(module, function, set())
    assert set(NAMED_CALLEES) <= {name for _, name in callees}
    from tests.architecture.test_types import KNOWN_UNTYPED  # the one list of seams left open, with reasons

    found = set()
    for module, name in sorted(callees):
        where = _definition(name, module)
        if where is not None and (where[0].removeprefix("quark_ptq_eval."), name) not in KNOWN_UNTYPED:
            found |= {(name, part) for part in untyped_signature(where[1])}  # a class is typed by its own fields
    assert found == set(), "untyped across a package boundary"


@pytest.mark.parametrize("broken", ["getattr", "dict"])
def test_the_scans_fail_on_a_step_looked_up_by_name_or_an_untyped_step(broken):
    """The two scans above on a recipe that reintroduces what they forbid."""
    source = PIPELINE.read_text(encoding="utf-8")
    if broken == "getattr":
        tree = ast.parse(source.replace("lambda: intake_step(flow)", 'lambda: getattr(self, "intake_step")(flow)'))
        with pytest.raises(AssertionError, match="not a direct call"):
            step_calls(_recipe_methods(tree)["_steps"])
        assert _getattr_on_steps(tree, {"intake_step"})
    else:
        module, function = step_functions()["plan"]
        text = ast.unparse(function).replace("analysis: ModelAnalysis", "analysis: dict[str, Any]")
        assert untyped_signature(_functions(ast.parse(text))[function.name]) == ["analysis"]
