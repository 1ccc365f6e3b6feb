"""The README's install path, for real: build the wheel, install it into a clean virtual environment
with --no-deps (the declared dependencies already present), then use the installed copy with no
source tree on the path. This is the CI step that keeps "Install" honest (`make test` runs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

CHECK_DEPS = """
import importlib.metadata as md
from packaging.requirements import Requirement
missing = []
for line in md.requires("quark-ptq-eval") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an optional extra
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        missing.append(f"{req.name} (absent)")
        continue
    if not req.specifier.contains(version, prereleases=True):
        missing.append(f"{req.name} {version} not {req.specifier}")
print("missing:", missing)
"""


def _run(argv: list[str | Path], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    """Build from a copy of the project files, so the build leaves nothing in the checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "quark-ptq-eval"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    proc = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                 "--no-index", "-w", tmp / "dist", "."], cwd=src)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheels = list((tmp / "dist").glob("quark_ptq_eval-*.whl"))
    assert len(wheels) == 1
    return wheels[0], proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv that sees the pinned dependencies (a .pth line), never the source tree."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    assert _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=venv.parent).returncode == 0
    py = venv / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=venv).stdout.strip())
    # The project venv's site-packages: its .pth files (our editable install among them) are not run.
    (site / "_pinned_deps.pth").write_text(sysconfig.get_path("purelib") + "\n", encoding="utf-8")
    proc = _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", wheel[0]],
                cwd=venv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return venv


def test_wheel_builds_without_setuptools_warnings(wheel):
    _, log = wheel
    assert "BuildBackendWarning" not in log and "SetuptoolsDeprecationWarning" not in log, log[-3000:]
    import zipfile

    with zipfile.ZipFile(wheel[0]) as zf:
        names = zf.namelist()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "quark_ptq_eval/base/schemas/quant_plan.schema.json" in names  # package data travels
    assert any(n.endswith("entry_points.txt") for n in names)


def test_installed_copy_runs_help_and_validate(installed, tmp_path, quantized, tiny_llama):
    elsewhere = tmp_path / "elsewhere"  # neither the checkout nor the venv: no source tree on the path
    elsewhere.mkdir()
    env = {"PYTHONPATH": "", "PATH": f"{installed / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    where = _run([installed / "bin" / "python", "-c", "import quark_ptq_eval; print(quark_ptq_eval.__file__)"],
                 cwd=elsewhere, env=env)
    assert Path(where.stdout.strip()).resolve().is_relative_to(installed.resolve()), where.stdout + where.stderr
    deps = _run([installed / "bin" / "python", "-c", CHECK_DEPS], cwd=elsewhere, env=env)
    assert deps.stdout.strip() == "missing: []", deps.stdout + deps.stderr

    script = installed / "bin" / "quark-ptq-eval"
    help_out = _run([script, "--help"], cwd=elsewhere, env=env)
    assert help_out.returncode == 0 and "validate" in help_out.stdout and "run" in help_out.stdout

    export = quantized("int8")
    proc = _run([script, "validate", "--source", tiny_llama, "--quantized", export, "--workdir", "reports"],
                cwd=elsewhere, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Validation passed" in proc.stdout
    assert (elsewhere / "reports" / "validation_report.json").is_file()
