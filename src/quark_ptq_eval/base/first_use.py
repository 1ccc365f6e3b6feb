"""One-time costs of a fresh machine, seen before they are paid and announced once.

Three things make a first run slow without saying so: Quark compiling its hardware-emulation C++
extension the first time ``quark.torch`` is imported (torch's JIT builds it into the torch
extensions cache), our capability catalog (a child process that imports Quark), and the import of
Quark itself. Everything here is read from files: no torch or Quark import.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from importlib import util
from pathlib import Path

HW_EMULATION_LIB = "quark_hw_emulation_stable_abi"  # Quark 0.13's JIT module name (torch >= 2.10)
LEGACY_HW_EMULATION_LIB = "kernel_ext"  # its pybind11 build on older torch
COMPILE_ESTIMATE = "about 1-2 min on 2 cores, longer on a busy host; GPU builds take a few minutes"
IMPORT_ESTIMATE = "about 15-40 s"
CATALOG_ESTIMATE = "about 30-60 s"
_announced: set[str] = set()


def torch_build() -> dict[str, str | None] | None:
    """torch's version and build (cuda / hip) read from torch/version.py; None when torch is absent."""
    spec = util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text(encoding="utf-8")
    except OSError:
        return None

    def field(name: str) -> str | None:
        m = re.search(rf"^{name}(?:\s*:[^=]*)?\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
        return m.group(1) if m else None

    return {"version": field("__version__"), "cuda": field("cuda"), "hip": field("hip")}


def extensions_root(build: dict[str, str | None] | None = None) -> Path | None:
    """Where torch's JIT puts extensions for this Python and torch build (cpp_extension's rule)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    build = build if build is not None else torch_build()
    if build is None:
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    accel = (f"rocm{build['hip'].replace('.', '')}" if build["hip"]
             else f"cu{build['cuda'].replace('.', '')}" if build["cuda"] else "cpu")
    return base / f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accel}"


def _gpu_visible() -> bool:
    return Path("/dev/kfd").exists() or Path("/proc/driver/nvidia").exists()


def hw_emulation_state() -> tuple[str, Path | None]:
    """("built" | "missing" | "rebuild", build dir): will the next ``import quark.torch`` compile?"""
    quark = util.find_spec("quark")
    if quark is not None and quark.submodule_search_locations:
        pkg = Path(next(iter(quark.submodule_search_locations))) / "torch" / "kernel" / "hw_emulation"
        if any(pkg.glob("_C*.so")) or any((pkg / "lib").glob("*hw_emulation*")):
            return "built", pkg  # a wheel with the extension precompiled
    root = extensions_root()
    if root is None:
        return "missing", None
    for name in (HW_EMULATION_LIB, LEGACY_HW_EMULATION_LIB):
        build_dir = root / name
        if (build_dir / f"{name}.so").is_file():
            ninja = (build_dir / "build.ninja").read_text(encoding="utf-8", errors="replace") \
                if (build_dir / "build.ninja").is_file() else ""
            # Built for the CPU while a GPU is now visible (or the reverse): torch rebuilds it.
            if ninja and ("-DNO_GPU" in ninja) == _gpu_visible():
                return "rebuild", build_dir
            return "built", build_dir
    return "missing", root / HW_EMULATION_LIB


def _log(message: str) -> None:
    print(f"[quark-ptq-eval] {message}", file=sys.stderr, flush=True)


def announce(key: str, message: str, log: Callable[[str], None] | None = None) -> bool:
    """Say ``message`` the first time ``key`` comes up in this process."""
    if key in _announced:
        return False
    _announced.add(key)
    (log or _log)(message)
    return True


def compile_message(where: Path | None) -> str:
    return (f"first use on this machine: Quark compiles its hardware-emulation kernels (C++, once; {COMPILE_ESTIMATE}"
            + (f"; cached in {where}" if where else "") + ")")


def announce_quark_import(purpose: str, log: Callable[[str], None] | None = None) -> None:
    """Before this process first imports ``quark.torch``: the compile (when due) and the import cost."""
    if "quark.torch" in sys.modules:
        return
    state, where = hw_emulation_state()
    if state != "built":
        announce("hw_emulation", compile_message(where), log)
    announce("quark_import", f"importing Quark for {purpose} ({IMPORT_ESTIMATE}, once per run)", log)


def announce_catalog_build(log: Callable[[str], None] | None = None) -> None:
    """Before the capability catalog is built (a child process imports Quark)."""
    state, where = hw_emulation_state()
    extra = f"; {compile_message(where)}" if state != "built" else ""
    announce("catalog", "first use of this Quark install: asking it which schemes, algorithms and templates it "
                        f"supports ({CATALOG_ESTIMATE}, cached afterwards){extra}", log)


def wikitext_cached() -> bool:
    """Is Tier 1's default text (wikitext-2 through `datasets`) on disk, for offline use?"""
    hf_home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE") or hf_home / "datasets")
    hub_cache = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or hf_home / "hub")
    prepared = datasets_cache / "Salesforce___wikitext" / "wikitext-2-raw-v1"
    return prepared.is_dir() or (hub_cache / "datasets--Salesforce--wikitext" / "snapshots").is_dir()

