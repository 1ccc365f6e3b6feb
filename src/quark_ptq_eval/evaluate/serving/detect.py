"""Tier 3, detection: is this a ROCm host, is docker reachable, are vLLM and lm_eval[api] here?"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quark_ptq_eval.runtime.vllm_host import HostVllm

LM_EVAL_API_MODULES = ("aiohttp", "tenacity")  # what local-completions needs of lm_eval[api] (tiktoken: OpenAI's own models)


@dataclass
class Environment:
    rocm: bool
    rocm_evidence: list[str]
    docker: bool
    in_container: bool
    vllm: bool
    lm_eval_api: bool
    host_vllm: HostVllm | None = None  # a vLLM named by its interpreter (--vllm-python): Tier 3 runs here

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | ({"host_vllm": self.host_vllm.as_dict()} if self.host_vllm else {})

    @property
    def runnable(self) -> bool:
        """Tier 3 can run on this host: ROCm (container or host), or a vLLM named by its interpreter."""
        return self.rocm or self.host_vllm is not None


def detect_environment() -> Environment:
    evidence = []
    try:
        import torch

        if getattr(torch.version, "hip", None):
            evidence.append(f"torch.version.hip={torch.version.hip}")
    except ImportError:
        pass
    if shutil.which("rocm-smi"):
        evidence.append("rocm-smi on PATH")
    if Path("/opt/rocm").is_dir():
        evidence.append("/opt/rocm present")
    has_gpu_device = Path("/dev/kfd").exists()
    rocm = bool(evidence) and (has_gpu_device or any(e.startswith("torch.version.hip") for e in evidence))
    return Environment(
        rocm=rocm,
        rocm_evidence=evidence,
        docker=_docker_reachable(),
        in_container=_in_container(),
        vllm=importlib.util.find_spec("vllm") is not None,
        lm_eval_api=all(importlib.util.find_spec(m) is not None for m in ("lm_eval", *LM_EVAL_API_MODULES)),
    )


def _docker_reachable() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _in_container() -> bool:
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists():
        return True
    try:
        return bool(re.search(r"docker|containerd|kubepods|libpod", Path("/proc/1/cgroup").read_text()))
    except OSError:
        return False


def choose_runtime(env: Environment, requested: str) -> str:
    if requested in ("docker", "host"):
        return requested
    if env.host_vllm is not None:
        return "host"  # the vLLM the user named
    if env.vllm and (env.in_container or not env.docker):
        return "host"  # already inside a vLLM container, or vLLM installed natively
    return "docker"
