"""Quark's import-time scan of transformers, answered from our cache, finds the same classes.

The scanner below does what Quark 0.13's ``quark_experts`` does at import (parse each modeling
file, keep the classes decorated with ``use_experts_implementation``), run from a module of the
same name, over real transformers files. The end-to-end guard is the MoE family test: its experts
are quantized by an engine that imported Quark through this cache.
"""

from __future__ import annotations

import ast
from pathlib import Path

import transformers

from quark_ptq_eval.base.quark_import import DECORATOR, SCANNER, remembered_scan

SCAN_CODE = '''
import ast
def scan(files):
    found = []
    for path in files:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(d, ast.Name) and d.id == DECORATOR
                    or isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == DECORATOR
                    for d in node.decorator_list):
                found.append((path.name, node.name))
    return found
'''


def _scanner():
    scope = {"__name__": SCANNER, "DECORATOR": DECORATOR}
    exec(compile(SCAN_CODE, "<quark_experts stand-in>", "exec"), scope)  # noqa: S102
    return scope["scan"]


def test_cached_scan_finds_exactly_the_classes_the_real_parse_finds(tmp_path):
    models = Path(transformers.__file__).parent / "models"
    files = sorted(models.rglob("modeling_*.py"))
    decorated = [f for f in files if DECORATOR in f.read_text(encoding="utf-8")]
    sample = decorated[:6] + files[:30]
    assert len(decorated) >= 3, "this transformers has no decorated expert classes to find"
    scan, cache = _scanner(), tmp_path / "scan.json"

    truth = scan(sample)
    with remembered_scan(cache):
        first = scan(sample)  # parsed for real, remembered
    with remembered_scan(cache):
        again = scan(sample)  # answered from the cache
    assert truth and first == truth and again == truth
    assert cache.exists()
    # only the scanner is answered from the cache: anyone else parsing the same text gets the full tree
    with remembered_scan(cache):
        full = ast.parse(sample[0].read_text(encoding="utf-8"))
    assert len(full.body) > len([c for c in truth if c[0] == sample[0].name])
    # a text changed since it was remembered is parsed again
    edited = tmp_path / "modeling_edited.py"
    edited.write_text(f"@{DECORATOR}\nclass NewExperts:\n    pass\n", encoding="utf-8")
    with remembered_scan(cache):
        assert scan([edited]) == [("modeling_edited.py", "NewExperts")]
    with remembered_scan(cache):
        edited.write_text("class Plain:\n    pass\n", encoding="utf-8")
        assert scan([edited]) == []


def test_a_damaged_cache_is_ignored(tmp_path):
    cache = tmp_path / "scan.json"
    cache.write_text("{not json", encoding="utf-8")
    models = Path(transformers.__file__).parent / "models"
    sample = sorted(models.rglob("modeling_*.py"))[:3]
    with remembered_scan(cache):
        assert _scanner()(sample) == _scanner()(sample)
