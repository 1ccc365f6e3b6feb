"""Everything a model card states, read from the run's artifacts (never from the run's memory).

The work dir holds what each phase proved (analysis, plan, manifest, validation report, eval
results); the export holds what was written (its ``config.json`` names the transformers that
wrote it). An artifact about another model (an ``eval`` of a different export in the same work
dir) is left out, and the card says so, so a card never carries another run's results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import ModelAnalysis, QuantPlan, RunManifest
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.state import RunState
from quark_ptq_eval.publish.base_card import BaseCard, check_base_model, json_or_empty, read_base_card

VALIDATION_FILE = "validation_report.json"
EVAL_FILE = "eval_results.json"
TORCH_FILE = "pytorch_install_result.json"


@dataclass(frozen=True)
class ComparisonChoice:
    """Why a comparison chose this export's scheme (compare writes the card of that one only)."""

    reason: str
    schemes: tuple[str, ...]  # every scheme compared, with its status: "fp8 (done)"
    report: str | None  # the comparison's report


@dataclass
class RunFacts:
    workdir: Path
    export: Path
    analysis: ModelAnalysis
    plan: QuantPlan
    manifest: RunManifest
    base: BaseCard
    validation: dict[str, Any] | None = None  # validation_report.json, when it is about this export
    evaluation: dict[str, Any] | None = None  # eval_results.json, when it is about this export
    versions: dict[str, str | None] = field(default_factory=dict)  # quark, torch, transformers
    left_out: list[str] = field(default_factory=list)  # artifacts found but about another model
    comparison: ComparisonChoice | None = None  # set when a comparison chose this scheme


def read_facts(workdir: Path, export: Path, base_model: str | None = None) -> RunFacts:
    """The run in ``workdir`` that wrote ``export``; refused when the work dir's run wrote another."""
    workdir, export = Path(workdir).resolve(), Path(export).resolve()
    if not QuantPlan.path_in(workdir).is_file():
        raise UsageError(f"{workdir} holds no run (no {QuantPlan.FILENAME}).",
                         "Pass the work dir of the run that wrote this export with --workdir.")
    plan = QuantPlan.load(workdir)
    if Path(plan.output_dir).resolve() != export:
        raise UsageError(f"The run in {workdir} wrote {plan.output_dir}, not {export}.",
                         "Pass the work dir of the run that wrote this export with --workdir.")
    if not (export / "config.json").is_file():
        raise UsageError(f"{export} holds no exported model (no config.json).",
                         "Run the recipe to its end first (quark-ptq-eval resume --workdir W).")
    analysis, manifest = ModelAnalysis.load(workdir), RunManifest.load(workdir)
    model = analysis.model
    stated = base_model or _recorded_base_model(workdir)
    check_base_model(stated)
    facts = RunFacts(workdir, export, analysis, plan, manifest,
                     read_base_card(str(model["model_path"]), str(model.get("model_source", "local")), stated))
    facts.validation = _about(facts, VALIDATION_FILE, "quantized_model_dir")
    facts.evaluation = _about(facts, EVAL_FILE, "model")
    facts.versions = {"quark": str(manifest.engine.get("version") or "") or None,
                      "torch": json_or_empty(workdir / TORCH_FILE).get("pytorch_version"),
                      "transformers": json_or_empty(export / "config.json").get("transformers_version")}
    return facts


def _recorded_base_model(workdir: Path) -> str | None:
    """The --base-model the run in ``workdir`` was given (run_state.json keeps its options)."""
    value = RunState.load(workdir).options.get("base_model")
    return value if isinstance(value, str) and value else None


def _about(facts: RunFacts, name: str, key: str) -> dict[str, Any] | None:
    """The work dir's ``name``, if it is about this export (else noted in ``left_out``)."""
    data = json_or_empty(facts.workdir / name)
    if not data:
        return None
    if Path(str(data.get(key, ""))).resolve() != facts.export:
        facts.left_out.append(f"{name} in {facts.workdir} is about {data.get(key)}, not this export: not carried")
        return None
    return data
