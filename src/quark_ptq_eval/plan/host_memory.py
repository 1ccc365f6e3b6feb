"""What this host has for a plan: RAM (the env_context's, and what /proc/meminfo says is free now),
GPU memory and free disk. The one place the plan reads the running host rather than the analysis."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.sizes import GIB
from quark_ptq_eval.context.preflight import HostEnv


def mem_available_bytes(meminfo: str | None = None) -> int | None:
    """MemAvailable from /proc/meminfo (or the text given): what can be allocated now."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text(encoding="ascii")
        except OSError:
            return None
    m = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M)
    return int(m.group(1)) * 1024 if m else None


def host_capacity(env: HostEnv, output_dir: Path | None, meminfo: str | None = None) -> dict[str, Any]:
    """RAM (the env_context's host_memory_gb), GPU memory (memory_gb x gpu_count) and free disk."""
    from quark_ptq_eval.context.preflight import free_gb

    hw = env["hardware"]
    ram = hw.get("host_memory_gb")
    disk = free_gb(output_dir) if output_dir is not None else None
    return {"ram_bytes": int(ram * GIB) if ram else None, "ram_available_bytes": mem_available_bytes(meminfo),
            "gpu_bytes_per_device": int((hw.get("memory_gb") or 0) * GIB), "gpu_count": hw.get("gpu_count") or 0,
            "disk_free_bytes": int(disk * GIB) if disk is not None else None}

