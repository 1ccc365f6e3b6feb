"""Data an expert would accept: calibration text checked at the plan step, evaluation kept off it,
windows within the model's context, and runs that know about each other (issue 27)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
import yaml

from quark_ptq_eval.base.calibration_text import OPTIMISTIC, calibration_documents
from quark_ptq_eval.base.context_window import model_context
from quark_ptq_eval.base.errors import ExitCode, UsageError
from tests.reliability.test_reliability_guard import source_guard  # noqa: F401 - arms the session guard early
from tests.reliability.test_reliability_interrupts import Started, engine_log, sigterm_pending


def run_args(model, out, wd, calib, *extra):
    return ["run", model, "-o", out, "--workdir", wd, "--calib-data", calib, "--offline", "--scheme", "int8", *extra]


# ---------------------------------------------------------------- calibration text at the plan step


def test_bad_calibration_text_is_one_sentence(tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text('{"content": "a document", "id": 1}\n', encoding="utf-8")
    with pytest.raises(UsageError) as err:
        calibration_documents(records)
    assert "has no string field 'text' (its fields: content, id)" in err.value.message
    assert "--calib-text-field" in err.value.hint
    assert calibration_documents(records, "content") == ["a document"]
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(UsageError, match=r"is not UTF-8 text \(byte 0xe9 at offset 3\)"):
        calibration_documents(latin)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n", encoding="utf-8")
    with pytest.raises(UsageError, match="holds no text"):
        calibration_documents(empty)


def test_missing_field_and_short_text_stop_at_the_plan_step_before_any_engine(cli, tiny_llama, tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text('{"content": "Some calibration text."}\n', encoding="utf-8")
    res = cli(*run_args(tiny_llama, tmp_path / "o1", tmp_path / "w1", records, "--yes", "--eval-tier", "skip"))
    assert res.rc == ExitCode.USAGE, res.err
    assert "has no string field 'text' (its fields: content)" in res.err and "--calib-text-field" in res.err
    assert "Traceback" not in res.err and not (tmp_path / "w1" / "run_manifest.yaml").exists()

    short = tmp_path / "short.txt"
    short.write_text("Only a few words of calibration text here.\n", encoding="utf-8")
    wd = tmp_path / "w2"
    res = cli(*run_args(tiny_llama, tmp_path / "o2", wd, short, "--yes", "--eval-tier", "skip"))
    assert res.rc == ExitCode.CHECKPOINT, res.err  # --yes alone does not pass it
    plan = json.loads((wd / "quant_plan.json").read_text())
    actual = plan["calibration"]["actual"]
    assert actual["short"] and actual["samples"] == 1 and actual["tokens_per_sample"] == actual["tokens"] < 100
    # the plan's table pads its labels to the longest decision's: the spacing is not the claim
    assert re.search(rf"calibration size +1 sample of {actual['tokens']} tokens \(asked: 128 x 512 tokens\)", res.err)
    assert "gives only 1 sample of" in res.err and "--approve plan" in res.err
    assert not (wd / "run_manifest.yaml").exists() and not engine_log(wd)
    assert json.loads((wd / "run_state.json").read_text())["waiting_for"] == "plan"
    # The field option reads the records; the engine is given a copy with the field it reads.
    res = cli("plan", tiny_llama, "-o", tmp_path / "o3", "--workdir", tmp_path / "w3", "--calib-data", records,
              "--calib-text-field", "content", "--offline", "--yes", "--execution-mode", "plan_only")
    assert res.rc == ExitCode.OK, res.err
    calibration = json.loads((tmp_path / "w3" / "quant_plan.json").read_text())["calibration"]
    assert calibration["source_path"] == str(records) and calibration["text_field"] == "content"
    assert calibration_documents(calibration["path"]) == ["Some calibration text."]


def test_one_text_is_split_and_the_engine_calibrates_only_on_its_part(cli, tiny_llama, corpus, tmp_path):
    wd = tmp_path / "work"
    res = cli("manifest", tiny_llama, "-o", tmp_path / "out", "--workdir", wd, "--calib-data", corpus,
              "--num-calib-samples", "8", "--calib-seq-len", "64", "--scheme", "int8", "--offline", "--yes")
    assert res.rc == ExitCode.OK, res.err
    calibration = json.loads((wd / "quant_plan.json").read_text())["calibration"]
    split = calibration["split"]
    calib_docs = calibration_documents(split["calibration_path"])
    heldout = calibration_documents(split["heldout_path"])
    assert len(heldout) >= 50 and len(calib_docs) + len(heldout) + split["dropped_duplicates"] == split["documents"]
    assert not {" ".join(d.split()) for d in heldout} & {" ".join(d.split()) for d in calib_docs}
    argv = yaml.safe_load((wd / "run_manifest.yaml").read_text())["command"]["argv"]
    assert argv[argv.index("--calib_data") + 1] == split["calibration_path"]
    assert "held out for Tier 1" in res.err


# ---------------------------------------------------------------- overlap with calibration


@pytest.mark.slow
def test_scoring_on_the_calibration_text_qualifies_the_verdict(quantized, corpus, tiny_llama, tmp_path):
    from quark_ptq_eval.base.gates import FlagApprover
    from quark_ptq_eval.evaluate import EvalOptions, evaluate

    model = quantized("int8")
    plan = {"calibration": {"source": "local_file", "path": str(corpus), "num_samples": 16, "seq_len": 128}}
    options = EvalOptions(tier="ppl", eval_data=corpus, seq_len=128, max_windows=4, baseline=tiny_llama)
    report = evaluate(model, options, tmp_path / "same", FlagApprover(all_gates=True), plan=plan)
    assert report.verdict_qualifier == OPTIMISTIC
    assert report.details["calibration_overlap"]["kind"] == "same file"
    text = (tmp_path / "same" / "eval_report.md").read_text()
    assert f"**Verdict: {report.verdict}** **({OPTIMISTIC})**" in text and "Scored on calibration text" in text
    # Other documents of the same kind of text: no overlap, no qualification.
    docs = calibration_documents(corpus)
    calib, other = tmp_path / "calib.jsonl", tmp_path / "other.jsonl"
    calib.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:500]), encoding="utf-8")
    seen = {" ".join(d.split()) for d in docs[:500]}
    other.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[500:] if " ".join(d.split()) not in seen),
                     encoding="utf-8")
    plan["calibration"]["path"] = str(calib)
    report = evaluate(model, EvalOptions(tier="ppl", eval_data=other, seq_len=128, max_windows=4), tmp_path / "held",
                      FlagApprover(all_gates=True), plan=plan)
    assert report.verdict_qualifier is None and "calibration_overlap" not in report.details


# ---------------------------------------------------------------- windows within the context


def test_context_comes_from_positions_or_declared_rope_scaling():
    assert model_context({"max_position_embeddings": 2048}) == (2048, "max_position_embeddings")
    yarn = {"max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 32768}}
    assert model_context(yarn)[0] == 131072 and "yarn x4" in model_context(yarn)[1]
    llama3 = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                                  "original_max_position_embeddings": 8192}}
    assert model_context(llama3) == (131072, "max_position_embeddings")
    assert model_context({"text_config": {"max_position_embeddings": 4096}})[0] == 4096
    assert model_context({}) == (None, "")


def test_windows_beyond_the_context_are_refused_or_clamped(cli, tiny_llama, corpus, catalog, copy_model, tmp_path):
    from quark_ptq_eval.intake import analyze_model
    from quark_ptq_eval.plan import PlanRequest, make_plan

    res = cli(*run_args(tiny_llama, tmp_path / "o", tmp_path / "w", corpus, "--yes", "--eval-tier", "ppl",
                        "--seq-len", "4096"))
    assert res.rc == ExitCode.USAGE, res.err
    assert "--seq-len 4096 is longer than the model's context of 2048 tokens (max_position_embeddings)" in res.err
    assert not (tmp_path / "w" / "quant_plan.json").exists()

    short = copy_model(tiny_llama, "short-context")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    analysis = analyze_model(str(short), offline=True, catalog=catalog)
    env = {"environment": {"os": "Linux", "python": "3.11", "containerized": False},
           "hardware": {"accelerator": "cpu", "gpu_arch": None, "memory_gb": 0, "gpu_count": 0}}

    def plan(**request):
        return make_plan(analysis, env, PlanRequest(scheme="int8", calib_data=str(corpus), **request), catalog,
                         tmp_path / "model_analysis.json", tmp_path / "out")

    clamped = plan()
    assert clamped.calibration.seq_len == 128
    row = next(d for d in clamped.decisions if d["decision"] == "calibration size")
    assert "clamped from the default 512 to the model's context of 128 tokens" in row["reason"]
    with pytest.raises(UsageError, match="--calib-seq-len 256 is longer than the model's context of 128 tokens"):
        plan(calib_seq_len=256)

    from quark_ptq_eval.base.gates import FlagApprover
    from quark_ptq_eval.evaluate import EvalOptions, evaluate

    report = evaluate(short, EvalOptions(tier="ppl", eval_data=corpus, max_windows=2), tmp_path / "ev", FlagApprover())
    assert report.settings["seq_len"] == 128
    assert any("clamped from the default 2048 to the model's context of 128 tokens" in n for n in report.notes)
    with pytest.raises(UsageError, match="--seq-len 256 is longer than the model's context of 128 tokens"):
        evaluate(short, EvalOptions(tier="ppl", eval_data=corpus, seq_len=256), tmp_path / "ev2", FlagApprover())


# ---------------------------------------------------------------- runs that know about each other


def _wait_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.slow
@pytest.mark.usefixtures("source_guard")
def test_two_runs_one_output_then_sigkill_status_and_resume(cli, tiny_llama, corpus, tmp_path):
    """A second run on an output another run is writing exits 5 before its engine starts. The holder
    and its engine are frozen (SIGSTOP) once the engine quantizes, so the second run always meets a held
    claim and the engine cannot finish meanwhile (both were races on a fast host). The holder is then
    SIGKILLed and its engine follows: a fresh engine by PR_SET_PDEATHSIG, a hosted one by the engine host,
    each a SIGTERM. `status` says interrupted, `resume` completes without asking to delete anything,
    and the export is that run's."""
    out = tmp_path / "out"
    extra = ("--num-calib-samples", "600", "--calib-seq-len", "64", "--yes", "--eval-tier", "skip", "--no-load-check")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    win_wd, lose_wd = tmp_path / "a" / "wd", tmp_path / "b" / "wd"
    run = Started(tmp_path / "a", *run_args(tiny_llama, out, win_wd, corpus, *extra))
    run.wait_for(lambda: "[quark-ptq-eval] quantizing" in engine_log(win_wd), "the engine to start quantizing")
    engine = run.any_engine(win_wd)
    assert engine is not None, engine_log(win_wd)
    engine.suspend()
    os.kill(run.proc.pid, signal.SIGSTOP)  # the claim's holder, alive but going nowhere
    try:
        rc, err = Started(tmp_path / "b", *run_args(tiny_llama, out, lose_wd, corpus, *extra)).finish(timeout=300)
    finally:
        os.kill(run.proc.pid, signal.SIGKILL)  # works on a stopped process
    deadline = time.monotonic() + 60
    while not sigterm_pending(engine) and time.monotonic() < deadline:
        time.sleep(0.1)  # a poll bounded by the deadline: the host notices the closed connection within ~1 s
    assert sigterm_pending(engine), "the holder's death sent its engine no SIGTERM"
    engine.resume()  # the queued SIGTERM ends it before it runs on
    engine.wait(timeout=60)
    assert rc == ExitCode.LOCKED, err
    assert f"Another quark-ptq-eval run (work dir {win_wd}, pid {run.proc.pid}) is writing the output" in err
    assert not engine_log(lose_wd) and "Traceback" not in err
    assert _wait_exit(run.proc, 60) == -signal.SIGKILL
    status = cli("status", "--workdir", win_wd)
    assert "interrupted: the process that ran execute is gone" in status.out, status.out
    assert f"continue with: quark-ptq-eval resume --workdir {win_wd}" in status.out
    assert json.loads(cli("status", "--workdir", win_wd, "--json").out)["state"] == "interrupted"

    res = cli("resume", "--workdir", win_wd, "--yes", timeout=600)
    assert res.rc == ExitCode.OK, res.err[-3000:]
    assert "set-aside" not in res.err and not list(tmp_path.glob("out.partial*"))
    observed = yaml.safe_load((win_wd / "run_manifest.yaml").read_text())["observed"]
    assert sorted(observed["files"]) == sorted(p.name for p in out.iterdir() if p.name != "README.md")  # the card comes after execute
    assert sum(p.stat().st_size for p in out.iterdir() if p.name != "README.md") == observed["size_bytes"]
    assert not (tmp_path / ".out.quark-ptq-eval.lock").exists()  # released with the run
    assert "interrupted" not in cli("status", "--workdir", win_wd).out
    assert "runs" not in (yaml.safe_load((lose_wd / "run_manifest.yaml").read_text()) or {}) or \
        not yaml.safe_load((lose_wd / "run_manifest.yaml").read_text())["runs"]  # the other never ran


def test_output_claim_names_its_holder_and_the_final_rename_never_replaces(tmp_path):
    from quark_ptq_eval.base.claims import OutputClaim, claim_path, make_staging, rename_no_replace
    from quark_ptq_eval.base.errors import QpeError, WorkdirLocked

    out = tmp_path / "out"
    with OutputClaim(out, tmp_path / "wd-a"):
        with pytest.raises(WorkdirLocked) as err:
            OutputClaim(out, tmp_path / "wd-b").__enter__()
        assert err.value.exit_code == ExitCode.LOCKED
        assert f"(work dir {tmp_path / 'wd-a'}, pid {os.getpid()}) is writing the output {out}" in err.value.message
    assert not claim_path(out).exists()  # released with the run
    with OutputClaim(out, tmp_path / "wd-b"):  # and free for the next
        pass

    staging = tmp_path / "out.partial"
    make_staging(staging)
    with pytest.raises(WorkdirLocked, match="appeared while this run prepared it"):
        make_staging(staging)
    (staging / "model.safetensors").write_bytes(b"ours")
    out.mkdir()
    (out / "theirs.txt").write_text("another run's export")
    with pytest.raises(QpeError, match="appeared while the engine ran; the verified result stays in"):
        rename_no_replace(staging, out)
    assert (out / "theirs.txt").read_text() == "another run's export" and (staging / "model.safetensors").exists()
    (out / "theirs.txt").unlink()  # an empty directory the user made for the output is taken
    rename_no_replace(staging, out)
    assert (out / "model.safetensors").read_bytes() == b"ours" and not staging.exists()
