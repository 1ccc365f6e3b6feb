"""Build the run manifest: the exact engine command (argument list, absolute paths, no shell).

The engines (plan/engines/, all real Quark) share one flag vocabulary (quark-cli's). The
engine writes into a staging directory next to the output; the output appears only once the
result is verified.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import QuantPlan, RunManifest
from quark_ptq_eval.base.calibration_text import describe_used
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.gates import GATES, PIPELINE_GATES
from quark_ptq_eval.base.step_table import STEPS, SUMMARY_FILE
from quark_ptq_eval.plan.engines import Engine, get_engine

WORKFLOW = "quark-torch-llm-ptq-eval"


def staging_dir(output_dir: Path) -> Path:
    return output_dir.with_name(output_dir.name + ".partial")


def engine_env(plan: QuantPlan, engine: Engine, offline: bool, workdir: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    if offline:
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return {**env, **engine.env(plan, workdir)}


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    prefix = [f"{k}={v}" for k, v in env.items()]
    return shlex.join(["env", *prefix, *argv] if prefix else argv)


def manifest_steps(workdir: Path, calibration: list[dict[str, Any]], run: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's step list, in the recipe's order (steps.STEPS), ending with the summary."""
    steps: list[dict[str, Any]] = []
    for step in STEPS:
        if step.manifest_step == "run":
            steps += [*calibration, run]
        elif step.manifest_step:
            steps.append({"name": step.manifest_step, "kind": step.manifest_step,
                          "produces": [str(workdir / step.artifacts[0])]})
    return [*steps, {"name": "summarize", "kind": "summarize", "produces": [str(workdir / SUMMARY_FILE)]}]


def build_manifest(plan: QuantPlan, workdir: Path, output_dir: Path, *, offline: bool,
                   engine_version: str | None = None) -> RunManifest:
    engine = get_engine(plan.engine.name)
    engine_version = engine_version or engine.version()
    model_dir = Path(plan.model["model_path"])
    if not model_dir.is_absolute():
        raise UsageError(f"The model path {model_dir} is not a local absolute path.",
                         "Download the model and pass its directory.")
    staging = staging_dir(output_dir)
    reading = plan.source_reading if plan.source_reading is not None and plan.source_reading.staged else None
    engine_reads = Path(reading.engine_reads if reading else model_dir)  # a staged BF16 / converted copy, or the model
    argv = engine.argv(plan, engine_reads, staging)
    env = engine_env(plan, engine, offline, workdir)
    calibration = []
    if "HF_DATASETS_CACHE" in env:
        calibration.append({"name": "prepare_calibration", "kind": "generate",
                            "description": "serve the local calibration text to quark-cli from a private offline cache",
                            "produces": [env["HF_DATASETS_CACHE"]]})
    if reading is not None:
        calibration.insert(0, {"name": "prepare_source", "kind": "generate", "description": reading.reason,
                               "produces": [reading.source_dir]})
    run = {"name": "run", "kind": "run", "command": shell_line(argv, env), "argv": argv,
           "produces": [str(staging)], "then": f"verified output is moved to {output_dir}"}
    steps = manifest_steps(workdir, calibration, run)
    command = {"argv": argv, "shell": shell_line(argv, env), "env": env, "cwd": str(workdir)}
    manifest = RunManifest(
        workflow=WORKFLOW,
        inputs={"model_dir": str(model_dir), "quant_plan": str(workdir / "quant_plan.json"),
                "model_analysis": str(workdir / "model_analysis.json"),
                "calibration": plan.calibration.path or plan.calibration.dataset,
                "calibration_used": describe_used(plan),
                **({"source_reading": reading.to_dict()} if reading is not None else {})},
        outputs={"quantized_model_dir": str(output_dir), "staging_dir": str(staging), "workdir": str(workdir),
                 "log": str(workdir / "logs" / "engine.log")},
        checkpoints=[{"id": f"checkpoint_{GATES[g].number}", "gate": g, "question": GATES[g].question,
                      "reason": GATES[g].reason} for g in PIPELINE_GATES],
        steps=steps,
        engine={"name": engine.name, "version": engine_version, "reason": plan.engine.reason},
        command={**command, "digest": ""},
    )
    manifest.command["digest"] = manifest.command_digest
    return manifest
