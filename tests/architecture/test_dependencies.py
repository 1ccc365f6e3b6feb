"""pyproject.toml declares every third-party package src/ imports directly (not left to arrive through
amd-quark or transformers), and the dev environment's pins (requirements-dev.txt) satisfy its ranges."""

from __future__ import annotations

import ast
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the dev environment's)

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "quark_ptq_eval"
# Imported, not declared, on purpose: torch (users bring the build of their accelerator, pyproject's comment) and
# vLLM (run by its own interpreter, --vllm-python, never imported into ours).
NOT_DECLARED = {"torch", "vllm"}


def _imported(root: Path) -> set[str]:
    """The top-level names of the absolute imports under ``root``, the standard library's and ours left out."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"quark_ptq_eval"}


def _declared() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    lines = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return {_norm(req.name): req for req in map(Requirement, lines)}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def _undeclared(imported: set[str], declared: set[str]) -> list[str]:
    """The imported names whose distribution pyproject.toml does not declare."""
    owners = metadata.packages_distributions()
    return sorted(m for m in imported - NOT_DECLARED
                  if not any(_norm(d) in declared for d in owners.get(m, [m])))


def test_every_package_src_imports_is_declared():
    imported = _imported(SRC)
    assert {"numpy", "scipy", "transformers"} <= imported  # the scan reads src/
    missing = _undeclared(imported, set(_declared()))
    assert missing == [], f"declare these in pyproject.toml (imported by src/): {missing}"
    assert _undeclared({"numpy", "yaml"}, {"pyyaml"}) == ["numpy"]  # the rule fails on a planted undeclared import


def test_the_dev_pins_satisfy_the_declared_ranges():
    pins = {}
    for line in (ROOT / "requirements-dev.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            req = Requirement(line)
            pins[_norm(req.name)] = next(iter(req.specifier)).version
    for name, req in _declared().items():
        version = pins.get(name) or metadata.version(name)  # not pinned (numpy, scipy): the installed one
        assert req.specifier.contains(version, prereleases=True), f"{name} {version} is outside {req}"
