"""The generic registry (base/registry.py) and what rests on it: its errors, no registry name written
outside its entry, and docs/extending.md's "one module plus one row" done for real in a copy of
the package (a dummy engine, tier, check and source format run through the recipe)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from quark_ptq_eval.base.errors import DuplicateEntry, UnknownEntry, UsageError
from quark_ptq_eval.base.registry import Registry, load

SRC = Path(__file__).resolve().parents[2] / "src"
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
    from quark_ptq_eval.intake.formats import FORMATS
    from quark_ptq_eval.plan.engines import ENGINES
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
    "speed": "the goal's priority (speed first: plan, compare's recommendation), apart from the speed tier",
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
    from quark_ptq_eval.intake.formats import FORMATS
    from quark_ptq_eval.plan.engines import ENGINES
    from quark_ptq_eval.plan.targets import TARGETS
    from quark_ptq_eval.validate.checks import CHECKS

    rows: dict[str, list[tuple[str, set[str]]]] = {}
    for e in ENGINES.values():
        child = getattr(load_ref(e.module), "CHILD_MODULE", e.module)  # the engine's own child entry point
        rows.setdefault(e.name, []).append(("engine", {e.module, child}))
    for t in TIERS.values():
        rows.setdefault(t.name, []).append(("tier", {t.runner.partition(":")[0]} if t.runner else set()))
    for c in CHECKS.values():
        rows.setdefault(c.name, []).append(("check", {c.implemented_in} | ({c.run.__module__} if callable(c.run) else set())))
    for f in FORMATS.values():
        rows.setdefault(f.name, []).append(("format", {f.detector.partition(":")[0]}))
    for g in TARGETS.values():
        rows.setdefault(g.name, []).append(("target", set()))
    return rows


# The tables themselves: the rows and the code that reads them by row (not by name).
TABLES = {"quark_ptq_eval.plan.engines", "quark_ptq_eval.evaluate.tiers", "quark_ptq_eval.validate.checks",
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


def registry_enums_in_schemas(root: Path) -> list[str]:
    """Schema enums that list a registry's names: contracts.own_schema fills those from the rows."""
    rows, found = _registered(), []

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list) and any(isinstance(v, str) and v in rows and v not in HOMONYMS for v in enum):
                found.append(f"{where}: enum {enum}")
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}/{i}")

    for path in sorted(root.rglob("*.json")):
        walk(json.loads(path.read_text(encoding="utf-8")), str(path.relative_to(root.parent)))
    return found


def test_no_registry_name_is_written_outside_its_entry_and_the_tables():
    assert registry_names_outside_their_entries(PACKAGE) == []
    assert registry_enums_in_schemas(PACKAGE) == []


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
    (planted / "flows" / "x.schema.json").write_text('{"properties": {"name": {"enum": ["float", "fp8_block"]}}}')
    assert registry_enums_in_schemas(planted) == ["quark_ptq_eval/flows/x.schema.json/properties/name: enum "
                                                  "['float', 'fp8_block']"]


# ---- docs/extending.md for real: one module plus one row each, in a copy of the package ------------------
ENGINE_MODULE = '''"""Engine ``quark-api-copy``: the quark-api engine under its own name (the extension test's engine)."""

from quark_ptq_eval.plan.engines.quark_api import QuarkApiEngine


class QuarkApiCopyEngine(QuarkApiEngine):
    name = "quark-api-copy"

    def auto_reason(self, accelerator: str, calibration: object, device_is_cpu: bool) -> str | None:
        return None  # only when asked for


ENGINE = QuarkApiCopyEngine()
'''
TIER_MODULE = '''"""Tier ``census``: counts the export's tensors and bytes from its safetensors headers."""

import time
from dataclasses import dataclass

from quark_ptq_eval.base.safetensors_io import read_model_headers
from quark_ptq_eval.evaluate.context import RuntimeEstimate, TierInputs, TierOutcome, TierRunner


@dataclass
class Prepared:
    ctx: TierInputs
    estimate: RuntimeEstimate


class CensusTier(TierRunner):
    def prepare(self, ctx: TierInputs) -> Prepared:
        started = time.perf_counter()
        headers = read_model_headers(ctx.model_dir)  # the pilot: the whole work, timed
        size = sum(t.nbytes for t in headers.values())
        return Prepared(ctx, RuntimeEstimate(tier="census", seconds=time.perf_counter() - started,
                                             hardware="this host", model_bytes=size,
                                             data=f"{len(headers)} tensor headers", basis="one read of the headers"))

    def score(self, prepared: Prepared) -> TierOutcome:
        headers = read_model_headers(prepared.ctx.model_dir)
        quantized = sum(1 for name in headers if name.endswith("weight_scale"))
        scores = {"census": {"tensors": float(len(headers)), "scaled_weights": float(quantized)}}
        return TierOutcome(quantized=scores, directions={"census": {"tensors": True, "scaled_weights": True}},
                           details={"census": {"tensors": len(headers), "scaled_weights": quantized}},
                           informational=("tensors", "scaled_weights"))

    def section(self, report) -> list[str]:
        census = report.details["census"]
        return ["## Tensor census", "", f"- {census['tensors']} tensors, {census['scaled_weights']} with a weight "
                "scale", ""]
'''
CHECK_MODULE = '''"""Check ``census``: the export holds at least as many tensors as the source (scales added)."""

from quark_ptq_eval.validate.registry import CheckInputs, unreadable_headers
from quark_ptq_eval.validate.report import CheckResult, Finding


def check_census(ctx: CheckInputs) -> CheckResult:
    if (bad := unreadable_headers(ctx, "census")) is not None:
        return bad
    result = CheckResult("census")
    source, output = ctx.tensors("source") or {}, ctx.tensors("output") or {}
    result.stats.update(source_tensors=len(source), export_tensors=len(output))
    if len(output) < len(source):
        result.findings.append(Finding("export", "holds fewer tensors than the source.", side="quark"))
    result.notes.append(f"census: {len(source)} source tensors, {len(output)} in the export")
    return result
'''
FORMAT_MODULE = '''"""Source format ``census_marked``: an unquantized checkpoint whose config.json carries a marker."""

from quark_ptq_eval.intake.formats import SourceEvidence


def is_marked(e: SourceEvidence) -> bool:
    return not e.qc and bool(e.config.get("census_marked"))
'''
EXTENSIONS = (  # (module path, its text, the table file, the table's name, its row, the row it goes before)
    ("plan/engines/quark_api_copy.py", ENGINE_MODULE, "plan/engines/__init__.py", "ENGINES",
     'EngineEntry("quark-api-copy", "quark_ptq_eval.plan.engines.quark_api_copy", "quark-api again", '
     'reads_text_file=True),', None),
    ("evaluate/tier_census.py", TIER_MODULE, "evaluate/tiers.py", "TIERS",
     'Tier("census", "c", "census", "tensor census of the export", "seconds", '
     '"quark_ptq_eval.evaluate.tier_census:CensusTier", False, "tensor census"),', None),
    ("validate/census.py", CHECK_MODULE, "validate/checks.py", "CHECKS",
     'Check("census", "Tensor census (extension)", "quark_ptq_eval.validate.census:check_census", structural=False),',
     None),
    ("intake/census_format.py", FORMAT_MODULE, "intake/formats.py", "FORMATS",
     'SourceFormat("census_marked", "BF16 safetensors marked for the census", DIRECT, '
     '"quark_ptq_eval.intake.census_format:is_marked"),', 'SourceFormat("float",'),
)


def add_row(table: Path, name: str, row: str, before: str | None) -> None:
    """One registration: ``row`` into the ``name = Registry(...)`` table, at its end or before ``before``."""
    text = table.read_text(encoding="utf-8")
    start = text.index(f"{name}: Registry[")
    at = text.index(before, start) if before else text.index("\n))", start) + 1
    line_start = text.rindex("\n", 0, at) + 1 if before else at
    table.write_text(text[:line_start] + "    " + row + "\n" + text[line_start:], encoding="utf-8")


def extended_package(root: Path) -> Path:
    """A copy of the package with the four extensions: per extension one new module and one row."""
    copy = root / "quark_ptq_eval"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for module, text, table, name, row, before in EXTENSIONS:
        assert not (copy / module).exists()
        (copy / module).write_text(text, encoding="utf-8")
        add_row(copy / table, name, row, before)
    return root


@pytest.mark.slow
def test_a_new_engine_tier_check_and_source_format_are_one_module_and_one_row_each(tiny_llama, corpus, tmp_path):
    pkg = extended_package(tmp_path / "pkg")
    original = {p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")}
    changed = [p.relative_to(pkg / "quark_ptq_eval") for p in (pkg / "quark_ptq_eval").rglob("*.py")
               if p.relative_to(pkg / "quark_ptq_eval") not in original
               or p.read_bytes() != (PACKAGE / p.relative_to(pkg / "quark_ptq_eval")).read_bytes()]
    assert len(changed) == 8  # 4 new modules + 4 tables, one row each
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "census_marked": True}, indent=2))
    wd, out = tmp_path / "work", tmp_path / "out"
    argv = [sys.executable, "-m", "quark_ptq_eval", "run", str(model), "-o", str(out), "--workdir", str(wd),
            "--calib-data", str(corpus), "--num-calib-samples", "8", "--calib-seq-len", "64", "--offline",
            "--scheme", "int8", "--engine", "quark-api-copy", "--eval-tier", "census", "--no-load-check", "--yes",
            "--json"]
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(pkg)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"extended recipe: {time.monotonic() - started:.1f} s")
    assert json.loads(proc.stdout)["status"] == "done"
    analysis = json.loads((wd / "model_analysis.json").read_text())
    assert analysis["source_format"]["name"] == "census_marked"
    plan = json.loads((wd / "quant_plan.json").read_text())
    assert plan["engine"]["name"] == "quark-api-copy" and plan["source_reading"]["mode"] == "direct"
    assert "BF16 safetensors marked for the census: read as they are" in plan["source_reading"]["reason"]
    assert (out / "model.safetensors").is_file()  # the delegated engine wrote a real export
    validation = (wd / "validation_report.md").read_text()
    assert "## Tensor census (extension): " in validation and "census: " in validation
    contract = json.loads((wd / "validation_report.json").read_text())
    census = contract["checks"]["census"]
    assert census["status"] == "pass" and census["stats"]["export_tensors"] > census["stats"]["source_tensors"]
    report = (wd / "eval_report.md").read_text()
    assert "tier census" in report and "## Tensor census" in report and "with a weight scale" in report


# ---- the tier contract, checked when a row is registered -------------------------------------------------
def test_a_tier_row_that_lacks_the_contract_is_refused_when_registered():
    from quark_ptq_eval.base.registry import InvalidEntry
    from quark_ptq_eval.evaluate.tiers import TIERS, Tier, check_tier

    tiers = Registry("evaluation tier", entry_type=Tier, check=check_tier)
    row = TIERS["ppl"]
    tiers.register(row)  # a shipped row keeps the contract
    cases = {  # a row lacking one part -> what the refusal names
        "no_class": (Tier("no_class", "x", "t", "m", "c", "quark_ptq_eval.evaluate.ppl.kld_report:KldTier", True),
                     "its runner quark_ptq_eval.evaluate.ppl.kld_report defines no KldTier"),
        "no_ref": (Tier("no_ref", "x", "t", "m", "c", "quark_ptq_eval.evaluate.lmeval.tier", True),
                   "its runner 'quark_ptq_eval.evaluate.lmeval.tier' is not \"module:name\""),
        "bad_options": (Tier("bad_options", "x", "t", "m", "c", "quark_ptq_eval.evaluate.lmeval.tier:LmEvalTier", True,
                             options="quark_ptq_eval.evaluate.lmeval.tier:NoOptions"),
                        "its options quark_ptq_eval.evaluate.lmeval.tier defines no NoOptions"),
        "missing": (Tier("missing", "x", "t", "m", "c", "quark_ptq_eval.evaluate.tier_nowhere:NowhereTier", True),
                    "its runner quark_ptq_eval.evaluate.tier_nowhere does not exist"),
        "idle": (Tier("idle", "-", "t", "m", "c", None, False, options="a.b:c"),
                 "it runs nothing (no runner) but sets options"),
    }
    for name, (bad, why) in cases.items():
        with pytest.raises(InvalidEntry, match="is refused: ") as refused:
            tiers.register(bad)
        assert why in str(refused.value) and f"The evaluation tier {name!r}" in str(refused.value)
        assert "docs/extending.md" in str(refused.value)
    with pytest.raises(InvalidEntry, match="must be a Tier, not Row"):
        tiers.register(Row("row"))
    assert tiers.names() == ("ppl",)  # nothing refused was added


# What a tier is made of (its own sub-package of evaluate/, docs/extending.md), and what compare may import
# from them: the baseline's cache (compare's own store); the speed tier's options (its row's `options`), its
# measurement of one model alone, its servers' sizing and its statistics (compare --speed)
TIER_PACKAGES = ("ppl", "lmeval", "vllm", "serving", "speed")
COMPARE_MAY_IMPORT = ("quark_ptq_eval.evaluate.ppl.baseline_cache", "quark_ptq_eval.evaluate.speed.workload",
                      "quark_ptq_eval.evaluate.speed.alone", "quark_ptq_eval.evaluate.speed.commands",
                      "quark_ptq_eval.evaluate.speed.stats")


def test_compare_scores_through_the_tiers_interfaces_never_their_modules():
    """Compare reaches Tier 1 and Tier 2 as context.text_scorer() / task_scorer(), the modules of
    the tiers the registry marks as scoring a text / tasks in this process."""
    from quark_ptq_eval.evaluate.context import TaskScorer, TextScorer, task_scorer, text_scorer
    from quark_ptq_eval.evaluate.tiers import task_tier, text_tier

    compare = SRC / "quark_ptq_eval" / "flows" / "compare"
    reached = {f"{path.name}: {node.module}" for path in sorted(compare.glob("*.py"))
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
               and (node.module or "").split(".")[1:2] == ["evaluate"]
               and (node.module.split(".") + [""])[2] in TIER_PACKAGES and node.module not in COMPARE_MAY_IMPORT}
    assert reached == set(), "compare imports a tier's own modules"
    assert isinstance(text_scorer(), TextScorer) and text_tier().runner.endswith(type(text_scorer()).__name__)
    assert isinstance(task_scorer(), TaskScorer) and task_tier().runner.endswith(type(task_scorer()).__name__)


def test_a_tier_runner_that_breaks_its_rows_promise_is_refused_when_loaded():
    """A row's runner must subclass the base its flags promise and define every abstract method."""
    import dataclasses

    from quark_ptq_eval.base.registry import InvalidEntry
    from quark_ptq_eval.evaluate.context import tier_runner
    from quark_ptq_eval.evaluate.tiers import TIERS

    scores_text = dataclasses.replace(TIERS["lm_eval"], scores_text=True)  # Tier 2's runner is no TextScorer
    with pytest.raises(InvalidEntry, match="is no subclass of TextScorer"):
        tier_runner(scores_text)
    not_a_tier = dataclasses.replace(TIERS["ppl"], runner="quark_ptq_eval.evaluate.ppl.tier:PplPrepared")
    with pytest.raises(InvalidEntry, match="is no subclass of TextScorer"):
        tier_runner(not_a_tier)


NAMES_MODULE = '''"""Every way a module's top level binds a name."""
from __future__ import annotations

import os.path
from json import dumps as to_json, loads
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path
try:
    import tomllib
except ImportError:
    tomllib = None
else:
    FAST = True
finally:
    CLOSED = True
COUNT: int = 0
COUNT += 1
ANNOTATED_ONLY: int
first, (second, *rest) = 1, (2, 3)
holder = {}
holder["key"] = holder.attr = 1 if False else 2


def prepare(ctx):
    inner = 1
    return inner


class Runner:
    run = None
'''


def test_the_names_a_module_binds_read_alike_from_its_bytecode_and_its_source(tmp_path, monkeypatch):
    """defined_names reads the bytecode cache when there is one, else the source compiled: the same names."""
    import py_compile

    from quark_ptq_eval.base import registry

    module = tmp_path / "names_probe.py"
    module.write_text(NAMES_MODULE)
    expected = {"annotations", "os", "to_json", "loads", "TYPE_CHECKING", "Path", "tomllib", "FAST", "CLOSED",
                "COUNT", "first", "second", "rest", "holder", "prepare", "Runner"}
    assert registry._stored_names(compile(NAMES_MODULE, str(module), "exec")) == expected
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.defined_names("names_probe") == expected  # no cache yet: the source compiled
    module.write_text(NAMES_MODULE + "LATER = 1\n")
    os.utime(module, ns=(1, 10**9))  # a new mtime: read again, not the names remembered
    py_compile.compile(str(module), cfile=importlib.util.cache_from_source(str(module)), doraise=True)
    assert registry.defined_names("names_probe") == expected | {"LATER"}


# ---- docs/extending.md: a tier with its own option, one module and one row ----------------------------
OPTION_TIER_MODULE = '''"""Tier ``pattern``: counts the export's tensors whose name matches --census-pattern (its own option)."""

import fnmatch
import time
from dataclasses import dataclass, field

from quark_ptq_eval.base.options import flag
from quark_ptq_eval.base.safetensors_io import read_model_headers
from quark_ptq_eval.evaluate.context import RuntimeEstimate, TierInputs, TierOutcome, TierRunner


@dataclass
class PatternOptions:
    census_pattern: str = field(default="*", metadata=flag(
        "--census-pattern", metavar="GLOB", help="tier pattern: count the tensors whose name matches GLOB"))


@dataclass
class Prepared:
    ctx: TierInputs
    options: PatternOptions
    estimate: RuntimeEstimate


class PatternTier(TierRunner):
    def prepare(self, ctx: TierInputs) -> Prepared:
        started = time.perf_counter()
        headers = read_model_headers(ctx.model_dir)
        return Prepared(ctx, ctx.options.of(PatternOptions),
                        RuntimeEstimate(tier="pattern", seconds=time.perf_counter() - started, hardware="this host",
                                        model_bytes=sum(t.nbytes for t in headers.values()),
                                        data=f"{len(headers)} tensor headers", basis="one read of the headers"))

    def score(self, prepared: Prepared) -> TierOutcome:
        pattern = prepared.options.census_pattern
        matching = [name for name in read_model_headers(prepared.ctx.model_dir) if fnmatch.fnmatch(name, pattern)]
        return TierOutcome(quantized={"pattern": {"matching": float(len(matching))}},
                           directions={"pattern": {"matching": True}}, informational=("matching",),
                           details={"pattern": pattern, "matching": len(matching)})

    def section(self, report) -> list[str]:
        return ["## Pattern census", "", f"- {report.details['matching']} tensors match "
                f"`{report.details['pattern']}`", ""]
'''
OPTION_TIER = ("evaluate/tier_pattern.py", OPTION_TIER_MODULE, "evaluate/tiers.py", "TIERS",
               'Tier("pattern", "p", "pattern", "tensors matching a glob", "seconds", '
               '"quark_ptq_eval.evaluate.tier_pattern:PatternTier", False, "pattern census", '
               'options="quark_ptq_eval.evaluate.tier_pattern:PatternOptions"),', None)


def option_tier_package(root: Path) -> Path:
    """A copy of the package with the pattern tier: one new module and one row, nothing else."""
    copy = root / "quark_ptq_eval"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    module, text, table, name, row, before = OPTION_TIER
    (copy / module).write_text(text, encoding="utf-8")
    add_row(copy / table, name, row, before)
    changed = sorted(str(p.relative_to(copy)) for p in copy.rglob("*.py")
                     if not (PACKAGE / p.relative_to(copy)).is_file()
                     or p.read_bytes() != (PACKAGE / p.relative_to(copy)).read_bytes())
    assert changed == ["evaluate/tier_pattern.py", "evaluate/tiers.py"]
    return root


def _matching(model: Path, pattern: str) -> int:
    import fnmatch

    from quark_ptq_eval.base.safetensors_io import read_model_headers

    return sum(1 for name in read_model_headers(model) if fnmatch.fnmatch(name, pattern))


def test_a_tier_with_its_own_option_is_one_module_and_one_row(tiny_llama, tmp_path):
    import difflib

    pkg = option_tier_package(tmp_path / "pkg")
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    docs = tmp_path / "cli.md"  # what `make docs` runs, on the extended package
    subprocess.run([sys.executable, "-m", "quark_ptq_eval.cli.docs_gen", str(docs)], env=env, check=True,
                   capture_output=True)
    original = (SRC.parent / "docs" / "cli.md").read_text(encoding="utf-8").splitlines()
    diff = [d for d in difflib.ndiff(original, docs.read_text(encoding="utf-8").splitlines()) if d[:1] in "+-"]
    removed = [d[2:] for d in diff if d.startswith("- ")]
    added = [d[2:] for d in diff if d.startswith("+ ")]
    # the flag's line on `run`, `resume` and `eval`; --eval-tier's choices and help gain the tier, nothing else
    assert sum(line.startswith("| `--census-pattern` `GLOB` |") for line in added) == 3
    assert removed and all(line.startswith("| `--eval-tier`") for line in removed)
    for line in removed:
        assert line.replace("skip}`", "skip,pattern}`").replace(
            " (none) |", " (none); pattern: tier p, tensors matching a glob (seconds) |") in added
    assert len(added) == 3 + len(removed)
    work = tmp_path / "eval"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-m", "quark_ptq_eval", "eval", "--quantized", str(tiny_llama), "--tier",
                           "pattern", "--census-pattern", "*q_proj*"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((work / "eval_results.json").read_text())
    expected = _matching(tiny_llama, "*q_proj*")
    assert expected > 0 and results["quantized"] == {"pattern": {"matching": float(expected)}}
    assert results["settings"]["census_pattern"] == "*q_proj*" and results["details"]["pattern"] == "*q_proj*"
    assert f"- {expected} tensors match `*q_proj*`" in (work / "eval_report.md").read_text()


@pytest.mark.slow
def test_run_takes_the_new_tiers_option_through_the_recipe(tiny_llama, corpus, tmp_path):
    pkg = option_tier_package(tmp_path / "pkg")
    wd, out = tmp_path / "work", tmp_path / "out"
    argv = [sys.executable, "-m", "quark_ptq_eval", "run", str(tiny_llama), "-o", str(out), "--workdir", str(wd),
            "--calib-data", str(corpus), "--num-calib-samples", "8", "--calib-seq-len", "64", "--offline",
            "--scheme", "int8", "--eval-tier", "pattern", "--census-pattern", "*weight_scale", "--no-load-check",
            "--yes", "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(pkg)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["status"] == "done"
    results = json.loads((wd / "eval_results.json").read_text())
    expected = _matching(out, "*weight_scale")
    assert expected > 0 and results["quantized"] == {"pattern": {"matching": float(expected)}}
    assert results["settings"]["census_pattern"] == "*weight_scale"
    assert "## Pattern census" in (wd / "eval_report.md").read_text()
