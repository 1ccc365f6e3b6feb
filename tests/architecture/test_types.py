"""The type checker is part of the suite (CI runs `make test`): mypy over src/ as pyproject.toml
configures it (strict on the base and the steps), clean. Incremental: the repo's .mypy_cache makes a
rerun take seconds (a cold one, e.g. a fresh CI checkout, about a minute: torch's and transformers'
own annotations are read once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_is_clean_on_src() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mypy found type errors in src/ (run `make lint`):\n{proc.stdout}{proc.stderr}"
    assert "Success: no issues found" in proc.stdout, proc.stdout


# --- every function one package of src/ uses from another: no dict[str, Any] in its signature -------------
# (tests/architecture/seams.py scans the sources). What is still untyped, each with the reason it was left:
# the list only shrinks (a seam typed since fails the test until it is struck off here).
KNOWN_UNTYPED = {
    ("base.context_window", "fit_window"): "transformers' config.json, open by nature (keys vary by model_type)",
    ("base.context_window", "model_context"): "the same config.json",
    ("base.context_window", "read_model_config"): "the same config.json",
    ("base.sizes", "kv_bytes_per_token_of"): "the same config.json",
    ("runtime.loading", "read_config_or_raise"): "the same config.json",
    ("base.schemes", "as_spec_list"): "a scheme's spec rows from the bundled schemes table (YAML)",
    ("base.schemes", "load_scheme_table"): "the same table",
    ("base.schemes", "meaning"): "the same table's row",
}


def check_seams(sources: dict[str, str]) -> None:
    """Fail on a cross-package function with a ``dict[str, Any]`` in its signature that is not known."""
    from tests.architecture.seams import ROOT_PACKAGE, scan

    seams = scan(sources)
    found = {(s.module.removeprefix(f"{ROOT_PACKAGE}."), s.function) for s in seams}
    new = sorted(str(s) for s in seams if (s.module.removeprefix(f"{ROOT_PACKAGE}."), s.function) not in KNOWN_UNTYPED)
    assert not new, "a dict[str, Any] crosses a package boundary (type it: a dataclass or a TypedDict):\n" + "\n".join(new)
    typed_since = sorted(set(KNOWN_UNTYPED) - found)
    assert not typed_since, f"typed since: strike these off KNOWN_UNTYPED: {typed_since}"


def test_no_cross_package_function_takes_or_returns_a_dict_of_any() -> None:
    from tests.architecture.seams import src_sources

    check_seams(src_sources())


def test_the_seam_scan_fails_on_a_planted_dict_of_any_anywhere_in_src() -> None:
    from tests.architecture.seams import Seam, scan, src_sources

    real = src_sources()
    # one of this round's seams typed back to a dict: the scan names it, with its caller
    reverted = {**real, "quark_ptq_eval.evaluate.ppl.baseline_cache": real["quark_ptq_eval.evaluate.ppl.baseline_cache"]
                .replace(") -> CachedTokenStats:", ") -> dict[str, Any]:")}
    assert Seam("quark_ptq_eval.evaluate.ppl.baseline_cache", "cached_token_stats", "return",
                "quark_ptq_eval.flows.compare.evaluation") in scan(reverted)
    with pytest.raises(AssertionError, match="cached_token_stats"):
        check_seams(reverted)
    # a new module anywhere: a parameter, a quoted Mapping return, reached through a package's re-export,
    # as ``module.function`` and from inside a function; used within its own package it is no seam
    planted = {**real,
               "quark_ptq_eval.sensitivity.planted": "from typing import Any\n"
               "def helper(rows: list[int], extra: dict[str, Any]) -> int: ...\n"
               "def other() -> 'Mapping[str, Any]': ...\n"
               "def inner(x: dict[str, Any]) -> None: ...\n",
               "quark_ptq_eval.publish.planted_user": "from quark_ptq_eval.sensitivity import planted\n"
               "def f():\n    from quark_ptq_eval.sensitivity.planted import helper\n    return helper, planted.other\n",
               "quark_ptq_eval.sensitivity.same_package": "from quark_ptq_eval.sensitivity.planted import inner\n"}
    planted["quark_ptq_eval.sensitivity"] += "\nfrom quark_ptq_eval.sensitivity.planted import helper as helper\n"
    planted["quark_ptq_eval.execute.reexport_user"] = "from quark_ptq_eval.sensitivity import helper\n"
    found = set(scan(planted)) - set(scan(real))
    assert found == {Seam("quark_ptq_eval.sensitivity.planted", "helper", "extra", "quark_ptq_eval.publish.planted_user"),
                     Seam("quark_ptq_eval.sensitivity.planted", "other", "return", "quark_ptq_eval.publish.planted_user"),
                     Seam("quark_ptq_eval.sensitivity.planted", "helper", "extra", "quark_ptq_eval.execute.reexport_user")}
    with pytest.raises(AssertionError, match=r"sensitivity\.planted\.helper \(extra\), used from"):
        check_seams(planted)


# --- dataclass fields: no dict[str, Any] in a new one -------------------------------------------------------------
# Each dataclass that still carries an open record, its fields, and why: the list only shrinks (a field typed since
# fails the test until it is struck off here, a new one fails until it is typed).
ARTIFACT = "a step's JSON artifact, its schema in base/schemas (typed records of it: a later round)"
KNOWN_DICT_FIELDS: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    ("base.artifacts", "Decision"): (("extra",), "a plan row's extra facts, open per decision"),
    ("base.artifacts", "ModelAnalysis"): (("architecture", "model", "quantization_targets", "risks", "size",
                                           "source_format", "template"), ARTIFACT),
    ("base.artifacts", "QuantPlan"): (("model", "resources", "target"), ARTIFACT),
    ("base.artifacts", "RunManifest"): (("checkpoints", "command", "engine", "inputs", "observed", "outputs", "runs",
                                         "steps"), ARTIFACT),
    ("base.options", "Flag"): (("argparse",), "argparse's own keywords for add_argument, open by nature"),
    ("cli.quark_cli_flags", "Flag"): (("kwargs",), "argparse's own keywords for add_argument, open by nature"),
    ("base.state", "RunState"): (("options", "pending", "steps"), "run_state.json, the resumable run's record"),
    ("context.preflight", "Contexts"): (("pytorch", "quark", "session", "workspace"), "environment probes' records"),
    ("evaluate.context", "ScoredText"): (("baseline_cache",), "the baseline cache's JSON summary"),
    ("evaluate.context", "TierOutcome"): (("deferred_commands",), "eval_results.json's deferred command rows"),
    ("evaluate.details", "PerplexityDetails"): (("baseline_cache", "distribution", "hf_vs_vllm", "kld_report", "paired"),
                                                "eval_results.json's details, as written"),
    ("evaluate.details", "ServerDetails"): (("commands", "environment", "paired_tests", "server_args", "speed", "stderr",
                                             "vllm"), "eval_results.json's details, as written"),
    ("evaluate.details", "TaskDetails"): (("paired_tests", "workload"), "eval_results.json's details, as written"),
    ("evaluate.eval_report", "EvalReport"): (("deferred_commands", "details", "sensitivity", "settings"),
                                             "eval_results.json, as written and read back"),
    ("evaluate.options", "EvalOptions"): (("tier_options",), "a registered tier's own options, open per tier"),
    ("evaluate.ppl.baseline_cache", "BaselineEntry"): (("meta",), "the cache entry's JSON metadata"),
    ("flows.compare.options", "CompareOptions"): (("plan",), "PlanRequest keywords given to compare (generic flags)"),
    ("flows.compare.ray_cell", "CellSpec"): (("options",), "a cell's options sent to a Ray worker as JSON"),
    ("flows.compare.ray_cell", "SpeedSpec"): (("options",), "the same, for a speed cell"),
    ("flows.sweep", "Grid"): (("options",), "a sweep's shared keywords for run()"),
    ("intake.formats", "SourceEvidence"): (("config", "qc"), "transformers' config.json and its quantization_config"),
    ("publish.base_card", "BaseCard"): (("carried",), "the base model card's YAML front matter, open by nature"),
    ("publish.facts", "RunFacts"): (("evaluation", "validation"), "the reports' JSON, as written"),
    ("runtime.block_pass", "Recorded"): (("kwargs",), "a decoder block's forward keywords, as the model passes them"),
    ("validate.replay", "Capture"): (("kwargs",), "a decoder block's forward keywords, as the model passes them"),
    ("sensitivity", "SensitivityOutcome"): (("result",), "the scan's JSON record (ScanResult types what the search reads)"),
    ("sensitivity.proposal", "Proposal"): (("rechecks", "wider"), "sensitivity_report.json's proposal record"),
    ("sensitivity.replay", "Decoder"): (("inputs",), "a decoder block's forward keywords, as the model passes them"),
    ("sensitivity.scan", "Session"): (("layers", "share"), "Quark's quantizers per module (live objects)"),
    ("validate.decode_blocks", "DecodeTarget"): (("spec",), "a Quark quantization spec (quantization_config JSON)"),
    ("validate.layout", "LayoutInputs"): (("export_qconfig", "qconfig"), "quantization_config JSON, open by nature"),
    ("validate.plan_conformance", "PlanExpectation"): (("qconfig",), "quantization_config JSON, open by nature"),
    ("validate.registry", "CheckInputs"): (("out_config", "plan", "src_config"), "config.json and the plan's JSON"),
    ("validate.registry", "Handoffs"): (("expected_qconfig",), "quantization_config JSON, open by nature"),
    ("validate.report", "CheckResult"): (("stats",), "a check's statistics, open per check"),
}


def check_fields(sources: dict[str, str]) -> None:
    """Fail on a dataclass field typed ``dict[str, Any]`` that is not known, and on a known one typed since."""
    from tests.architecture.seams import ROOT_PACKAGE, dict_fields

    found: dict[tuple[str, str], set[str]] = {}
    for module, cls, field in dict_fields(sources):
        found.setdefault((module.removeprefix(f"{ROOT_PACKAGE}."), cls), set()).add(field)
    new = sorted(f"{m}.{c}.{f}" for (m, c), fields in found.items() for f in fields
                 if f not in KNOWN_DICT_FIELDS.get((m, c), ((), ""))[0])
    assert not new, "a dataclass field is a dict[str, Any] (type it: a dataclass or a TypedDict):\n" + "\n".join(new)
    typed_since = sorted(f"{m}.{c}.{f}" for (m, c), (fields, _) in KNOWN_DICT_FIELDS.items() for f in fields
                         if f not in found.get((m, c), set()))
    assert not typed_since, f"typed since: strike these off KNOWN_DICT_FIELDS: {typed_since}"


def test_no_new_dataclass_field_is_a_dict_of_any() -> None:
    from tests.architecture.seams import src_sources

    check_fields(src_sources())


def test_the_field_scan_fails_on_a_planted_dict_field_and_on_a_stale_entry() -> None:
    from tests.architecture.seams import src_sources

    real = src_sources()
    planted = {**real, "quark_ptq_eval.budget.planted": "from dataclasses import dataclass, field\n"
               "from typing import Any\n@dataclass(frozen=True)\nclass Row:\n    name: str\n"
               "    facts: 'dict[str, Any]' = field(default_factory=dict)\n"}
    with pytest.raises(AssertionError, match=r"budget\.planted\.Row\.facts"):
        check_fields(planted)
    module = "quark_ptq_eval.sensitivity.proposal"  # one known field typed: its entry is stale
    typed = {**real, module: real[module].replace("    wider: dict[str, Any] | None", "    wider: WiderResult | None")}
    assert typed[module] != real[module]
    with pytest.raises(AssertionError, match=r"typed since.*Proposal\.wider"):
        check_fields(typed)
