"""Faults that must lose nothing: crashes mid-write, full disks, locks, hand-edited artifacts.

Fast: no engine runs here (the engine-killing tests are in test_reliability_interrupts.py).
Models are synthetic (config.json + a valid safetensors header): intake, plan and manifest
only read headers, and every test stops before the engine would start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from quark_ptq_eval.base import fsio
from quark_ptq_eval.base.errors import ExitCode, QpeError, UsageError, WorkdirLocked
from quark_ptq_eval.base.state import LOCK_FILE, STATE_FILE, RunState, WorkdirLock, digest
from tests.reliability.test_reliability_guard import make_model


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*.tmp"))


# --------------------------------------------------------------------------------------------
# Atomic writes: a crash mid-write leaves the previous artifact whole, and no temporary file
# --------------------------------------------------------------------------------------------

OLD = {"version": 1, "steps": {"intake": {"status": "done"}}}
NEW = {"version": 2, "payload": "x" * 100_000}


def _boom(*args, **kwargs):
    raise OSError(5, "Input/output error")


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where, fault, error", [
    ("os.replace", _boom, QpeError),
    ("os.fsync", _boom, QpeError),
    ("os.replace", _interrupt, KeyboardInterrupt),
    ("os.fsync", _interrupt, KeyboardInterrupt),
])
def test_a_crash_mid_write_keeps_the_previous_artifact(tmp_path, monkeypatch, where, fault, error):
    target = tmp_path / "model_analysis.json"
    fsio.write_json(target, OLD)
    monkeypatch.setattr(where, fault)
    with pytest.raises(error) as err:
        fsio.write_json(target, NEW)
    monkeypatch.undo()
    assert json.loads(target.read_text()) == OLD
    assert leftovers(tmp_path) == []
    if error is QpeError:  # one sentence naming the file, not a traceback
        assert err.value.message == f"Could not write {target}: Input/output error."
        assert err.value.exit_code == ExitCode.FAILED


def test_run_state_and_manifest_survive_a_failed_save(tmp_path, monkeypatch):
    from quark_ptq_eval.base.artifacts import RunManifest

    state = RunState(tmp_path, options={"model": "m"}, approvals={"execute": "abc"})
    state.save()
    before = (tmp_path / STATE_FILE).read_bytes()
    (tmp_path / RunManifest.FILENAME).write_text("workflow: kept\n")
    monkeypatch.setattr("os.replace", _boom)
    with pytest.raises(QpeError):
        state.approve("result", "def")
    with pytest.raises(QpeError):
        fsio.atomic_write_text(tmp_path / RunManifest.FILENAME, yaml.safe_dump({"workflow": "new"}))
    monkeypatch.undo()
    assert (tmp_path / STATE_FILE).read_bytes() == before
    assert RunState.load(tmp_path).approvals == {"execute": "abc"}
    assert (tmp_path / RunManifest.FILENAME).read_text() == "workflow: kept\n"
    assert leftovers(tmp_path) == []


def test_power_loss_mid_write_leaves_the_previous_version(tmp_path):
    """SIGKILL between writing the temporary file and the rename (the closest a test gets to
    pulling the plug): the artifact is the old one, whole; the hidden temporary is never read."""
    target = tmp_path / STATE_FILE
    fsio.write_json(target, OLD)
    code = textwrap.dedent(f"""
        import os, signal
        from quark_ptq_eval.base import fsio
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
        fsio.write_json({str(target)!r}, {NEW!r})
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert json.loads(target.read_text()) == OLD
    tmp = leftovers(tmp_path)
    assert len(tmp) == 1 and tmp[0].startswith(f".{STATE_FILE}.")  # hidden, never a valid artifact name
    assert RunState.load(tmp_path).steps == OLD["steps"]


# --------------------------------------------------------------------------------------------
# Disk full / file size limit
# --------------------------------------------------------------------------------------------

FSIZE_CHILD = """
import json, resource, signal, sys
from quark_ptq_eval.base import fsio
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so write() fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    fsio.atomic_write_text(sys.argv[1], "# report\\n" + "line of a long report\\n" * 10_000)
except fsio.DiskFullError as exc:
    print(json.dumps({"message": exc.message, "hint": exc.hint, "code": exc.exit_code}))
"""


def test_file_size_limit_while_writing_a_report(tmp_path):
    report = tmp_path / "validation_report.md"
    report.write_text("# the previous, complete report\n")
    proc = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(report)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    needed = len(("# report\n" + "line of a long report\n" * 10_000).encode())
    assert result["message"] == f"Could not write {report}: File too large ({needed} bytes needed)."
    assert result["hint"].startswith("Lift the file-size limit (ulimit -f; now 4096 bytes)") and result["code"] == ExitCode.FAILED
    assert report.read_text() == "# the previous, complete report\n"
    assert leftovers(tmp_path) == []


def test_cli_under_a_file_size_limit_names_the_file_and_resumes_afterwards(cli, tmp_path):
    model = make_model(tmp_path / "model")
    wd = tmp_path / "work"
    limited = ["bash", "-c", 'trap "" XFSZ; ulimit -f 1; exec "$@"', "limited", sys.executable, "-m",
               "quark_ptq_eval", "intake", str(model), "--workdir", str(wd), "--offline", "-q"]
    proc = subprocess.run(limited, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == ExitCode.FAILED, proc.stderr
    line = proc.stderr.strip().splitlines()[0]
    assert line.startswith(f"error: Could not write {wd}/") and "File too large (" in line and "bytes needed)." in line
    assert "Traceback" not in proc.stderr
    failed_file = Path(line.split("Could not write ", 1)[1].split(": File too large", 1)[0])
    assert not failed_file.exists()  # nothing half-written left under the artifact's name
    assert leftovers(wd) == []
    for f in wd.glob("*.json"):
        json.loads(f.read_text())  # whatever was written before the limit is whole
    res = cli("intake", model, "--workdir", wd, "--offline", "-q")
    assert res.rc == 0, res.err
    assert json.loads((wd / "model_analysis.json").read_text())["model"]["model_type"] == "llama"


# --------------------------------------------------------------------------------------------
# The work dir lock
# --------------------------------------------------------------------------------------------

HOLDER = """
import sys, time
from quark_ptq_eval.base.state import WorkdirLock
with WorkdirLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def hold_lock(workdir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_live_holder_refuses_a_second_run_with_exit_5(cli, tmp_path):
    model = make_model(tmp_path / "model")
    wd = tmp_path / "work"
    holder = hold_lock(wd)
    try:
        with pytest.raises(WorkdirLocked) as err:
            WorkdirLock(wd).__enter__()
        assert f"pid {holder.pid}" in err.value.message
        res = cli("run", model, "-o", tmp_path / "out", "--workdir", wd, "--offline", "--yes")
        assert res.rc == ExitCode.LOCKED, res.err
        assert f"Another quark-ptq-eval run (pid {holder.pid}) is using the work directory {wd}." in res.err
        assert "Traceback" not in res.err
        assert sorted(p.name for p in wd.iterdir()) == [LOCK_FILE]  # the refused run wrote nothing
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_from_a_dead_process_is_taken_over(tmp_path):
    holder = hold_lock(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = tmp_path / LOCK_FILE
    from quark_ptq_eval.base.claims import holder_alive, read_holder

    dead = read_holder(lock.read_text())  # the dead run left its lock file behind: pid + start time
    assert dead["pid"] == holder.pid and dead["start"] and not holder_alive(dead)
    with WorkdirLock(tmp_path):
        mine = read_holder(lock.read_text())
        assert mine["pid"] == os.getpid() and holder_alive(mine)
    assert lock.read_text() == ""


def test_a_symlink_planted_as_the_lock_file_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    wd = tmp_path / "work"
    wd.mkdir()
    (wd / LOCK_FILE).symlink_to(victim)
    with pytest.raises(UsageError) as err:
        WorkdirLock(wd).__enter__()
    assert err.value.message.startswith(f"Cannot use the lock file {wd / LOCK_FILE}")
    assert victim.read_text() == "precious"


# --------------------------------------------------------------------------------------------
# Hand-edited artifacts
# --------------------------------------------------------------------------------------------


def start_args(model: Path, tmp_path: Path, *extra) -> list:
    calib = tmp_path / "calib.txt"
    if not calib.exists():
        calib.write_text("calibration text for the test\n" * 50)
    return ["run", model, "-o", tmp_path / "out", "--workdir", tmp_path / "work", "--calib-data", calib,
            "--num-calib-samples", "8", "--calib-seq-len", "64", "--offline", "--scheme", "int8", *extra]


def _edit_plan(wd: Path, edit) -> None:
    path = wd / "quant_plan.json"
    plan = json.loads(path.read_text())
    edit(plan)
    path.write_text(json.dumps(plan, indent=2))


PLAN_EDITS = {
    "wrong type": (lambda p: p["calibration"].update(num_samples="many"), "calibration/num_samples: 'many' is not of type 'integer'"),
    "out of range": (lambda p: p["calibration"].update(seq_len=0), "calibration/seq_len: 0 is less than the minimum of 1"),
    "missing field": (lambda p: p.pop("global_scheme"), "'global_scheme' is a required property"),
    "not an object": (lambda p: p.update(exclude_layers="lm_head"), "exclude_layers: 'lm_head' is not of type 'array'"),
}


@pytest.mark.parametrize("case", list(PLAN_EDITS))
def test_an_invalid_hand_edited_plan_names_the_field(cli, tmp_path, case):
    edit, expected = PLAN_EDITS[case]
    model = make_model(tmp_path / "model")
    wd = tmp_path / "work"
    res = cli(*start_args(model, tmp_path, "--approve", "intake"))
    assert res.rc == ExitCode.CHECKPOINT and "checkpoint 2 (plan)" in res.err, res.err
    _edit_plan(wd, edit)
    edited = (wd / "quant_plan.json").read_bytes()
    res = cli("resume", "--workdir", wd, "--approve", "plan,execute")
    assert res.rc == ExitCode.USAGE, res.err
    assert f"{wd / 'quant_plan.json'} is not a valid quant_plan:" in res.err and expected in res.err
    assert "Traceback" not in res.err
    assert (wd / "quant_plan.json").read_bytes() == edited  # the user's file is left for them to fix
    assert not (wd / "run_manifest.yaml").exists() and not (tmp_path / "out").exists()


def test_a_plan_that_is_not_json_any_more_is_reported_not_replaced(cli, tmp_path):
    model = make_model(tmp_path / "model")
    wd = tmp_path / "work"
    assert cli(*start_args(model, tmp_path, "--approve", "intake")).rc == ExitCode.CHECKPOINT
    (wd / "quant_plan.json").write_text('{"global_scheme": "int8",')
    res = cli("resume", "--workdir", wd, "--approve", "plan")
    assert res.rc == ExitCode.USAGE and "quant_plan.json is not valid JSON" in res.err, res.err
    assert (wd / "quant_plan.json").read_text() == '{"global_scheme": "int8",'


def test_a_corrupt_run_state_is_one_sentence_not_a_traceback(cli, tmp_path):
    model = make_model(tmp_path / "model")
    wd = tmp_path / "work"
    wd.mkdir()
    (wd / STATE_FILE).write_text('{"approvals": {"execute": ')
    res = cli(*start_args(model, tmp_path, "--yes"))
    assert res.rc == ExitCode.USAGE, res.err
    assert f"The run state {wd / STATE_FILE} is not valid JSON" in res.err and "Traceback" not in res.err
    assert (wd / STATE_FILE).read_text() == '{"approvals": {"execute": '


def _approved_execute_then_blocked(cli, model: Path, tmp_path: Path) -> Path:
    """Approve checkpoints 1-3 for the generated command; a leftover OUT.partial then stops the
    run at the overwrite gate, so the execute approval is on record and nothing has run."""
    wd = tmp_path / "work"
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "leftover.bin").write_bytes(b"partial")
    res = cli(*start_args(model, tmp_path, "--approve", "intake,plan,execute", "--eval-tier", "skip"))
    assert res.rc == ExitCode.CHECKPOINT and "checkpoint overwrite" in res.err, res.err
    state = json.loads((wd / STATE_FILE).read_text())
    manifest = yaml.safe_load((wd / "run_manifest.yaml").read_text())
    assert state["approvals"]["execute"] == digest({"argv": manifest["command"]["argv"], "env": manifest["command"]["env"]})
    return wd


def _tamper(wd: Path, recompute_digest: bool) -> list[str]:
    path = wd / "run_manifest.yaml"
    manifest = yaml.safe_load(path.read_text())
    argv = manifest["command"]["argv"]
    argv[argv.index("--num_calib_data") + 1] = "4096"
    argv += ["--trust_remote_code"]
    if recompute_digest:
        manifest["command"]["digest"] = digest({"argv": argv, "env": manifest["command"]["env"]})
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    return argv


def test_a_command_edited_after_approval_is_not_run_without_a_new_approval(cli, tmp_path):
    model = make_model(tmp_path / "model")
    wd = _approved_execute_then_blocked(cli, model, tmp_path)
    tampered = _tamper(wd, recompute_digest=False)
    res = cli("resume", "--workdir", wd, "--approve", "overwrite")
    assert res.rc == ExitCode.CHECKPOINT, res.err
    assert "was edited after it was generated" in res.err
    assert "Stopped at checkpoint 3 (execute): Shall I run this exact command?" in res.err
    assert yaml.safe_load((wd / "run_manifest.yaml").read_text())["command"]["argv"] == tampered  # kept for review
    assert json.loads((wd / STATE_FILE).read_text())["waiting_for"] == "execute"
    # nothing ran and nothing was moved: no engine log, the leftover partial output untouched
    assert not (wd / "logs").exists() and not (tmp_path / "out").exists()
    assert (tmp_path / "out.partial" / "leftover.bin").read_bytes() == b"partial"


def test_a_tampered_command_with_a_forged_digest_is_replaced_by_the_approved_one(cli, tmp_path):
    model = make_model(tmp_path / "model")
    wd = _approved_execute_then_blocked(cli, model, tmp_path)
    _tamper(wd, recompute_digest=True)
    res = cli("resume", "--workdir", wd)
    # the manifest is regenerated from the approved plan: the approved command passes checkpoint 3
    # and the run stops at the next gate; the forged command is gone
    assert res.rc == ExitCode.CHECKPOINT and "checkpoint overwrite" in res.err, res.err
    argv = yaml.safe_load((wd / "run_manifest.yaml").read_text())["command"]["argv"]
    assert "--trust_remote_code" not in argv and argv[argv.index("--num_calib_data") + 1] == "8"
    assert not (wd / "logs").exists()


def test_nothing_is_created_before_the_execution_gate(cli, tmp_path):
    model = make_model(tmp_path / "model")
    before = time.time()
    res = cli(*start_args(model, tmp_path, "--approve", "intake,plan"))
    assert res.rc == ExitCode.CHECKPOINT and "checkpoint 3 (execute)" in res.err, res.err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    assert not (tmp_path / "work" / "logs").exists()
    assert all(p.stat().st_mtime < before for p in model.iterdir())


# --------------------------------------------------------------------------------------------
# The engine runner: signals stop the whole process group (fast, with a stand-in engine)
# --------------------------------------------------------------------------------------------

STAND_IN_ENGINE = """
import signal, subprocess, sys, time
if sys.argv[1] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stubborn engine: only SIGKILL stops it
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(f"ready {grandchild.pid}", flush=True)
time.sleep(300)
"""


class _SignalOnReady:
    """The runner's echo stream: on the engine's "ready" line, signal our own process."""

    def __init__(self, first: int, second: int | None = None):
        self.first, self.second, self.grandchild = first, second, None

    def write(self, line: str) -> None:
        if line.startswith("ready "):
            self.grandchild = int(line.split()[1])
            if self.second is not None:  # a second Ctrl-C while the group is being stopped
                threading.Timer(0.5, os.kill, (os.getpid(), self.second)).start()
            os.kill(os.getpid(), self.first)


@pytest.mark.parametrize("first, second, mode", [
    (signal.SIGTERM, None, "plain"),
    (signal.SIGINT, None, "plain"),
    (signal.SIGINT, signal.SIGINT, "ignore-term"),
], ids=["SIGTERM", "SIGINT", "second-Ctrl-C-during-cleanup"])
def test_runner_stops_the_engine_and_its_grandchildren(tmp_path, monkeypatch, first, second, mode):
    from quark_ptq_eval.execute import runner

    monkeypatch.setattr(runner._stop_group, "__defaults__", (3.0,))  # grace before SIGKILL
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    echo = _SignalOnReady(first, second)
    log = tmp_path / "logs" / "engine.log"
    result = runner.run_command([sys.executable, "-c", STAND_IN_ENGINE, mode], {}, log, tmp_path, echo=echo)
    assert result.interrupted and echo.grandchild is not None
    assert result.returncode == (-signal.SIGKILL if mode == "ignore-term" else -signal.SIGTERM)
    deadline = time.monotonic() + 10
    while _alive(echo.grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(echo.grandchild), "the engine's own child survived"
    assert log.read_text().rstrip().endswith("=== interrupted: the engine's process group was stopped")
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # our handlers are restored


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_engine_killed_by_sigkill_is_not_blamed_on_the_step_it_was_in():
    from quark_ptq_eval.execute.classify import classify_failure

    failure = classify_failure(["[quark-ptq-eval] quantizing", "[QUARK-INFO]: Quantizing with the configuration"], -9)
    assert failure["cause"] == "memory" and "killed by SIGKILL" in failure["evidence"][0]
    assert classify_failure(["[quark-ptq-eval] quantizing", "Traceback (most recent call last):"], 1)["cause"] == "quantization"
