"""What the installed ``quark-cli torch-llm-ptq`` accepts, read from its own ``--help``.

Every flag we emit must exist in the installed Quark; asking the CLI itself is the only
version-proof source. ``quark-cli`` start-up costs ~30-45 s (it imports torch, quark and its
ONNX commands), so the parsed set is cached on disk per amd-quark version.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from quark_ptq_eval.base.catalog import quark_version
from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.base.fsio import cache_dir, fill_once

_OPTION_LINE = re.compile(r"^ {1,8}(-{1,2}[A-Za-z0-9][\w-]*.*)$")
_FLAG = re.compile(r"(?:^|, )(-{1,2}[A-Za-z0-9][\w-]*)")
SUBCOMMAND = "torch-llm-ptq"


def find_quark_cli() -> str | None:
    """The one place that locates ``quark-cli``: next to this interpreter (the venv we run in),
    else on PATH; None when neither has it."""
    beside = Path(sys.executable).with_name("quark-cli")
    found = str(beside) if beside.is_file() else shutil.which("quark-cli")
    return str(Path(found).absolute()) if found else None


def quark_cli_executable() -> str:
    """``quark-cli`` as find_quark_cli locates it, or QpeError."""
    found = find_quark_cli()
    if not found:
        raise QpeError("quark-cli is not installed.", hint="Install it with `pip install amd-quark[cli]`.")
    return found


def default_cache_dir() -> Path:
    return cache_dir()  # shared with the catalog (catalog.cache_dir)


def quark_cli_flags(cache_dir: Path | None = None) -> set[str]:
    """Option strings (``--model_dir``, ``-h`` ...) of the installed ``quark-cli torch-llm-ptq``."""
    return set(_flags_for(quark_version(), str(cache_dir or default_cache_dir())))


@functools.cache
def _flags_for(version: str, cache_dir: str) -> frozenset[str]:
    cache_file = Path(cache_dir) / f"quark-cli-{SUBCOMMAND}-flags-{version}.json"
    def build(path: Path) -> frozenset[str]:
        flags = frozenset(parse_help_flags(_run_help()))
        _write_cache(path, version, flags)
        return flags

    found: frozenset[str] = fill_once(cache_file, build, _read_cache)  # two commands at once pay one --help (~45 s)
    return found


def parse_help_flags(help_text: str) -> set[str]:
    """Flags from argparse's option listing (the invocation column, not the help prose)."""
    flags: set[str] = set()
    for line in help_text.splitlines():
        match = _OPTION_LINE.match(line)
        if match:
            invocation = re.split(r" {2,}", match.group(1), maxsplit=1)[0]
            flags.update(_FLAG.findall(invocation))
    return flags


def _run_help() -> str:
    # Offline: start-up must never reach a hub just to print its help.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([quark_cli_executable(), SUBCOMMAND, "--help"], capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    if proc.returncode != 0 or "--model_dir" not in proc.stdout:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise QpeError(f"`quark-cli {SUBCOMMAND} --help` failed (exit {proc.returncode}): {tail[0]}")
    return proc.stdout


def _read_cache(cache_file: Path) -> frozenset[str] | None:
    try:
        data = json.loads(cache_file.read_text(encoding="utf-8"))
        flags = data["flags"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: ask the CLI again
    if not isinstance(flags, list) or "--model_dir" not in flags:
        return None
    return frozenset(flags)


def _write_cache(cache_file: Path, version: str, flags: frozenset[str]) -> None:
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"amd_quark": version, "subcommand": SUBCOMMAND, "flags": sorted(flags)}),
                       encoding="utf-8")
        tmp.replace(cache_file)
    except OSError:
        pass  # a read-only cache dir only costs the next caller another --help run
