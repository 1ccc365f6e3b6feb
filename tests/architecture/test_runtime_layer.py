"""The runtime layer and the engines' source formats (issue 32): validate/ and evaluate/ share loading
an export and starting vLLM through runtime/, not through each other; a source-format row says what
the format is, and an engine says which formats it reads itself. Cheap: nothing here runs Quark."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from quark_ptq_eval.intake.formats import FORMATS, SourceFormat
from quark_ptq_eval.plan.engines import ENGINES, SourceRead

SRC = Path(__file__).resolve().parents[2] / "src" / "quark_ptq_eval"


def _imported_modules(package: str) -> set[tuple[str, str]]:
    """(file, imported module) for every absolute import of our package in ``package``'s files."""
    found = set()
    for f in (SRC / package).rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add((f.name, node.module))
            elif isinstance(node, ast.Import):
                found.update((f.name, a.name) for a in node.names)
    return found


def test_evaluate_uses_no_validate_module_as_a_service():
    reaching = sorted(f"{f}: {m}" for f, m in _imported_modules("evaluate")
                      if m.startswith("quark_ptq_eval.validate"))
    assert reaching == []


def test_loading_and_vllm_live_in_runtime_only():
    for name in ("loading", "vllm_host", "vllm_sizing"):
        assert (SRC / "runtime" / f"{name}.py").is_file()
        assert not (SRC / "validate" / f"{name}.py").exists()  # moved, no shim left behind


def test_format_rows_carry_no_engine_field():
    engine_words = {n.replace("-", "_") for n in ENGINES} | {"file2file"}
    fields = [f.name for f in dataclasses.fields(SourceFormat)]
    assert not [f for f in fields if any(word in f for word in engine_words)], fields


def test_engines_declare_only_known_formats_and_file2file_reads_fp8_on_a_gpu():
    for entry in ENGINES.values():
        assert set(entry.reads_sources) <= set(FORMATS), entry.name
        assert all(isinstance(read, SourceRead) and read.note for read in entry.reads_sources.values())
    reads = ENGINES["file2file"].reads_sources
    assert reads["fp8_block"].gpu_only and reads["fp8_tensor"].gpu_only and not reads["mxfp4"].reads
    assert not ENGINES["quark-api"].reads_sources and not ENGINES["quark-cli"].reads_sources
