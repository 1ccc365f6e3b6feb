"""The warm engine host (execute/engine_host.py): an engine it forks writes the bytes a fresh engine writes,
is stopped with the run that asked for it, and a command it cannot take as a fresh child would run is started
fresh with the reason in its log. A whole `quark-ptq-eval` command forked by it (QUARK_PTQ_EVAL_HOST_COMMANDS=1)
ends as the fresh command does, and goes with the process that stands in for it. The suite's own runs use this
worker's host (conftest.py's ``engine_host``; the ``cli`` fixture's commands are forked by it too)."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from quark_ptq_eval.execute import engine_host as host_module
from quark_ptq_eval.execute.engine_host import COMMANDS_ENV, HOST_ENV, admission, request_for
from quark_ptq_eval.execute.runner import run_command

ENGINE = [sys.executable, "-m", "quark_ptq_eval.execute.quark_api_engine"]


@pytest.fixture
def host(engine_host) -> Path:
    if engine_host is None:
        pytest.skip("the suite runs without an engine host (QPE_TEST_FRESH_ENGINES)")
    deadline = time.monotonic() + 300
    while not engine_host.exists() and time.monotonic() < deadline:  # it listens once Quark is imported
        time.sleep(0.2)
    return engine_host


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.suffix == ".safetensors"}


def test_a_hosted_engine_writes_the_bytes_of_a_fresh_one(host, quantized, tiny_llama, corpus, tmp_path):
    """The conftest's ``quantized`` export (the engine's main in a process of its own import) against the same
    command forked by the host: the same tensors, byte for byte; the log names the host and the engine's pid."""
    fresh = quantized("int8")
    out = tmp_path / "hosted"
    argv = [*ENGINE, "--model_dir", str(tiny_llama), "--output_dir", str(out), "--quant_scheme", "int8",
            "--calib_data", str(corpus), "--num_calib_data", "16", "--seq_len", "128"]
    result = run_command(argv, {}, tmp_path / "engine.log", tmp_path, echo=None)
    log = (tmp_path / "engine.log").read_text()
    assert result.returncode == 0, log[-3000:]
    assert f"=== forked by the engine host at {host} (pid " in log and "[quark-ptq-eval] done in" in log
    assert _digests(out) == _digests(fresh) and _digests(out)


def test_the_engines_exit_code_and_output_come_back(host, tmp_path):
    """An engine that fails on its arguments: its own code (argparse's 2) and its message, through the host."""
    result = run_command([*ENGINE, "--no-such-flag"], {}, tmp_path / "engine.log", tmp_path, echo=None)
    assert result.returncode == 2 and "forked by the engine host" in (tmp_path / "engine.log").read_text()
    assert result.tail[-1].startswith("python -m quark_ptq_eval.execute.quark_api_engine: error: ")
    assert not any("Warning" in line for line in result.tail)  # as a fresh `python -m` prints it, nothing more


ASKER = """
import json, sys
from pathlib import Path
from quark_ptq_eval.execute.runner import run_command
argv, log = json.loads(sys.argv[1]), Path(sys.argv[2])
r = run_command(argv, {}, log, log.parent, echo=None)
print(json.dumps({"returncode": r.returncode, "interrupted": r.interrupted}))
"""


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "killed"])
def test_the_engine_is_stopped_with_the_run_that_asked_for_it(host, tiny_llama, corpus, tmp_path, how):
    """Ctrl-C on the asking process stops the engine's group (the runner's own stop); a SIGKILLed asker's engine is
    stopped by the host, as PR_SET_PDEATHSIG stops a fresh child. Either way no engine is left, the host serves on."""
    log = tmp_path / "engine.log"
    argv = [*ENGINE, "--model_dir", str(tiny_llama), "--output_dir", str(tmp_path / "out"), "--quant_scheme", "int8",
            "--calib_data", str(corpus), "--num_calib_data", "1500", "--seq_len", "64"]
    asker = subprocess.Popen([sys.executable, "-c", ASKER, json.dumps(argv), str(log)], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    engine = _engine_pid(log, asker)
    os.kill(asker.pid, how)
    out, _ = asker.communicate(timeout=120)
    if how == signal.SIGINT:
        assert json.loads(out) == {"returncode": -signal.SIGTERM, "interrupted": True}
    deadline = time.monotonic() + 60
    while psutil.pid_exists(engine) and psutil.Process(engine).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the engine outlived the run that asked for it"
        time.sleep(0.1)
    again = run_command([*ENGINE, "--no-such-flag"], {}, tmp_path / "again.log", tmp_path, echo=None)
    assert again.returncode == 2 and "forked by the engine host" in (tmp_path / "again.log").read_text()


def _engine_pid(log: Path, asker: subprocess.Popen) -> int:
    """The hosted engine's pid, once it is quantizing."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and asker.poll() is None:
        text = log.read_text() if log.is_file() else ""
        if "[quark-ptq-eval] quantizing" in text:
            return int(text.split("(pid ")[1].split(")")[0])
        time.sleep(0.1)
    raise AssertionError(f"the engine never started quantizing: {log.read_text() if log.is_file() else 'no log'}")


def test_what_it_cannot_take_as_a_fresh_child_would_run_starts_fresh(host, tmp_path):
    """A changed variable the libraries read at import, another interpreter, a module not ours, a limit above the
    host's: declined, and the run starts the engine fresh with the reason in its log."""
    env = {"HF_HUB_OFFLINE": "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1"}
    result = run_command([*ENGINE, "--no-such-flag"], env, tmp_path / "engine.log", tmp_path, echo=None)
    log = (tmp_path / "engine.log").read_text()
    assert result.returncode == 2 and "=== started fresh: the engine host declined: its environment differs from " \
        "the host's in HF_HUB_OFFLINE" in log
    base = request_for(ENGINE, dict(os.environ), tmp_path)
    assert admission(base, os.getuid()) is None
    assert admission({**base, "argv": ["/usr/bin/python3", *ENGINE[1:]]}, os.getuid()).startswith("another interpreter")
    assert admission({**base, "argv": [sys.executable, "-m", "os"]}, os.getuid()) == \
        "not one of our engine modules or commands"
    assert admission(base, os.getuid() + 1) == "another user asked"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    above = {**base, "rlimits": {**base["rlimits"], "RLIMIT_NOFILE": (soft, hard + 1)}}
    assert admission(above, os.getuid()) == "its RLIMIT_NOFILE is above the host's"
    # a host whose imported modules are older than the files on disk (an upgrade, an edit) would mix the two
    stamp = host_module.code_stamp()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host_module, "CODE_AT_START", [(stamp[0], stamp[1] - 1)])
        assert admission(base, os.getuid()) == "our code changed on disk since the host started (restart the host " \
            "to use it)"
    assert os.environ[HOST_ENV] == str(host)


def test_a_second_host_on_a_served_socket_says_so_at_once(host, cli):
    """`quark-ptq-eval engine-host --socket S` where a host serves S: exit 2 in one sentence, before any import
    (the host serving S is untouched and still serves)."""
    res = cli("engine-host", "--socket", host, timeout=60)
    assert res.rc == 2 and res.err.strip() == f"error: {host} is already served by another engine host; stop it " \
        "or name another --socket."
    assert host.exists()


# --- whole commands forked by the host (execute/engine_client.forward_command) ----------------------------------
def _command(args: list, env: dict[str, str], **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "quark_ptq_eval", *map(str, args)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env}, **popen)


def test_a_forwarded_command_ends_as_the_fresh_command_does(host, quantized, tiny_llama, tmp_path):
    """`quark-ptq-eval validate EXPORT` forked by the host and run fresh: the same exit code, the same report, its
    stdout and stderr on the asker's own streams; only the fresh one imports Quark (its announcement), and the
    process that stands in for the forked one spends a fraction of the fresh one's CPU time."""
    export, runs = quantized("int8"), {}
    for mode, env in (("fresh", {COMMANDS_ENV: "0"}), ("forked", {COMMANDS_ENV: "1"})):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = _command(["validate", "--source", tiny_llama, "--quantized", export, "--workdir", tmp_path / mode], env)
        out, err = proc.communicate(timeout=600)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        report = json.loads((tmp_path / mode / "validation_report.json").read_text())
        runs[mode] = (proc.returncode, report, err + out, cpu)
    fresh, forked = runs["fresh"], runs["forked"]
    assert fresh[0] == forked[0] == 0, (fresh[2][-2000:], forked[2][-2000:])

    def checks(doc: dict) -> dict:
        return {name: check["status"] for name, check in doc["checks"].items()}
    assert checks(forked[1]) == checks(fresh[1]) and forked[1]["status"] == fresh[1]["status"] == "success"
    assert "importing Quark for" in fresh[2] and "importing Quark for" not in forked[2]
    assert forked[3] < fresh[3] / 5, (forked[3], fresh[3])


def test_a_forwarded_command_is_interrupted_or_killed_with_its_stand_in(host, tiny_llama, corpus, tmp_path):
    """Ctrl-C (SIGINT) to the stand-in reaches the forked command, which stops as a fresh one does (exit 130,
    "interrupted", its engine stopped); a SIGKILLed stand-in's command is SIGKILLed by the host at once. Either way
    nothing the command started is left, and the host serves on."""
    host_proc = next(p for p in psutil.process_iter(["cmdline"]) if str(host) in " ".join(p.info["cmdline"] or []))
    for how in (signal.SIGINT, signal.SIGKILL):
        wd = tmp_path / f"wd-{how.name}"
        proc = _command(["run", tiny_llama, "-o", tmp_path / f"out-{how.name}", "--workdir", wd, "--scheme", "int8",
                         "--calib-data", corpus, "--num-calib-samples", "1400", "--calib-seq-len", "64",
                         "--offline", "--yes"], {COMMANDS_ENV: "1"})
        deadline = time.monotonic() + 300
        while "[quark-ptq-eval] loading" not in _text(wd / "logs" / "engine.log"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.2)
        forked = set(host_proc.children(recursive=True))
        assert forked, "the command is not the host's child"
        os.kill(proc.pid, how)
        _, err = proc.communicate(timeout=120)
        if how == signal.SIGINT:
            assert proc.returncode == 130 and "error: Interrupted; the engine was stopped" in err, (proc.returncode, err[-2000:])
        else:
            assert proc.returncode == -signal.SIGKILL
        gone, alive = psutil.wait_procs(list(forked), timeout=60)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    again = _command(["--version"], {COMMANDS_ENV: "1"})
    assert again.communicate(timeout=60)[0].startswith("quark-ptq-eval ") and again.returncode == 0


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def test_a_terminal_or_no_opt_in_runs_the_command_here(host, monkeypatch):
    """Never forwarded without QUARK_PTQ_EVAL_HOST_COMMANDS=1, nor with a terminal on stdin (its job control and
    Ctrl-C belong to the process the user started); no host is asked then."""
    from quark_ptq_eval.execute import engine_client

    monkeypatch.setattr(engine_client.socket, "socket", lambda *a: pytest.fail("the host was asked"))
    monkeypatch.setenv(COMMANDS_ENV, "0")
    assert engine_client.forward_command(["--version"]) is None
    monkeypatch.setenv(COMMANDS_ENV, "1")
    monkeypatch.setattr(engine_client.os, "isatty", lambda fd: fd == 0)
    assert engine_client.forward_command(["--version"]) is None


def test_going_offline_reaches_the_hub_libraries_a_fork_has_imported(monkeypatch):
    """A forked command has huggingface_hub and datasets imported already (they read their offline flag at import):
    --offline sets their flags as well as the environment its children inherit."""
    import datasets.config
    import huggingface_hub.constants

    from quark_ptq_eval.base.options import apply_offline

    for module, name in ((huggingface_hub.constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
                         (datasets.config, "HF_DATASETS_OFFLINE")):
        monkeypatch.setattr(module, name, False)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    apply_offline(True)
    assert huggingface_hub.constants.HF_HUB_OFFLINE and huggingface_hub.is_offline_mode()
    assert datasets.config.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
