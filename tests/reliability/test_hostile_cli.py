"""Hostile inputs through the command line, the way users meet them.

Fast cases (no engine): a hostile checkpoint stops intake with exit 2 and one ``error:`` line;
a non-empty output dir is refused without --overwrite and left untouched. Slow case: the whole
recipe on a model directory whose name is a shell injection and which ships custom code; the
engine runs, and neither the name nor the repository's code is ever executed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from quark_ptq_eval.base.errors import ExitCode
from tests.reliability.test_hostile_inputs import plant_custom_code
from tests.reliability.test_reliability_guard import (  # noqa: F401
    LLAMA_CONFIG,
    make_model,
    source_guard,
    st_bytes,
    tree_checksums,
)


def _symlink_out(model: Path, tmp: Path) -> None:
    (tmp / "elsewhere").mkdir()
    (model / "model.safetensors").rename(tmp / "elsewhere" / "model.safetensors")
    (model / "model.safetensors").symlink_to(tmp / "elsewhere" / "model.safetensors")


def _index_escape(model: Path, tmp: Path) -> None:
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "../../etc/passwd"}}))


HOSTILE_MODELS = {
    "header length 2^63": (lambda m, t: (m / "model.safetensors").write_bytes(st_bytes(b"{}", length=2**63)),
                           "its header claims 9223372036854775808 bytes"),
    "shard symlink outside the model dir": (_symlink_out, "points outside the model directory"),
    "index weight_map with ../": (_index_escape, "names shard '../../etc/passwd' outside the model directory"),
    "config.json with a wrong type": (
        lambda m, t: (m / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "num_hidden_layers": "32"})),
        "config.json field num_hidden_layers must be a non-negative integer"),
}


@pytest.mark.parametrize("case", list(HOSTILE_MODELS))
def test_hostile_checkpoint_stops_intake_with_exit_2_and_one_error_line(cli, tmp_path, case):
    plant, expected = HOSTILE_MODELS[case]
    model = make_model(tmp_path / "model")
    plant(model, tmp_path)
    before = tree_checksums(tmp_path)
    wd = tmp_path / "work"
    res = cli("intake", model, "--workdir", wd, "--offline")
    assert res.rc == ExitCode.USAGE, res.err
    errors = [ln for ln in res.err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], res.err
    assert "Traceback" not in res.err
    assert not (wd / "model_analysis.json").exists()
    assert {k: v for k, v in tree_checksums(tmp_path).items() if not k.startswith("work/")} == before


def test_output_source_dir_is_refused_on_the_command_line(cli, tmp_path):
    model = make_model(tmp_path / "model")
    before = tree_checksums(model)
    res = cli("run", model, "-o", model, "--workdir", tmp_path / "work", "--offline", "--yes")
    assert res.rc == ExitCode.USAGE and "Refusing to write the quantized model into the source model directory" in res.err
    assert tree_checksums(model) == before


def test_non_empty_output_without_overwrite_is_refused_and_untouched(cli, tmp_path):
    model = make_model(tmp_path / "model")
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("mine")
    calib = tmp_path / "calib.txt"
    calib.write_text("text\n" * 100)
    res = cli("run", model, "-o", out, "--workdir", tmp_path / "work", "--calib-data", calib, "--offline",
              "--scheme", "int8", "--yes")
    assert res.rc == ExitCode.USAGE, res.err
    assert f"The output directory {out} is not empty." in res.err and "--overwrite" in res.err
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"] and (out / "precious.txt").read_text() == "mine"
    assert not (tmp_path / "work" / "logs").exists()  # the engine never started


INJECTION = "x; touch PWNED $(touch PWNED) `touch PWNED` 'q\" | touch PWNED & \n modèle"


@pytest.mark.slow
@pytest.mark.usefixtures("source_guard")
def test_injection_named_model_with_custom_code_runs_without_executing_either(cli, tiny_llama, corpus, tmp_path):
    """``x; touch PWNED`` (and $(), backticks, quotes, a newline) as the model and output dir
    names, plus auto_map custom code that would leave a marker if imported: the real engine
    quantizes the model, and no PWNED file or marker appears anywhere."""
    model = tmp_path / INJECTION
    shutil.copytree(tiny_llama, model)
    marker = tmp_path / "REMOTE_CODE_RAN"
    plant_custom_code(model, marker)
    wd, out = tmp_path / f"work {INJECTION}", tmp_path / f"out {INJECTION}"
    res = cli("run", model, "-o", out, "--workdir", wd, "--calib-data", corpus, "--num-calib-samples", "8",
              "--calib-seq-len", "64", "--offline", "--scheme", "int8", "--yes", "--eval-tier", "skip", "--json",
              cwd=tmp_path)
    assert res.rc == ExitCode.OK, res.err[-3000:]
    summary = json.loads(res.out)
    assert summary["validation"] in ("success", "partial")
    analysis = json.loads((wd / "model_analysis.json").read_text())
    assert analysis["model"]["has_custom_code"] is True
    assert any("custom code (auto_map)" in r["message"] for r in analysis["risks"])
    assert json.loads((wd / "quant_plan.json").read_text())["trust_remote_code"] is False
    argv = yaml.safe_load((wd / "run_manifest.yaml").read_text())["command"]["argv"]
    assert argv[argv.index("--model_dir") + 1] == str(model) and "--trust_remote_code" not in argv
    assert (out / "model.safetensors").exists()
    # neither the name nor the repository's code was executed, anywhere we can look
    assert not marker.exists()
    assert list(tmp_path.rglob("PWNED")) == []
    for root in (Path.cwd(), Path.home(), Path("/tmp"), Path(__file__).resolve().parents[2], Path("/")):
        assert not (root / "PWNED").exists(), root
