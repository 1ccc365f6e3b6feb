"""The engine killed mid-run, our own process interrupted: nothing is reported as success, the
manifest records what happened, no engine process survives, and a re-run resumes cleanly
(a leftover partial output is set aside only with approval).

Slow: each test starts the real engine (a child process importing quark.torch).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from quark_ptq_eval.base.errors import ExitCode
from tests.reliability.test_reliability_guard import source_guard  # noqa: F401 - arms the session guard early

# the engine as the CLI's own child, found among its children (a hosted engine is the engine host's child)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("source_guard", "fresh_engines")]


def run_args(model, out, wd, corpus, *extra, samples: int = 1500):
    # Enough calibration work (~1,500 short windows) that the engine is still quantizing when the
    # test strikes, even on an idle machine where 8 samples finish in about a second. A run that is
    # resumed to its end pays for every sample again: it takes fewer and is frozen when it strikes.
    return ["run", model, "-o", out, "--workdir", wd, "--calib-data", corpus, "--num-calib-samples", str(samples),
            "--calib-seq-len", "64", "--offline", "--scheme", "int8", *extra]


class Started:
    """``quark-ptq-eval ARGS`` running in the background, its output going to files."""

    def __init__(self, tmp_path: Path, *args):
        self.out, self.err = tmp_path / "cli.stdout", tmp_path / "cli.stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "quark_ptq_eval", *map(str, args)], stdout=out,
                                         stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)

    def engine(self) -> psutil.Process | None:
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return None
        for child in children:
            try:
                if "quark_ptq_eval.execute.quark_api_engine" in child.cmdline():
                    return child
            except psutil.NoSuchProcess:
                continue
        return None

    def any_engine(self, wd: Path) -> psutil.Process | None:
        """The run's engine, forked by an engine host (its log names the pid) or the CLI's own child."""
        hosted = re.search(r"^=== forked by the engine host at .* \(pid (\d+)\)$", engine_log(wd), re.M)
        return psutil.Process(int(hosted.group(1))) if hosted else self.engine()

    def wait_for(self, condition, what: str, timeout: float = 600):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended (rc {self.proc.returncode}) before {what}:\n{self.err.read_text()[-3000:]}")
            time.sleep(0.1)  # a poll, not a wait: the deadline above bounds it
        self.proc.kill()
        pytest.fail(f"timed out waiting for {what}")

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        return self.proc.wait(timeout=timeout), self.err.read_text()


def engine_log(wd: Path) -> str:
    log = wd / "logs" / "engine.log"
    return log.read_text(errors="replace") if log.exists() else ""


def sigterm_pending(proc: psutil.Process) -> bool:
    """A SIGTERM is queued for ``proc`` (a stopped process keeps it until SIGCONT)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines())
    return any(int(fields[k].strip(), 16) & (1 << (signal.SIGTERM - 1)) for k in ("SigPnd", "ShdPnd"))


def live_members(pgid: int) -> list[int]:
    alive = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return alive


def assert_group_gone(pgid: int, within: float = 15) -> None:
    deadline = time.monotonic() + within
    while live_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_members(pgid) == [], f"engine process group {pgid} survived"


def last_run(wd: Path) -> dict:
    return yaml.safe_load((wd / "run_manifest.yaml").read_text())["runs"][-1]


def execute_status(wd: Path) -> str:
    return json.loads((wd / "run_state.json").read_text())["steps"]["execute"]["status"]


def test_engine_killed_mid_run_is_recorded_never_success_and_resumes_with_approval(cli, tiny_llama, corpus, tmp_path):
    wd, out = tmp_path / "work", tmp_path / "out"
    partial = Path(str(out) + ".partial")
    # 200 samples (not 1,500): the resume below quantizes them all again
    run = Started(tmp_path, *run_args(tiny_llama, out, wd, corpus, "--yes", "--eval-tier", "skip", samples=200))
    engine = run.wait_for(run.engine, "the engine process")
    # frozen as soon as it exists, still importing Quark, so the kill finds it mid-run: waiting for its log to say
    # "quantizing" raced a fast host (200 samples quantize and export in ~3 s, and the engine now exits at once)
    engine.suspend()
    run.wait_for(lambda: engine.status() == psutil.STATUS_STOPPED, "the engine to stop")
    assert not out.exists()
    engine.send_signal(signal.SIGKILL)
    rc, err = run.finish()
    assert rc == ExitCode.FAILED, err
    assert "error: The engine failed (memory: exit code -9)" in err and "killed by SIGKILL" in err
    assert "Traceback" not in err
    run_record = last_run(wd)
    assert run_record["status"] == "failed" and run_record["returncode"] == -9
    assert run_record["failure"]["cause"] == "memory"
    assert execute_status(wd) == "failed"
    assert not out.exists()
    st = json.loads(cli("status", "--workdir", wd, "--json").out)
    assert st["steps"]["execute"]["status"] == "failed"

    # The worst leftover: a partial output that looks complete (killed during export). It is
    # never adopted as the result, and moved aside only with the overwrite approval.
    shutil.copytree(tiny_llama, partial, dirs_exist_ok=True)
    planted = sorted(p.name for p in partial.iterdir())
    res = cli("resume", "--workdir", wd, "--yes")
    assert res.rc == ExitCode.CHECKPOINT, res.err
    assert "Stopped at checkpoint overwrite (overwrite)" in res.err and "--approve overwrite" in res.err
    assert sorted(p.name for p in partial.iterdir()) == planted and not out.exists()
    assert execute_status(wd) == "failed"

    res = cli("resume", "--workdir", wd, "--yes", "--overwrite", "--no-load-check")  # the output is not the subject
    assert res.rc == ExitCode.OK, res.err[-3000:]
    aside = list(tmp_path.glob("out.partial.set-aside-*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == planted
    assert not partial.exists()
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "quark"
    runs = yaml.safe_load((wd / "run_manifest.yaml").read_text())["runs"]
    assert [r["status"] for r in runs] == ["failed", "succeeded"]
    assert execute_status(wd) == "succeeded"


@pytest.mark.parametrize("sig, when", [(signal.SIGINT, "quantizing"), (signal.SIGTERM, "engine started")],
                         ids=["SIGINT-while-quantizing", "SIGTERM-while-the-engine-starts"])
def test_interrupting_our_process_stops_the_whole_engine_group(tiny_llama, corpus, tmp_path, sig, when):
    wd, out = tmp_path / "work", tmp_path / "out"
    run = Started(tmp_path, *run_args(tiny_llama, out, wd, corpus, "--yes", "--eval-tier", "skip"))
    if when == "quantizing":
        run.wait_for(lambda: "[quark-ptq-eval] quantizing" in engine_log(wd), "the engine to start quantizing")
    engine = run.wait_for(run.engine, "the engine process")
    pgid = os.getpgid(engine.pid)
    assert pgid == engine.pid != os.getpgid(run.proc.pid)  # its own group: Ctrl-C on a terminal would not reach it
    run.proc.send_signal(sig)
    rc, err = run.finish(timeout=60)
    assert rc == ExitCode.INTERRUPTED, err
    assert "Interrupted; the engine was stopped" in err and "Traceback" not in err
    assert_group_gone(pgid)
    assert last_run(wd)["status"] == "interrupted"
    assert execute_status(wd) == "interrupted"
    assert engine_log(wd).rstrip().endswith("=== interrupted: the engine's process group was stopped")
    assert not out.exists()
