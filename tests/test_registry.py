"""The generic registry (base/registry.py) and what rests on it: its errors, no registry name written
outside its entry, and docs/extending.md's "one module plus one row" done for real in a copy of
the package (a dummy engine, tier, check and source format run through the recipe)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from quark_ptq_eval.base.errors import DuplicateEntry, UnknownEntry, UsageError
from quark_ptq_eval.base.registry import Registry, load

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "quark_ptq_eval"


@dataclass(frozen=True)
class Row:
    name: str
    value: int = 0


# ---- the generic registry -------------------------------------------------------------------------
def test_registry_keeps_order_and_refuses_unknown_names_and_collisions():
    rows = Registry("widget", (Row("a", 1), Row("b", 2)))
    assert list(rows) == ["a", "b"] and rows["b"].value == 2 and len(rows) == 2 and "a" in rows
    rows.register(Row("c", 3), before="b")
    assert rows.names() == ("a", "c", "b")
    assert [r.name for r in rows.where(lambda r: r.value > 1)] == ["c", "b"]
    assert rows.get("zz") is None  # Mapping.get: an unknown name is a KeyError underneath
    with pytest.raises(UnknownEntry) as unknown:
        rows["zz"]
    assert isinstance(unknown.value, UsageError) and isinstance(unknown.value, KeyError)
    assert str(unknown.value) == "Unknown widget 'zz'. Choose one of: a, c, b."
    with pytest.raises(DuplicateEntry, match="Two widget entries are named 'a': rename the new one."):
        rows.register(Row("a"))
    with pytest.raises(UnknownEntry, match="Unknown widget 'nope'"):
        rows.register(Row("d"), before="nope")
    assert rows.names() == ("a", "c", "b")  # a refused registration changes nothing
    assert load("quark_ptq_eval.base.registry:Registry") is Registry
    assert load("quark_ptq_eval.base.registry").Registry is Registry


def test_every_extension_point_is_a_registry_with_the_same_errors():
    from quark_ptq_eval.evaluate.tiers import TIERS
    from quark_ptq_eval.execute.engines import ENGINES
    from quark_ptq_eval.intake.formats import FORMATS
    from quark_ptq_eval.plan.targets import TARGETS, resolve_target
    from quark_ptq_eval.validate.checks import CHECKS

    for registry in (ENGINES, TIERS, CHECKS, FORMATS, TARGETS):
        assert isinstance(registry, Registry)
        with pytest.raises(UnknownEntry, match=f"Unknown {registry.kind} 'no-such'. Choose one of: "
                                               f"{', '.join(registry)}."):
            registry["no-such"]
    with pytest.raises(UnknownEntry, match="Unknown deployment target 'tpu-v5'"):
        resolve_target("tpu-v5", "")


# ---- no registry name outside its entry -------------------------------------------------------------
# Names that are also words of another vocabulary: the scan flags them only where code reads them
# as that registry's name (compared with, subscripted on, passed as or called with something that
# says engine / tier / check / format / target). Everywhere else they mean the other thing.
HOMONYMS = {
    "quark": "Quark itself: a finding's side, quant_method 'quark', the package",
    "cpu": "the torch device and the accelerator kind, apart from the CPU deployment target",
    "mxfp4": "the weight format family (schemes, decode formats), apart from the MXFP4 source format",
    "int4": "the weight format family (schemes, load limits), apart from the 4-bit source format",
    "vllm": "the vLLM package and program (find_spec, `vllm serve`), apart from the Tier 3 name",
    "lm_eval": "the lm-eval package (its version, logger, `-m lm_eval`), apart from the Tier 2 name",
    "quark-cli": "Quark's program (found on PATH, probed by preflight, pasted to `import`), apart from the engine",
    "calibration": "the plan's calibration section, apart from the calibration check",
    "load": "loading (a failing frame's phase, a probe), apart from the load check",
    "config": "config.json and its keys, apart from the config check",
    "serve": "vLLM's `serve` subcommand, apart from the serving check",
}
KIND_WORDS = {"engine": ("engine",), "tier": ("tier",), "check": ("check",),
              "format": ("source_format", "formats", "fmt", "'format'"), "target": ("target",)}


def _registered() -> dict[str, list[tuple[str, set[str]]]]:
    """name -> [(kind, modules that own it)] for every row of the five registries."""
    from quark_ptq_eval.base.registry import load as load_ref
    from quark_ptq_eval.evaluate.tiers import TIERS
    from quark_ptq_eval.execute.engines import ENGINES
    from quark_ptq_eval.intake.formats import FORMATS
    from quark_ptq_eval.plan.targets import TARGETS
    from quark_ptq_eval.validate.checks import CHECKS

    rows: dict[str, list[tuple[str, set[str]]]] = {}
    for e in ENGINES.values():
        child = getattr(load_ref(e.module), "CHILD_MODULE", e.module)  # the engine's own child entry point
        rows.setdefault(e.name, []).append(("engine", {e.module, child}))
    for t in TIERS.values():
        rows.setdefault(t.name, []).append(("tier", {t.module} if t.module else set()))
    for c in CHECKS.values():
        rows.setdefault(c.name, []).append(("check", {c.implemented_in, c.run.__module__}))
    for f in FORMATS.values():
        rows.setdefault(f.name, []).append(("format", {f.detector.partition(":")[0]}))
    for g in TARGETS.values():
        rows.setdefault(g.name, []).append(("target", set()))
    return rows


# The tables themselves: the rows and the code that reads them by row (not by name).
TABLES = {"quark_ptq_eval.execute.engines", "quark_ptq_eval.evaluate.tiers", "quark_ptq_eval.validate.checks",
          "quark_ptq_eval.intake.formats", "quark_ptq_eval.plan.targets"}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _contexts(tree: ast.AST) -> dict[int, str]:
    """id(constant) -> the source text around it that says what it is read as."""
    around: dict[int, str] = {}

    def mark(node: ast.AST, text: str) -> None:  # the constant itself, or the members of a literal tuple/list/set
        for sub in node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]:
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                around[id(sub)] = around.get(id(sub), "") + " " + text.lower()

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                mark(side, " ".join(ast.unparse(s) for s in (node.left, *node.comparators) if s is not side))
        elif isinstance(node, ast.Subscript):
            mark(node.slice, ast.unparse(node.value))
        elif isinstance(node, ast.Call):
            for arg in node.args:
                mark(arg, ast.unparse(node.func))
            for kw in node.keywords:
                mark(kw.value, f"{ast.unparse(node.func)} {kw.arg or ''}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            mark(node.value, " ".join(ast.unparse(t) for t in targets))
    return around


def registry_names_outside_their_entries(root: Path) -> list[str]:
    rows = _registered()
    found = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        if module in TABLES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        around = _contexts(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in rows):
                continue
            for kind, owners in rows[node.value]:
                if module in owners:
                    continue
                if node.value in HOMONYMS and not any(w in around.get(id(node), "") for w in KIND_WORDS[kind]):
                    continue
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {kind} {node.value!r}")
    return found


def test_no_registry_name_is_written_outside_its_entry_and_the_tables():
    assert registry_names_outside_their_entries(PACKAGE) == []


def test_the_name_scan_finds_a_name_planted_outside_its_entry(tmp_path):
    planted = tmp_path / "quark_ptq_eval"
    (planted / "flows").mkdir(parents=True)
    (planted / "flows" / "leak.py").write_text(
        'def pick(tier: str, device: str, engine: str) -> bool:\n'
        '    return tier == "ppl" or device == "cpu" or engine in ("file2file",) or {"x": 1}.get("md5") is None\n'
        'def vllm_tier(opts) -> bool:\n'
        '    return opts.eval_tier == "vllm"\n', encoding="utf-8")
    found = registry_names_outside_their_entries(planted)
    assert sorted(f.split(": ", 1)[1] for f in found) == ["check 'md5'", "engine 'file2file'", "tier 'ppl'",
                                                          "tier 'vllm'"]  # device == "cpu" is not the target
