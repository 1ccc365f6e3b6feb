"""Context artifacts: read and validated when the user gives them, produced here when not.

``session_context.json`` (goal, offline, execution_mode), ``env_context.json`` (machine and
accelerator), ``workspace_context.json`` (paths and disk), ``pytorch_install_result.json`` and
``quark_install_result.json`` (is the runtime ready?). All follow Quark's shipped contracts.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import contracts
from .fsio import read_json, write_json

CONTEXT_KINDS = ("session_context", "env_context", "workspace_context", "pytorch_install_result",
                 "quark_install_result")
EXECUTION_MODES = ("plan_only", "interactive_execute", "batch_execute")


@dataclass
class Contexts:
    session: dict[str, Any]
    env: dict[str, Any]
    workspace: dict[str, Any]
    pytorch: dict[str, Any]
    quark: dict[str, Any]

    @property
    def offline(self) -> bool:
        return bool(self.session.get("constraints", {}).get("offline"))

    @property
    def execution_mode(self) -> str:
        return self.session.get("constraints", {}).get("execution_mode", "batch_execute")

    @property
    def accelerator(self) -> str:
        return self.env["hardware"]["accelerator"]


def load_context(kind: str, path: str | Path) -> dict:
    data = read_json(path, kind)
    contracts.check(kind, data, path)
    return data


def detect_env() -> dict:
    """env_context: the machine, and the GPU as torch sees it when a GPU driver is present."""
    hw: dict[str, Any] = {"accelerator": "cpu", "cuda_version": None, "rocm_version": None, "gpu_count": 0,
                          "gpu_model": None, "gpu_arch": None}
    if not _gpu_driver_present():
        hw["accelerator"] = "cpu" if _version("torch") else "unknown"
    else:
        _detect_gpu_with_torch(hw)
    hw["host_memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    hw["cpu_count"] = os.cpu_count() or 1
    return {
        "environment": {"os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
                        "containerized": Path("/.dockerenv").exists() or Path("/run/.containerenv").exists(),
                        "container_runtime": None},
        "hardware": hw,
    }


def _gpu_driver_present() -> bool:
    """A ROCm or NVIDIA kernel driver is visible; without one torch cannot see a GPU, so we do not
    pay for importing it (~5 s) on CPU hosts."""
    return Path("/dev/kfd").exists() or Path("/proc/driver/nvidia").exists()


def _detect_gpu_with_torch(hw: dict[str, Any]) -> None:
    try:
        import torch

        hip = getattr(torch.version, "hip", None)
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            hw.update(accelerator="amd-rocm" if hip else "nvidia-cuda", rocm_version=hip,
                      cuda_version=None if hip else torch.version.cuda, gpu_count=torch.cuda.device_count(),
                      gpu_model=props.name, memory_gb=round(props.total_memory / 2**30, 1),
                      gpu_arch=getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}")
    except ImportError:
        hw["accelerator"] = "unknown"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_pytorch(env: dict) -> dict:
    torch_v = _version("torch")
    acc = env["hardware"]["accelerator"]
    return {"status": "ok" if torch_v else "failed", "pytorch_version": torch_v,
            "accelerator_tag": {"amd-rocm": "rocm", "nvidia-cuda": "cuda"}.get(acc, "cpu") if torch_v else None,
            "torchvision_version": _version("torchvision"), "torchaudio_version": _version("torchaudio"),
            "verification": {"installed": torch_v is not None, "accelerator": acc},
            "failure_reason": None if torch_v else "torch is not installed"}


def detect_quark() -> dict:
    v = _version("amd-quark")
    from .execute.engines.quark_cli import find_quark_cli

    cli = find_quark_cli()
    return {"status": "ok" if v else "failed", "quark_version": v, "install_source": "pypi",
            "extras_installed": {"cli": cli is not None},
            "verification": {"quark_cli": cli},
            "failure_reason": None if v else "amd-quark is not installed"}


def free_gb(path: Path) -> float | None:
    for p in [path, *path.parents]:
        if p.exists():
            return round(shutil.disk_usage(p).free / 2**30, 2)
    return None


def workspace(model: str, model_path: Path | None, output_dir: Path, trust_remote_code: bool) -> dict:
    parent = output_dir.parent
    return {"model_path": str(model_path or model), "model_source": "local" if model_path else "huggingface_id",
            "trust_remote_code_required": trust_remote_code, "output_dir": str(output_dir),
            "output_dir_exists": output_dir.exists(),
            "output_dir_parent_writable": parent.exists() and os.access(parent, os.W_OK),
            "disk_space_gb_free": free_gb(output_dir), "quark_script_path": None, "required_paths": []}


def session(goal: str, offline: bool, execution_mode: str, workdir: Path) -> dict:
    return {"user_goal": goal, "workflow": "quark-torch-ptq",
            "constraints": {"offline": offline, "execution_mode": execution_mode},
            "env_context_ref": str(workdir / "env_context.json"),
            "workspace_context_ref": str(workdir / "workspace_context.json"),
            "pytorch_install_result_ref": str(workdir / "pytorch_install_result.json"),
            "quark_install_result_ref": str(workdir / "quark_install_result.json"),
            "open_questions": []}


def gather(workdir: Path, given: dict[str, str | None], *, goal: str, offline: bool | None,
           execution_mode: str | None, model: str, model_path: Path | None, output_dir: Path,
           trust_remote_code: bool) -> Contexts:
    """Load the contexts given as files; produce (and write to ``workdir``) the others."""
    loaded = {k: load_context(k, p) for k, p in given.items() if p}
    env = loaded.get("env_context") or _reuse(workdir, "env_context") or detect_env()
    sess = loaded.get("session_context") or session(goal, bool(offline), execution_mode or "batch_execute", workdir)
    constraints = sess.setdefault("constraints", {})
    if offline is not None:
        constraints["offline"] = offline
    if execution_mode is not None:
        constraints["execution_mode"] = execution_mode
    ctx = Contexts(
        session=sess, env=env,
        workspace=loaded.get("workspace_context") or workspace(model, model_path, output_dir, trust_remote_code),
        pytorch=loaded.get("pytorch_install_result") or detect_pytorch(env),
        quark=loaded.get("quark_install_result") or detect_quark(),
    )
    for kind, data in zip(CONTEXT_KINDS, (ctx.session, ctx.env, ctx.workspace, ctx.pytorch, ctx.quark), strict=True):
        contracts.check(kind, data, f"{kind}.json")
        write_json(workdir / f"{kind}.json", data)
    return ctx


def _reuse(workdir: Path, kind: str) -> dict | None:
    """The machine does not change between the gates of one run: reuse the env we detected."""
    path = workdir / f"{kind}.json"
    if path.exists():
        try:
            return load_context(kind, path)
        except Exception:  # noqa: BLE001 - a damaged cache is simply re-detected
            return None
    return None
