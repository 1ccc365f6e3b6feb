"""The recipe end to end through the CLI: gates, resume, changed decisions, real exports."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from quark_ptq_eval.base.state import WorkdirLock
from tests.fixtures.exports import assert_reloadable_export
from tests.publish.test_model_card import assert_card_matches

pytestmark = pytest.mark.slow


def run_args(model, out, wd, corpus, *extra):
    return ["run", model, "-o", out, "--workdir", wd, "--calib-data", corpus, "--num-calib-samples", "8",
            "--calib-seq-len", "64", "--offline", *extra]


def status(cli, wd):
    res = cli("status", "--workdir", wd, "--json")
    assert res.rc == 0, res.err
    return json.loads(res.out)


def test_each_approval_advances_exactly_one_gate(cli, tiny_llama, corpus, tmp_path):
    wd, out = tmp_path / "work", tmp_path / "out"
    # --no-load-check: the gates are this test's subject (the runs to the end below load and run the exports)
    # --base-model: the Hub id a model run from a local directory has; every `resume` below keeps it
    res = cli(*run_args(tiny_llama, out, wd, corpus, "--scheme", "int8", "--no-load-check", "--base-model", "acme/tiny"))
    assert res.rc == 3, res.err
    assert "checkpoint 1 (intake)" in res.err and "--approve intake" in res.err
    assert "Traceback" not in res.err
    assert status(cli, wd)["waiting_for"] == "intake"
    assert (wd / "model_analysis.json").exists() and not (wd / "quant_plan.json").exists()

    expected = [("intake", "plan"), ("plan", "execute")]
    for approve, waiting in expected:
        res = cli("resume", "--workdir", wd, "--approve", approve)
        assert res.rc == 3, res.err
        assert status(cli, wd)["waiting_for"] == waiting
    # At the execution gate nothing has been created or run.
    assert not out.exists() and not (wd / "logs").exists()
    manifest = (wd / "run_manifest.yaml").read_text()
    assert "quark_api_engine" in manifest

    res = cli("resume", "--workdir", wd, "--approve", "execute")
    assert res.rc == 3 and status(cli, wd)["waiting_for"] == "result"
    assert (out / "model.safetensors").exists() and (wd / "logs" / "engine.log").exists()

    res = cli("resume", "--workdir", wd, "--approve", "result")
    assert res.rc == 3, res.err
    assert status(cli, wd)["waiting_for"] == "eval" and "--eval-tier" in res.err
    assert (wd / "validation_report.md").exists()
    assert "not requested (--no-load-check" in (wd / "validation_report.md").read_text()  # kept across resumes

    res = cli("resume", "--workdir", wd, "--eval-tier", "skip", "--json")
    assert res.rc == 0, res.err
    summary = json.loads(res.out)
    assert summary["status"] == "done" and summary["scheme"] == "int8"
    assert summary["validation"] in ("success", "partial")
    assert summary["size_after_bytes"] < summary["size_before_bytes"]
    for name in ("model_analysis.json", "quant_plan.json", "run_manifest.yaml", "validation_report.md", "quantized_model"):
        assert name in summary["artifacts"]
    st = status(cli, wd)
    assert st["waiting_for"] is None and st["steps"]["execute"]["status"] == "succeeded"
    # the card says the run did not evaluate; after a later `eval`, `card` writes it again with the results
    card = (out / "README.md").read_text()
    assert summary["artifacts"]["model_card"] == str(out / "README.md") and "Not evaluated: evaluation was skipped" in card
    assert summary["upload"] == f"hf upload out {out} ." and "model-index" not in card
    meta = ModelCard.load(out / "README.md").data  # as the Hub reads it
    assert (meta.base_model, meta.base_model_relation) == ("acme/tiny", "quantized")
    res = cli("eval", "--quantized", out, "--source", tiny_llama, "--tier", "ppl", "--eval-data", corpus, "--seq-len", "64",
              "--max-windows", "8", "--baseline", "--workdir", wd, "--yes")
    assert res.rc == 0, res.err[-2000:]
    res = cli("card", out, "--workdir", wd, "--repo-id", "me/tiny-int8")
    assert res.rc == 0 and "hf upload me/tiny-int8" in res.out, res.err
    assert ModelCard.load(out / "README.md").data.base_model == "acme/tiny"  # the run's, kept by `card` too
    assert_card_matches(out, wd)


def test_changed_decision_goes_back_to_the_plan_and_keeps_the_analysis(cli, tiny_llama, corpus, tmp_path):
    wd, out = tmp_path / "work", tmp_path / "out"
    res = cli(*run_args(tiny_llama, out, wd, corpus, "--scheme", "int8", "--approve", "intake,plan"))
    assert res.rc == 3 and status(cli, wd)["waiting_for"] == "execute"
    analysis_mtime = (wd / "model_analysis.json").stat().st_mtime_ns
    res = cli("resume", "--workdir", wd, "--scheme", "int4_wo_128", "--approve", "execute")
    assert res.rc == 3, res.err
    assert status(cli, wd)["waiting_for"] == "plan"  # the plan changed: approve it again
    assert (wd / "model_analysis.json").stat().st_mtime_ns == analysis_mtime
    assert json.loads((wd / "quant_plan.json").read_text())["global_scheme"] == "int4_wo_128"
    assert not out.exists()
    res = cli("resume", "--workdir", wd, "--approve", "plan")
    assert res.rc == 3 and status(cli, wd)["waiting_for"] == "execute"  # the execution gate is never skipped


def test_a_run_state_written_before_the_request_rename_still_resumes(cli, tiny_llama, corpus, tmp_path):
    wd, out = tmp_path / "work", tmp_path / "out"
    res = cli(*run_args(tiny_llama, out, wd, corpus, "--scheme", "int8"))
    assert res.rc == 3 and status(cli, wd)["waiting_for"] == "intake", res.err
    state_file = wd / "run_state.json"
    state = json.loads(state_file.read_text())
    state["options"]["plan"] = state["options"].pop("request")  # as the previous version wrote it
    state_file.write_text(json.dumps(state))
    res = cli("resume", "--workdir", wd, "--approve", "intake")
    assert res.rc == 3 and status(cli, wd)["waiting_for"] == "plan", res.err
    plan = json.loads((wd / "quant_plan.json").read_text())
    assert plan["global_scheme"] == "int8" and plan["calibration"]["num_samples"] == 8  # the stored request, kept
    stored = json.loads(state_file.read_text())["options"]
    assert "plan" not in stored and stored["request"]["scheme"] == "int8"  # rewritten under today's key


def test_tampered_manifest_is_not_run_without_a_new_approval(cli, tiny_llama, corpus, tmp_path):
    wd, out = tmp_path / "work", tmp_path / "out"
    res = cli(*run_args(tiny_llama, out, wd, corpus, "--scheme", "int8", "--approve", "intake,plan,execute",
                        "--execution-mode", "plan_only"))
    assert res.rc == 0, res.err
    manifest = wd / "run_manifest.yaml"
    manifest.write_text(manifest.read_text().replace("- int8", "- fp8"))
    res = cli("execute", "--workdir", wd, "--execution-mode", "batch_execute")
    assert res.rc == 3, res.err
    assert "was edited after it was generated" in res.err
    assert "checkpoint 3" in res.err and not out.exists()


def test_second_run_in_the_same_workdir_is_refused(cli, tiny_llama, corpus, tmp_path):
    wd = tmp_path / "work"
    wd.mkdir()
    with WorkdirLock(wd):
        res = cli(*run_args(tiny_llama, tmp_path / "out", wd, corpus, "--scheme", "int8"))
    assert res.rc == 5 and "Another quark-ptq-eval run" in res.err and "Traceback" not in res.err
    # the lock of a dead holder is stale: the next run takes it
    res = cli(*run_args(tiny_llama, tmp_path / "out", wd, corpus, "--scheme", "int8"))
    assert res.rc == 3


@pytest.mark.parametrize(
    "target, message",
    [
        (lambda m, t: m, "into the source model directory"),
        (lambda m, t: m / "sub", "into the source model directory"),
        (lambda m, t: m.parent, "contains the source model"),
        (lambda m, t: t / "work", "work directory"),
        (lambda m, t: Path("/"), "it is /"),
        (lambda m, t: Path.home(), "home directory"),
        (lambda m, t: ((t / "a-file").write_text("x"), t / "a-file" / "out")[1], "is a file"),
    ],
)
def test_destructive_output_targets_are_refused(cli, copy_model, tiny_llama, corpus, tmp_path, target, message):
    model = copy_model(tiny_llama)
    before = sorted(p.name for p in model.iterdir())
    res = cli(*run_args(model, target(model, tmp_path), tmp_path / "work", corpus, "--yes"))
    assert res.rc == 2, res.err
    assert message in res.err and "Traceback" not in res.err
    assert sorted(p.name for p in model.iterdir()) == before


def test_non_empty_output_needs_overwrite_and_is_set_aside_not_deleted(cli, tiny_llama, corpus, tmp_path):
    wd, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("mine")
    res = cli(*run_args(tiny_llama, out, wd, corpus, "--scheme", "int8", "--yes"))
    assert res.rc == 2 and "is not empty" in res.err and "--overwrite" in res.err
    assert (out / "precious.txt").read_text() == "mine"
    # the run to the end is also the algorithm path's through the CLI (AWQ): its export validates and reloads;
    # 2 calibration samples (not 8: AWQ's search is ~10 s a layer with 8 here), its accuracy is not checked
    res = cli(*run_args(tiny_llama, out, wd, corpus, "--scheme", "int4_wo_128", "--algorithm", "awq", "--yes",
                        "--overwrite", "--eval-tier", "skip", "--card", "none", "--json", "--num-calib-samples", "2"))
    assert res.rc == 0, res.err[-3000:]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("out.set-aside-")]
    assert len(aside) == 1 and (aside[0] / "precious.txt").read_text() == "mine"
    assert_reloadable_export(json.loads(res.out)["validation"], out, wd)
    assert json.loads((wd / "quant_plan.json").read_text())["algorithm"] == "awq"
    assert not (out / "README.md").exists()  # --card none: no card, and no copy of the base model's either
    assert status(cli, wd)["steps"]["card"]["status"] == "none"


def test_missing_model_and_too_little_disk(cli, corpus, tmp_path):
    res = cli(*run_args(tmp_path / "nope", tmp_path / "out", tmp_path / "w1", corpus, "--yes"))
    assert res.rc == 2 and "does not exist" in res.err and "Traceback" not in res.err
    # A (sparse) checkpoint whose header claims ~4 TiB: the output would not fit on this disk.
    big = tmp_path / "huge"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8,
                                                 "vocab_size": 8, "architectures": ["LlamaForCausalLM"]}))
    n = 1 << 40
    header = json.dumps({"model.layers.0.mlp.up_proj.weight": {"dtype": "F32", "shape": [n // 4], "data_offsets": [0, n]}})
    header = header.encode() + b" " * (-len(header) % 8)
    with open(big / "model.safetensors", "wb") as fh:
        fh.write(len(header).to_bytes(8, "little") + header)
        fh.truncate(8 + len(header) + n)
    res = cli(*run_args(big, tmp_path / "out", tmp_path / "w2", corpus, "--yes", "--scheme", "int8"))
    assert res.rc == 2, res.err
    assert "Not enough disk space" in res.err and not (tmp_path / "out").exists()


# Through the CLI, runs to the end that transformers reloads: one per architecture and the algorithm path, each
# folded into a test that runs to the end already (each CLI run pays two `import quark.torch`, ~25 s each):
# llama int4_wo_128 + AWQ (test_non_empty_output_...), qwen3 int8 (test_interactive_mode_...), llama int8 (the
# model card's run, tests/publish/test_model_card.py). The pipeline is the same for every scheme, so the other
# schemes' exports are loaded and validated in-process below.


@pytest.mark.parametrize("scheme", ["fp8", "int4_wo_128", "mxfp4"])
def test_every_scheme_exports_a_model_that_validates_with_the_load_check_and_reloads(tiny_llama, quantized, scheme):
    from transformers import AutoModelForCausalLM

    from quark_ptq_eval.validate import validate_model

    out = quantized(scheme)
    report = validate_model(tiny_llama, out, load_check=True)
    assert report.status in ("success", "partial"), report.one_line()
    assert report.check("load").status == "pass", report.check("load").findings
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 5, 6]])).logits
    assert torch.isfinite(logits).all()


def test_engine_failure_is_classified_and_nothing_is_reported_as_success(cli, copy_model, tiny_llama, corpus, tmp_path):
    model = copy_model(tiny_llama)
    # Valid header, but the tensor bytes are cut short: intake refuses it before anything runs.
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    res = cli(*run_args(model, tmp_path / "out", tmp_path / "w", corpus, "--yes", "--scheme", "int8"))
    assert res.rc == 2 and "truncated" in res.err
    # A model transformers cannot load: the engine fails, the log is kept and the cause named.
    model2 = copy_model(tiny_llama, "broken")
    cfg = json.loads((model2 / "config.json").read_text())
    cfg["hidden_size"] = 96
    (model2 / "config.json").write_text(json.dumps(cfg))
    wd = tmp_path / "w2"
    res = cli(*run_args(model2, tmp_path / "out2", wd, corpus, "--yes", "--scheme", "int8"))
    assert res.rc == 1, res.err
    assert "The engine failed" in res.err and "Full log:" in res.err and "Traceback" not in res.err.split("error:")[-1]
    assert (wd / "logs" / "engine.log").stat().st_size > 0
    assert not (tmp_path / "out2").exists()
    assert "status: failed" in (wd / "run_manifest.yaml").read_text()
    assert os.path.exists(wd / "run_state.json")


def test_help_and_status_do_not_import_torch(cli, tmp_path):
    code = ("import sys, quark_ptq_eval.cli.main as c\n"
            "try:\n    c.main(['--help'])\nexcept SystemExit: pass\n"
            "c.main(['status', '--workdir', sys.argv[1]])\n"
            "print(sorted(m for m in ('torch', 'quark', 'transformers', 'lm_eval', 'datasets') if m in sys.modules))")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_quark_cli_on_cpu_refuses_static_schemes_before_running(cli, tiny_llama, corpus, tmp_path):
    res = cli(*run_args(tiny_llama, tmp_path / "out", tmp_path / "w", corpus, "--scheme", "int8",
                        "--engine", "quark-cli", "--multi-device", "--yes"))
    assert res.rc == 2 and "--engine quark-api" in res.err
    assert not (tmp_path / "out").exists()


def test_interactive_mode_asks_at_every_gate_on_the_terminal(tiny_model, corpus, tmp_path):
    import subprocess
    import sys

    wd, out = tmp_path / "work", tmp_path / "out"
    # qwen3: this run to the end is also the second architecture's through the CLI (its export reloads, below)
    args = [sys.executable, "-m", "quark_ptq_eval",
            *map(str, run_args(tiny_model("qwen3"), out, wd, corpus, "--scheme", "int8")),
            "--execution-mode", "interactive_execute"]
    # intake, plan, execute: yes; result: no -> stops at checkpoint 4 with the output kept.
    proc = subprocess.run(args, input="y\ny\nyes\nn\n", capture_output=True, text=True, timeout=900)
    assert proc.returncode == 3, proc.stderr[-2000:]
    for n in ("Checkpoint 1", "Checkpoint 2", "Checkpoint 3", "Checkpoint 4"):
        assert n in proc.stderr
    assert (out / "model.safetensors").exists()
    # resume: accept the result, then pick "skip" at the evaluation checkpoint
    proc = subprocess.run([sys.executable, "-m", "quark_ptq_eval", "resume", "--workdir", str(wd),
                           "--execution-mode", "interactive_execute"], input="y\nskip\n", capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Which evaluation tier?" in proc.stderr and "Evaluation skipped" in proc.stderr
    assert_reloadable_export(json.loads((wd / "validation_report.json").read_text())["status"], out, wd)
