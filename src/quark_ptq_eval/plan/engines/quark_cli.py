"""Engine ``quark-cli``: ``quark-cli torch-llm-ptq``, Quark's public CLI (``amd-quark[cli]``).

Offline it calibrates from a private datasets cache that serves the user's text under the
dataset id it asks for (see plan/engines/calib_cache.py); on a CPU-only host it only survives
weight-only / dynamic-activation schemes with --multi-device (measured on 0.13).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quark_ptq_eval.base.catalog import SchemeInfo
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.legacy_exclusions import loaded_name_exclusions
from quark_ptq_eval.base.plan_records import DeviceStrategy, PlannedCalibration
from quark_ptq_eval.context.quark_cli import SUBCOMMAND, find_quark_cli
from quark_ptq_eval.plan.engines.flags import head_flags, tail_flags

CALIB_CACHE_DIR = "calib_cache"  # under the work dir


class QuarkCliEngine:
    name = "quark-cli"

    def auto_reason(self, accelerator: str, calibration: PlannedCalibration, device_is_cpu: bool) -> str | None:
        if accelerator in ("cpu", "unknown") or device_is_cpu:
            return None  # it loads with device_map="auto": the quark-api engine serves CPU hosts
        if calibration.source == "local_file":
            return "quark-cli with your text served from a private offline datasets cache"
        return "the public Quark CLI serves this plan as is"

    def check_constraints(self, scheme_info: SchemeInfo, algorithm: str | None, device: DeviceStrategy) -> None:
        """quark-cli 0.13 always loads with device_map='auto'; without a GPU accelerate offloads the
        model to disk, which only weight-only / dynamic-activation schemes survive (measured)."""
        if device.device != "cpu":
            return
        if not device.multi_device:
            raise UsageError("quark-cli on a CPU-only host needs --multi-device (it otherwise refuses with an "
                             "out-of-GPU-memory error).", "Add --multi-device, or use --engine quark-api.")
        if scheme_info.get("static_activations") or algorithm:
            raise UsageError("quark-cli on a CPU-only host can only run weight-only or dynamic-activation schemes "
                             "without algorithms (static calibration fails on offloaded weights).",
                             "Use --engine quark-api (the default on CPU) for this plan.")

    def argv(self, plan: Any, model_dir: Path, out: Path) -> list[str]:
        cli = find_quark_cli()
        if cli is None:
            raise UsageError("quark-cli is not installed.", "Install it with: pip install 'amd-quark[cli]==0.13'.")
        cal = plan.calibration
        # A local file is served as pileval from the private cache.
        argv = [cli, SUBCOMMAND, *head_flags(plan, model_dir, out), "--dataset", cal.dataset or "pileval"]
        if plan.device_strategy.multi_device:
            argv.append("--multi_device")
        if not plan.trust_remote_code:
            argv.append("--no_trust_remote_code")  # quark-cli trusts remote code unless told not to
        # quark-cli matches the patterns against the loaded model's names: the template's checkpoint
        # names (DeepSeek-V4's ``head``) are added in transformers' (``lm_head``), as the quark-api child does
        loaded = loaded_name_exclusions(plan.model["model_path"], plan.model["model_type"], list(plan.exclude_layers))
        return [*argv, *tail_flags(plan, loaded), "--skip_evaluation"]

    def env(self, plan: Any, workdir: Path) -> dict[str, str]:
        if plan.calibration.source != "local_file":
            return {}
        from quark_ptq_eval.plan.engines.calib_cache import offline_env

        return offline_env(workdir / CALIB_CACHE_DIR)

    def prepare_calibration(self, manifest: Any) -> None:
        cache = manifest.command.get("env", {}).get("HF_DATASETS_CACHE")
        if not cache:
            return
        from quark_ptq_eval.plan.engines.calib_cache import prepare_offline_calibration

        calib = manifest.inputs.get("calibration")
        if not calib or not Path(calib).exists():
            raise UsageError(f"The calibration file {calib} named in the manifest is missing.",
                             "Restore it, or pass another --calib-data and approve the new plan.")
        argv = manifest.command["argv"]
        dataset = argv[argv.index("--dataset") + 1] if "--dataset" in argv else "pileval"
        prepare_offline_calibration(Path(calib), Path(cache), dataset=dataset)

    def version(self) -> str:
        from quark_ptq_eval.base.catalog import quark_version

        return quark_version()


ENGINE = QuarkCliEngine()
