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
from typing import Any, Required, TypedDict, cast

from quark_ptq_eval.base import contracts
from quark_ptq_eval.base.fsio import read_json, write_json

CONTEXT_KINDS = ("session_context", "env_context", "workspace_context", "pytorch_install_result",
                 "quark_install_result")
EXECUTION_MODES = ("plan_only", "interactive_execute", "batch_execute")


class Hardware(TypedDict, total=False):
    """env_context.json's ``hardware``: what Quark's contract names (the accelerator required), and
    the host's RAM and cores, which detect_env adds (a given file may lack them)."""

    accelerator: Required[str]  # amd-rocm / nvidia-cuda / cpu / unknown
    cuda_version: str | None
    rocm_version: str | None
    gpu_count: int
    gpu_model: str | None
    gpu_arch: str | None
    memory_gb: float  # one GPU's
    host_memory_gb: float
    cpu_count: int


class HostEnv(TypedDict):
    """env_context.json: the machine (os, python, container) and its accelerator, as the plan reads them."""

    environment: dict[str, str | bool | None]
    hardware: Hardware


@dataclass
class Contexts:
    session: dict[str, Any]
    env: HostEnv
    workspace: dict[str, Any]
    pytorch: dict[str, Any]
    quark: dict[str, Any]

    @property
    def offline(self) -> bool:
        return bool(self.session.get("constraints", {}).get("offline"))

    @property
    def execution_mode(self) -> str:
        return str(self.session.get("constraints", {}).get("execution_mode", "batch_execute"))

    @property
    def accelerator(self) -> str:
        return str(self.env["hardware"]["accelerator"])


def load_context(kind: str, path: str | Path) -> dict[str, Any]:
    data: dict[str, Any] = read_json(path, kind)
    contracts.check(kind, data, path)
    return data


def asked_offline(given: dict[str, str | None], offline: bool | None) -> bool:
    """Whether a run is offline, settled before anything resolves a model: ``--offline`` (or the API's
    ``offline``) where given, else the given session context's constraint (as ``gather`` writes it)."""
    if offline is not None:
        return offline
    path = given.get("session_context")
    return bool(path and load_context("session_context", path).get("constraints", {}).get("offline"))


def detect_env() -> HostEnv:
    """env_context: the machine, and the GPU as torch sees it when a GPU driver is present."""
    hw: Hardware = {"accelerator": "cpu", "cuda_version": None, "rocm_version": None, "gpu_count": 0,
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


def _detect_gpu_with_torch(hw: Hardware) -> None:
    try:
        import torch

        hip = getattr(torch.version, "hip", None)
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            hw.update({"accelerator": "amd-rocm" if hip else "nvidia-cuda", "rocm_version": hip,
                       "cuda_version": None if hip else torch.version.cuda, "gpu_count": torch.cuda.device_count(),
                       "gpu_model": props.name, "memory_gb": round(props.total_memory / 2**30, 1),
                       "gpu_arch": getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"})
    except ImportError:
        hw["accelerator"] = "unknown"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_pytorch(env: HostEnv) -> dict[str, Any]:
    torch_v = _version("torch")
    acc = env["hardware"]["accelerator"]
    return {"status": "ok" if torch_v else "failed", "pytorch_version": torch_v,
            "accelerator_tag": {"amd-rocm": "rocm", "nvidia-cuda": "cuda"}.get(acc, "cpu") if torch_v else None,
            "torchvision_version": _version("torchvision"), "torchaudio_version": _version("torchaudio"),
            "verification": {"installed": torch_v is not None, "accelerator": acc},
            "failure_reason": None if torch_v else "torch is not installed"}


def detect_quark() -> dict[str, Any]:
    v = _version("amd-quark")
    from quark_ptq_eval.context.quark_cli import find_quark_cli

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


def workspace(model: str, model_path: Path | None, output_dir: Path, trust_remote_code: bool) -> dict[str, Any]:
    parent = output_dir.parent
    return {"model_path": str(model_path or model), "model_source": "local" if model_path else "huggingface_id",
            "trust_remote_code_required": trust_remote_code, "output_dir": str(output_dir),
            "output_dir_exists": output_dir.exists(),
            "output_dir_parent_writable": parent.exists() and os.access(parent, os.W_OK),
            "disk_space_gb_free": free_gb(output_dir), "quark_script_path": None, "required_paths": []}


def session(goal: str, offline: bool, execution_mode: str, workdir: Path) -> dict[str, Any]:
    return {"user_goal": goal, "workflow": "quark-torch-ptq",
            "constraints": {"offline": offline, "execution_mode": execution_mode},
            "env_context_ref": str(workdir / "env_context.json"),
            "workspace_context_ref": str(workdir / "workspace_context.json"),
            "pytorch_install_result_ref": str(workdir / "pytorch_install_result.json"),
            "quark_install_result_ref": str(workdir / "quark_install_result.json"),
            "open_questions": []}


@dataclass(frozen=True)
class SessionAsk:
    """What the session context records of the user's request (None: not given, the file's or the default)."""

    goal: str = ""
    offline: bool | None = None
    execution_mode: str | None = None


@dataclass(frozen=True)
class WorkspaceAsk:
    """What the workspace context records: the model (as given and as found), the output, remote code."""

    model: str
    model_path: Path | None
    output_dir: Path
    trust_remote_code: bool = False


def gather(workdir: Path, given: dict[str, str | None], asked: SessionAsk, place: WorkspaceAsk) -> Contexts:
    """Load the contexts given as files; produce (and write to ``workdir``) the others."""
    loaded = {k: load_context(k, p) for k, p in given.items() if p}
    known = loaded.get("env_context") or _reuse(workdir, "env_context")
    env = cast(HostEnv, known) if known else detect_env()  # a file read was held against the contract
    offline, execution_mode = asked.offline, asked.execution_mode
    sess = loaded.get("session_context") or session(asked.goal, bool(offline), execution_mode or "batch_execute",
                                                    workdir)
    constraints = sess.setdefault("constraints", {})
    if offline is not None:
        constraints["offline"] = offline
    if execution_mode is not None:
        constraints["execution_mode"] = execution_mode
    ctx = Contexts(
        session=sess, env=env,
        workspace=loaded.get("workspace_context") or workspace(place.model, place.model_path, place.output_dir,
                                                               place.trust_remote_code),
        pytorch=loaded.get("pytorch_install_result") or detect_pytorch(env),
        quark=loaded.get("quark_install_result") or detect_quark(),
    )
    for kind, data in zip(CONTEXT_KINDS, (ctx.session, ctx.env, ctx.workspace, ctx.pytorch, ctx.quark), strict=True):
        contracts.check(kind, data, f"{kind}.json")
        write_json(workdir / f"{kind}.json", data)
    return ctx


def _reuse(workdir: Path, kind: str) -> dict[str, Any] | None:
    """The machine does not change between the gates of one run: reuse the env we detected."""
    path = workdir / f"{kind}.json"
    if path.exists():
        try:
            return load_context(kind, path)
        except Exception:  # noqa: BLE001 - a damaged cache is simply re-detected
            return None
    return None


# ---------------------------------------------------------------- `quark-ptq-eval preflight`: one screen

TESTED_QUARK = "0.13"
LOW_DISK_GB = 20.0  # a 7-8 B model and its quantized copy


@dataclass
class HostCheck:
    """One line of `quark-ptq-eval preflight`: a host capability, ready / missing / informational."""

    topic: str
    ok: bool | None  # True ready, False missing (with a fix), None informational
    status: str
    fix: str = ""

    def line(self) -> str:
        mark = {True: "ok", False: "!!", None: "--"}[self.ok]
        return f"  {mark} {self.topic:<12} {self.status}" + (f"\n{'':18}{'fix' if self.ok is False else 'hint'}: {self.fix}" if self.fix else "")


def host_checks(ctx: Contexts, workdir: Path, deep: bool = False) -> list[HostCheck]:
    """What this host can do, cheapest evidence first; ``deep`` also starts quark-cli and builds the catalog."""
    from quark_ptq_eval.base.first_use import torch_build

    build = torch_build()
    return [_accelerator_check(ctx, build), _torch_check(build), _quark_check(ctx),
            _quark_cli_check(ctx, deep), _one_time_check(deep), _lm_eval_check(), _tier3_check(build),
            _disk_check(workdir), _offline_check(ctx)]


def _accelerator_check(ctx: Contexts, build: dict[str, Any] | None) -> HostCheck:
    hw = ctx.env["hardware"]
    if hw["accelerator"] in ("amd-rocm", "nvidia-cuda"):
        return HostCheck("accelerator", True, f"{hw['accelerator']}: {hw.get('gpu_count')} x {hw.get('gpu_model')} "
                                          f"({hw.get('gpu_arch')}, {hw.get('memory_gb')} GiB)")
    driver = "/dev/kfd" if Path("/dev/kfd").exists() else "/proc/driver/nvidia" if _gpu_driver_present() else None
    if driver:
        return HostCheck("accelerator", False, f"a GPU driver is present ({driver}) but torch sees no GPU",
                     "install the torch build for that driver (ROCm or CUDA) from pytorch.org")
    return HostCheck("accelerator", None, f"CPU only ({hw['cpu_count']} cores, {hw['host_memory_gb']} GiB RAM): "
                                      "quantizes with Quark's Python API; fine for small models")


def _torch_check(build: dict[str, Any] | None) -> HostCheck:
    if build is None:
        return HostCheck("torch", False, "not installed", "pip install torch (the build for your accelerator)")
    kind = f"ROCm {build['hip']}" if build["hip"] else f"CUDA {build['cuda']}" if build["cuda"] else "CPU"
    tv, major_minor = _version("torchvision"), (build["version"] or "").split("+")[0].split(".")[:2]
    want = f"0.{int(major_minor[1]) + 15}" if len(major_minor) == 2 and major_minor[0] == "2" else None
    status = f"{build['version']} ({kind} build); torchvision {tv or 'absent'}"
    if Path("/dev/kfd").exists() and not build["hip"]:
        return HostCheck("torch", False, status + ": not a ROCm build on a ROCm host",
                     "pip install torch from https://download.pytorch.org/whl/rocm<version>")
    if want and (tv is None or not tv.startswith(want + ".")):
        return HostCheck("torch", False, status + f": quark-cli needs torchvision {want}.x with this torch",
                     f"pip install 'torchvision=={want}.*'")
    return HostCheck("torch", True, status)


def _quark_check(ctx: Contexts) -> HostCheck:
    v = ctx.quark.get("quark_version")
    if not v:
        return HostCheck("amd-quark", False, "not installed", f"pip install 'amd-quark[cli]=={TESTED_QUARK}'")
    if v != TESTED_QUARK:
        return HostCheck("amd-quark", None, f"{v} (tested with {TESTED_QUARK}; schemes are read from it)",
                     f"pip install 'amd-quark[cli]=={TESTED_QUARK}' for the tested engine")
    return HostCheck("amd-quark", True, f"{v} (the tested version)")


def _quark_cli_check(ctx: Contexts, deep: bool) -> HostCheck:
    from quark_ptq_eval.base.errors import QpeError
    from quark_ptq_eval.context import quark_cli

    exe = ctx.quark["verification"].get("quark_cli")
    if not exe:
        return HostCheck("quark-cli", False, "not found", "pip install 'amd-quark[cli]' (the CPU path uses "
                                                      "Quark's Python API and does not need it)")
    if deep:
        try:
            quark_cli._run_help()
            return HostCheck("quark-cli", True, f"{exe}: starts (`torch-llm-ptq --help` ran)")
        except QpeError as exc:
            return HostCheck("quark-cli", False, f"{exe}: does not start ({exc.message})",
                         "most often torch and torchvision do not match: reinstall the matching pair")
    cached = Path(quark_cli.default_cache_dir()) / f"quark-cli-{quark_cli.SUBCOMMAND}-flags-{ctx.quark['quark_version']}.json"
    if cached.is_file():
        return HostCheck("quark-cli", True, f"{exe}: started before with this Quark (its --help is cached)")
    return HostCheck("quark-cli", None, f"{exe}: not started yet", "`quark-ptq-eval preflight --deep` starts it (30-60 s)")


def _one_time_check(deep: bool) -> HostCheck:
    from quark_ptq_eval.base import first_use
    from quark_ptq_eval.base.catalog import catalog_built, load_catalog

    if deep:
        load_catalog()  # announces itself; compiles Quark's kernels on the way when due
    state, where = first_use.hw_emulation_state()
    pending = ([] if catalog_built() else [f"the capability catalog ({first_use.CATALOG_ESTIMATE})"]) + (
        [] if state == "built" else [f"Quark's kernel compile ({first_use.COMPILE_ESTIMATE})"])
    if not pending:
        return HostCheck("first use", True, f"paid: catalog cached, Quark kernels built ({where})")
    return HostCheck("first use", None, "still to pay, once: " + "; ".join(pending),
                 "`quark-ptq-eval preflight --deep` pays them now")


def _lm_eval_check() -> HostCheck:
    v = _version("lm_eval")
    if v:
        return HostCheck("Tier 2", True, f"lm-eval {v}")
    return HostCheck("Tier 2", False, "lm-eval is not installed (Tier 1 perplexity still works)",
                 "pip install 'quark-ptq-eval[eval]' (from a clone: pip install '.[eval]')")


def _tier3_check(build: dict[str, Any] | None) -> HostCheck:
    from importlib import util

    evidence = [e for e, present in (("torch ROCm build", bool(build and build["hip"])), ("/dev/kfd", Path("/dev/kfd").exists()),
                                     ("/opt/rocm", Path("/opt/rocm").is_dir()), ("rocm-smi", bool(shutil.which("rocm-smi"))))
                if present]
    runtime = "docker" if shutil.which("docker") else "vllm" if util.find_spec("vllm") else None
    if evidence and runtime:
        return HostCheck("Tier 3", True, f"ROCm ({', '.join(evidence)}) with {runtime}")
    missing = "ROCm" if not evidence else "docker or vllm"
    return HostCheck("Tier 3", None, f"no {missing} here: Tier 3 writes its commands to run later on a ROCm host",
                 "on a ROCm host with docker (or vllm installed) it runs for real")


def _disk_check(workdir: Path) -> HostCheck:
    free = free_gb(workdir)
    status = f"{free} GiB free in {workdir}" if free is not None else f"unknown for {workdir}"
    if free is not None and free < LOW_DISK_GB:
        return HostCheck("disk", False, status, f"a quantized model needs about its size again: free space or point "
                                            f"--workdir/-o at a disk with {LOW_DISK_GB:.0f}+ GiB")
    return HostCheck("disk", True, status)


def _offline_check(ctx: Contexts) -> HostCheck:
    from quark_ptq_eval.base.first_use import wikitext_cached

    env = [k for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE") if os.environ.get(k) == "1"]
    wiki = "wikitext-2 cached" if wikitext_cached() else "wikitext-2 not cached"
    if ctx.offline or env:
        fix = "" if wikitext_cached() else "offline, give local text: --calib-data FILE and --eval-data FILE"
        return HostCheck("offline", None, f"yes ({', '.join(env) or '--offline'}): Hub ids and Hub datasets are "
                                      f"refused; {wiki}", fix)
    return HostCheck("offline", None, f"no: Hub ids and datasets may download (network not probed); {wiki}")


def render_checks(checks: list[HostCheck], workdir: Path) -> str:
    missing = sum(c.ok is False for c in checks)
    head = f"quark-ptq-eval preflight: what this host can do ({missing} missing piece(s))"
    return "\n".join([head, *(c.line() for c in checks), f"context files written to {workdir}"])
