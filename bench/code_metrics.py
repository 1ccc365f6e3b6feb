"""How easy the code is to carry, in six numbers (issue 66): ``python -m bench.code_metrics``.

What each line counts, read from the working tree (nothing is run but one import probe):

- modules in src: ``.py`` files under ``src/quark_ptq_eval`` (packages' ``__init__.py`` included).
- ``.get("`` calls in src: occurrences of the text ``.get("`` in those files (a dict read by key, mostly).
- ``dict[str, Any]`` fields of the records: the annotated fields (``ClassVar`` left out) of ``ModelAnalysis``,
  ``QuantPlan`` and ``RunManifest``, wherever src defines them, whose annotation contains ``dict[str, Any]``
  (``list[dict[str, Any]]`` included), and those of every class of src a field's annotation names (a nested
  record such as the plan's ``Decision``), followed down; listed per class. (Issue 66's "18" counted the fields
  typed exactly ``dict[str, Any]`` on the three classes only.)
- dated or round-numbered comments in src: comments and docstrings holding a date (``2026-12-05``) or a round
  (``round 14``), each listed as ``path:line``. Help strings and other string literals are not comments.
- README lines: ``README.md``'s line count.
- modules of the package ``run MODEL -o OUT --scheme int8 --eval-tier ppl --baseline`` imports, measured without
  running it: a fresh interpreter parses that command line with the CLI's own parser (what ``main()`` does before it
  dispatches), then imports the run path's orchestration, ``cli/recipe.py`` and ``flows/recipe/``, together with
  every module those two import inside any of their functions (their late imports: counted whether or not this
  command line calls that function, as a reader must follow them), and the module of the ``ppl`` tier as the tier
  table names it (``evaluate/context.tier_runner`` imports it by name); then it counts the ``quark_ptq_eval``
  modules in ``sys.modules``. So a module counts when that path reaches it by module-level imports; a late import
  below the orchestration (inside a step's own package) is not followed, and the engine, a child process of its
  own, is not counted.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "quark_ptq_eval"
RECORDS = ("ModelAnalysis", "QuantPlan", "RunManifest")
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bround \d+", re.IGNORECASE)
RUN_ARGV = ["run", "MODEL", "-o", "OUT", "--scheme", "int8", "--eval-tier", "ppl", "--baseline"]

PROBE = """
import ast, importlib, json, sys
from pathlib import Path
from quark_ptq_eval.cli.main import build_parser
from quark_ptq_eval.cli.quark_cli_flags import rewrite_model_dir
build_parser().parse_args(rewrite_model_dir(json.loads(sys.argv[1])))
pkg = Path(sys.argv[2])
path = [pkg / "cli" / "recipe.py", *sorted((pkg / "flows" / "recipe").glob("*.py"))]
names = {".".join(p.relative_to(pkg.parent).with_suffix("").parts).removesuffix(".__init__") for p in path}
for p in path:
    for fn in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names |= {n.module for n in ast.walk(fn) if isinstance(n, ast.ImportFrom) and n.level == 0}
            names |= {a.name for n in ast.walk(fn) if isinstance(n, ast.Import) for a in n.names}
for name in sorted(n for n in names if n and n.startswith("quark_ptq_eval")):
    importlib.import_module(name)
from quark_ptq_eval.evaluate.context import tier_runner
from quark_ptq_eval.evaluate.tiers import get_tier
tier_runner(get_tier("ppl"))
print(sum(1 for m in sys.modules if m.split(".")[0] == "quark_ptq_eval"))
"""


def sources() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def dict_fields(files: list[Path]) -> dict[str, list[str]]:
    """Class -> its fields typed with a dict[str, Any], for RECORDS and the src classes their fields name."""
    classes = {node.name: node for f in files for node in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
               if isinstance(node, ast.ClassDef)}
    found: dict[str, list[str]] = {}
    todo = [c for c in RECORDS if c in classes]
    while todo:
        name = todo.pop(0)
        if name in found:
            continue
        fields = [st for st in classes[name].body if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                  and "ClassVar" not in ast.unparse(st.annotation)]
        found[name] = [st.target.id for st in fields if "dict[str, Any]" in ast.unparse(st.annotation)]
        named = {n.id for st in fields for n in ast.walk(st.annotation) if isinstance(n, ast.Name)}
        named |= {n.value for st in fields for n in ast.walk(st.annotation)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        todo += sorted(n for n in named if n in classes and n not in found)
    return found


def dated_comments(files: list[Path]) -> list[str]:
    """path:line of each comment or docstring with a date or a round number in it."""
    hits = []
    for f in files:
        rel = f.relative_to(ROOT)
        with f.open("rb") as fh:
            hits += [f"{rel}:{t.start[0]}" for t in tokenize.tokenize(fh.readline)
                     if t.type == tokenize.COMMENT and DATED.search(t.string)]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                        and isinstance(first.value.value, str) and DATED.search(first.value.value)):
                    hits.append(f"{rel}:{first.lineno}")
    return sorted(set(hits))


def run_imports() -> str:
    proc = subprocess.run([sys.executable, "-c", PROBE, repr(RUN_ARGV).replace("'", '"'), str(PKG)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return proc.stdout.strip() if proc.returncode == 0 else f"not measured: {proc.stderr.strip()[-300:]}"


def main() -> int:
    files = sources()
    fields = dict_fields(files)
    dated = dated_comments(files)
    rows = [
        ("modules in src", str(len(files))),
        ('.get(" calls in src', str(sum(f.read_text(encoding="utf-8").count('.get("') for f in files))),
        ("dict[str, Any] fields of the records", str(sum(len(v) for v in fields.values()))),
        *((f"  {cls}", f"{len(v)}: {', '.join(v)}" if v else "0") for cls, v in fields.items()),
        ("dated or round-numbered comments in src", str(len(dated))),
        *((f"  {hit}", "") for hit in dated),
        ("README lines", str(len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()))),
        ("package modules `run --scheme int8 --eval-tier ppl --baseline` imports", run_imports()),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
