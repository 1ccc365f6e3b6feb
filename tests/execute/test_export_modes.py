"""The export's files get the mode the user's umask gives (as `cp` would), not the libraries' 0600,
and the output inspection checks it: on a real Quark export of the tiny model."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from quark_ptq_eval.execute.file_modes import apply_umask
from quark_ptq_eval.execute.inspect_output import inspect_output


@pytest.fixture
def umask():
    """``umask(0o022)``: set this process's umask for the test, put back after."""
    before = os.umask(0o022)
    os.umask(before)
    yield os.umask
    os.umask(before)


def modes(root):
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_the_export_gets_the_umasks_modes_and_the_inspection_checks_them(quantized, tmp_path, umask):
    umask(0o022)
    export = tmp_path / "export"
    shutil.copytree(quantized("int8"), export)  # copy2: the modes as the libraries wrote them
    written = modes(export)
    assert written["model.safetensors"] == 0o600  # transformers' / Quark's writer: unreadable by other users
    problems = inspect_output(export)["problems"]
    assert any("model.safetensors (0600)" in p and "umask (0022)" in p for p in problems), problems
    apply_umask(export)
    after = modes(export)
    assert after.pop("export") == 0o755 and set(after.values()) == {0o644}, after
    assert set(after) == set(written) - {"export"}
    assert inspect_output(export)["ok"]

    umask(0o077)  # a user who keeps everything private gets 0600 / 0700, as cp would give them
    assert not inspect_output(export)["ok"]
    apply_umask(export)
    assert set(modes(export).values()) == {0o600, 0o700} and inspect_output(export)["ok"]
