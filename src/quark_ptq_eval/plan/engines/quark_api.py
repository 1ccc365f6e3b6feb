"""Engine ``quark-api``: Quark's public Python API, driven by ``execute/quark_api_engine.py`` in a
child process. It runs on any device (quark-cli 0.13 needs a GPU) and calibrates on local text."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.catalog import SchemeInfo
from quark_ptq_eval.base.plan_records import DeviceStrategy, PlannedCalibration
from quark_ptq_eval.plan.engines.flags import head_flags, tail_flags

CHILD_MODULE = "quark_ptq_eval.execute.quark_api_engine"  # the child entry point


class QuarkApiEngine:
    name = "quark-api"
    child_module = CHILD_MODULE

    def auto_reason(self, accelerator: str, calibration: PlannedCalibration, device_is_cpu: bool) -> str | None:
        if accelerator in ("cpu", "unknown") or device_is_cpu:
            return ("quark-cli 0.13 loads with device_map='auto' and fails on a host without a GPU; "
                    "Quark's Python API quantizes on the CPU")
        return None

    def check_constraints(self, scheme_info: SchemeInfo, algorithm: str | None, device: DeviceStrategy) -> None:
        return None  # any device, any scheme the installed Quark supports

    def argv(self, plan: Any, model_dir: Path, out: Path) -> list[str]:
        argv = [sys.executable, "-m", self.child_module, *head_flags(plan, model_dir, out),
                "--calib_data", plan.calibration.path]
        if plan.trust_remote_code:
            argv.append("--trust_remote_code")
        return [*argv, *tail_flags(plan)]

    def env(self, plan: Any, workdir: Path) -> dict[str, str]:
        return {}

    def prepare_calibration(self, manifest: Any) -> None:
        return None  # the child reads the local text itself

    def version(self) -> str:
        from quark_ptq_eval.base.catalog import quark_version

        return quark_version()


ENGINE = QuarkApiEngine()
