"""Build the run manifest: the exact engine command (argument list, absolute paths, no shell).

Two engines, both real Quark, share one flag vocabulary (quark-cli's): ``quark-cli
torch-llm-ptq`` and our thin driver of Quark's public Python API. The engine writes into a
staging directory next to the output; the output appears only once the result is verified.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ..artifacts import QuantPlan, RunManifest
from ..checkpoints import GATES, PIPELINE_GATES
from ..errors import UsageError

WORKFLOW = "quark-torch-llm-ptq-eval"
CALIB_CACHE_DIR = "calib_cache"


@dataclass(frozen=True)
class Engine:
    name: str
    extra_flags: tuple[str, ...]

    def launcher(self) -> list[str]:
        if self.name == "quark-cli":
            cli = shutil.which("quark-cli") or str(Path(sys.executable).parent / "quark-cli")
            if not Path(cli).exists():
                raise UsageError("quark-cli is not installed.", "Install it with: pip install 'amd-quark[cli]==0.13'.")
            return [str(Path(cli).absolute()), "torch-llm-ptq"]
        return [sys.executable, "-m", "quark_ptq_eval.execute.quark_api_engine"]


ENGINES = {
    "quark-cli": Engine("quark-cli", ("--skip_evaluation",)),
    "quark-api": Engine("quark-api", ()),
}


def staging_dir(output_dir: Path) -> Path:
    return output_dir.with_name(output_dir.name + ".partial")


def engine_argv(plan: QuantPlan, engine: Engine, model_dir: Path, out: Path, workdir: Path) -> list[str]:
    cal = plan.calibration
    argv = [*engine.launcher(), "--model_dir", str(model_dir), "--output_dir", str(out),
            "--quant_scheme", plan.global_scheme, "--device", plan.device_strategy["device"],
            "--seq_len", str(cal["seq_len"]), "--batch_size", str(cal["batch_size"]),
            "--num_calib_data", str(cal["num_samples"])]
    if engine.name == "quark-cli":
        argv += ["--dataset", cal["dataset"] or "pileval"]  # a local file is served as pileval (private cache)
        if plan.device_strategy["multi_device"]:
            argv.append("--multi_device")
        if not plan.trust_remote_code:
            argv.append("--no_trust_remote_code")  # quark-cli trusts remote code unless told not to
    else:
        argv += ["--calib_data", cal["path"]]
        if plan.trust_remote_code:
            argv.append("--trust_remote_code")
    for pattern, scheme in plan.layer_quant_config.items():
        argv += ["--layer_quant_scheme", pattern, scheme]
    if plan.kv_cache_scheme:
        argv += ["--kv_cache_dtype", plan.kv_cache_scheme]
    if plan.algorithm:
        argv += ["--quant_algo", plan.algorithm]
    if plan.exclude_layers or plan.exclude_source == "user":
        # Always spelled out, so the command is exactly the plan (also a hand-corrected one).
        # An empty list disables all exclusions: the plan only allows that with --no-exclusions.
        argv += ["--exclude_layers", *plan.exclude_layers]
    return [*argv, *engine.extra_flags]


def engine_env(plan: QuantPlan, engine: Engine, offline: bool, workdir: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    if offline:
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if engine.name == "quark-cli" and plan.calibration["source"] == "local_file":
        from ..execute.calib_cache import offline_env

        env.update(offline_env(workdir / CALIB_CACHE_DIR))
    return env


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    prefix = [f"{k}={v}" for k, v in env.items()]
    return shlex.join(["env", *prefix, *argv] if prefix else argv)


def build_manifest(plan: QuantPlan, workdir: Path, output_dir: Path, *, offline: bool, engine_version: str) -> RunManifest:
    engine = ENGINES[plan.engine["name"]]
    model_dir = Path(plan.model["model_path"])
    if not model_dir.is_absolute():
        raise UsageError(f"The model path {model_dir} is not a local absolute path.",
                         "Download the model and pass its directory.")
    staging = staging_dir(output_dir)
    argv = engine_argv(plan, engine, model_dir, staging, workdir)
    env = engine_env(plan, engine, offline, workdir)
    steps = [
        {"name": "analyze", "kind": "analyze", "produces": [str(workdir / "model_analysis.json")]},
        {"name": "plan", "kind": "plan", "produces": [str(workdir / "quant_plan.json")]},
        {"name": "generate", "kind": "generate", "produces": [str(workdir / "run_manifest.yaml")]},
    ]
    if "HF_DATASETS_CACHE" in env:
        steps.append({"name": "prepare_calibration", "kind": "generate",
                      "description": "serve the local calibration text to quark-cli from a private offline cache",
                      "produces": [env["HF_DATASETS_CACHE"]]})
    steps += [
        {"name": "run", "kind": "run", "command": shell_line(argv, env), "argv": argv,
         "produces": [str(staging)], "then": f"verified output is moved to {output_dir}"},
        {"name": "validate", "kind": "validate", "produces": [str(workdir / "validation_report.md")]},
        {"name": "summarize", "kind": "summarize", "produces": [str(workdir / "run_summary.json")]},
    ]
    command = {"argv": argv, "shell": shell_line(argv, env), "env": env, "cwd": str(workdir)}
    manifest = RunManifest(
        workflow=WORKFLOW,
        inputs={"model_dir": str(model_dir), "quant_plan": str(workdir / "quant_plan.json"),
                "model_analysis": str(workdir / "model_analysis.json"),
                "calibration": plan.calibration.get("path") or plan.calibration.get("dataset")},
        outputs={"quantized_model_dir": str(output_dir), "staging_dir": str(staging), "workdir": str(workdir),
                 "log": str(workdir / "logs" / "engine.log")},
        checkpoints=[{"id": f"checkpoint_{GATES[g].number}", "gate": g, "question": GATES[g].question,
                      "reason": GATES[g].reason} for g in PIPELINE_GATES],
        steps=steps,
        engine={"name": engine.name, "version": engine_version, "reason": plan.engine["reason"]},
        command={**command, "digest": ""},
    )
    manifest.command["digest"] = manifest.command_digest
    return manifest
