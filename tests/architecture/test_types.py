"""The type checker is part of the suite (CI runs `make test`): mypy over src/ as pyproject.toml
configures it (strict on the base and the steps), clean. Incremental: the repo's .mypy_cache makes a
rerun take seconds (a cold one, e.g. a fresh CI checkout, about a minute: torch's and transformers'
own annotations are read once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_is_clean_on_src() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mypy found type errors in src/ (run `make lint`):\n{proc.stdout}{proc.stderr}"
    assert "Success: no issues found" in proc.stdout, proc.stdout
