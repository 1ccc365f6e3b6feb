"""Writes that fail (a full disk, a file-size limit, a read-only mount) and state files torn or
emptied: one sentence naming the path and what to free, nothing of the user's touched, the
previous state intact, and `resume` finishing once the space is back.

Each writer is driven alone where it can be (one child process runs them all under the fault);
the export needs the engine, so one real run of the tiny model hits it, and the state files are
then damaged in copies of that finished work dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from quark_ptq_eval.base.errors import ExitCode
from quark_ptq_eval.base.state import STATE_FILE
from tests.reliability.test_reliability_guard import make_model, source_guard  # noqa: F401 - arms the session guard early


def temporaries(*dirs: Path) -> list[str]:
    return sorted(str(p) for d in dirs if d.exists() for p in d.rglob("*.tmp"))


def error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("error:")]


# --------------------------------------------------------------------------------------------
# Each writer alone: the run state, a report, the baseline cache (EFBIG and ENOSPC)
# --------------------------------------------------------------------------------------------

WRITERS_CHILD = textwrap.dedent("""
    import errno, json, os, resource, signal, sys
    from pathlib import Path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from quark_ptq_eval.base import fsio
    from quark_ptq_eval.base.state import RunState
    from quark_ptq_eval.evaluate.ppl.baseline_cache import BaselineCache
    from quark_ptq_eval.validate.report import CheckResult, ValidationReport

    mode, root, model_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # loaded before the limit: reads are not limited
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    windows = torch.randint(0, len(tokenizer), (8, 64))
    cache = BaselineCache(root / "cache")
    key = cache.key_for(model_dir, tokenizer, ["some text"], windows, 64)
    report = ValidationReport(model_dir, root / "out", [CheckResult("md5", notes=["a long note " * 40] * 40)])
    state = RunState(root / "work", options={"model": "m", "note": "x" * 20_000})

    if mode == "efbig":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so write() fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    else:  # a write wrapper: the file system fills after the first kilobyte of a file
        real = os.fdopen
        class Full:
            def __init__(self, fh): self.fh, self.n = fh, 0
            def write(self, data):
                if self.n + len(data) > 1024:
                    self.fh.write(data[: 1024 - self.n]); self.n = 1024
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                self.n += len(data); return self.fh.write(data)
            def __getattr__(self, name): return getattr(self.fh, name)
            def __enter__(self): return self
            def __exit__(self, *exc): self.fh.close()
        os.fdopen = lambda fd, *a, **k: Full(real(fd, *a, **k))

    writers = {"run state": state.save, "validation report": lambda: report.write(root / "work"),
               "baseline cache": lambda: cache.build(key, model, windows, 4, model_dir, log=lambda s: None)}
    results = {}
    for name, write in writers.items():
        try:
            write()
            results[name] = {"raised": None}
        except Exception as exc:
            results[name] = {"raised": type(exc).__name__, "message": getattr(exc, "message", str(exc)),
                             "hint": getattr(exc, "hint", None), "code": getattr(exc, "exit_code", None)}
    results["has_key"] = cache.has(key)
    print(json.dumps(results))
""")


@pytest.mark.parametrize("mode", ["efbig", "enospc"])
def test_each_writer_fails_in_one_sentence_and_keeps_the_previous_file(tmp_path, tiny_llama, mode):
    work = tmp_path / "work"
    work.mkdir()
    (work / STATE_FILE).write_text('{"options": {"model": "previous"}}\n')
    for name in ("validation_report.md", "validation_report.json"):
        (work / name).write_text(f"the previous {name}\n")
    before = {p.name: p.read_bytes() for p in work.iterdir()}
    proc = subprocess.run([sys.executable, "-c", WRITERS_CHILD, mode, str(tmp_path), str(tiny_llama)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    reason = "File too large" if mode == "efbig" else "No space left on device"
    where = {"run state": work / STATE_FILE, "validation report": work / "validation_report.md",
             "baseline cache": None}
    for name, path in where.items():
        got = results[name]
        assert got["raised"] == "DiskFullError" and got["code"] == ExitCode.FAILED, (name, got)
        if path is not None:
            assert got["message"].startswith(f"Could not write {path}: {reason} ("), got
        else:
            assert got["message"].startswith(f"Could not write {tmp_path / 'cache'}/") and "baseline.safetensors" in got["message"]
        assert got["message"].endswith(" bytes needed).") and "\n" not in got["message"]
        wanted = "Lift the file-size limit (ulimit -f; now 4096 bytes)" if mode == "efbig" else "Free some space: at least"
        assert got["hint"].startswith(wanted) and "quark-ptq-eval resume" in got["hint"], got["hint"]
    assert {p.name: p.read_bytes() for p in work.iterdir()} == before  # every previous file whole
    assert results["has_key"] is False  # no half entry a later run would read
    assert temporaries(tmp_path) == []


# --------------------------------------------------------------------------------------------
# The export: the engine itself hits the limit (one real run), then resume once it is lifted
# --------------------------------------------------------------------------------------------

LIMIT = 400 * 1024  # above every file the recipe writes for this run (calibration text ~200 kB), below the export


def _limited():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))


@pytest.fixture(scope="module")
def finished_after_a_full_export(tmp_path_factory, tiny_llama, corpus, cli):
    """A run whose engine failed writing the export (file-size limit), resumed to the end without it."""
    root = tmp_path_factory.mktemp("export-limit")
    wd, out = root / "work", root / "out"
    args = ["run", tiny_llama, "-o", out, "--workdir", wd, "--calib-data", corpus, "--num-calib-samples", "8",
            "--calib-seq-len", "64", "--offline", "--scheme", "int8", "--yes", "--eval-tier", "skip", "--no-load-check"]
    limited = subprocess.run([sys.executable, "-m", "quark_ptq_eval", *map(str, args)], capture_output=True, text=True,
                             timeout=600, stdin=subprocess.DEVNULL, preexec_fn=_limited)
    after = {"runs": yaml.safe_load((wd / "run_manifest.yaml").read_text())["runs"],
             "left": sorted(p.name for p in root.iterdir()), "temporaries": temporaries(wd, root)}
    resumed = cli("resume", "--workdir", wd, "--yes")
    return root, wd, out, (limited, after), resumed


@pytest.mark.slow
@pytest.mark.usefixtures("source_guard")
def test_an_export_over_the_file_size_limit_names_it_and_resumes_once_lifted(finished_after_a_full_export):
    root, wd, out, (limited, after), resumed = finished_after_a_full_export
    assert limited.returncode == ExitCode.FAILED, limited.stderr[-3000:]
    lines = error_lines(limited.stderr)
    # the engine's own traceback is echoed from its log; ours never shows (no frame of the CLI's)
    assert len(lines) == 1 and "quark_ptq_eval/flows/" not in limited.stderr, limited.stderr[-3000:]
    assert lines[0] == f"error: The engine could not write the export into {out}.partial: File too large; " \
                       "the partial export was removed."
    assert "File too large (os error 27)" in after["runs"][0]["failure"]["evidence"][-1]
    assert f"Lift the file-size limit (ulimit -f; now {LIMIT} bytes)" in limited.stderr
    # nothing half-done left: no staging, no output, no temporary, the failure on record
    assert after["left"] == ["work"] and after["temporaries"] == []
    assert [r["status"] for r in after["runs"]] == ["failed"] and after["runs"][0]["failure"]["cause"] == "export"
    assert resumed.rc == ExitCode.OK, resumed.err[-3000:]
    runs = yaml.safe_load((wd / "run_manifest.yaml").read_text())["runs"]
    assert [r["status"] for r in runs] == ["failed", "succeeded"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "quark"
    assert not Path(f"{out}.partial").exists() and not list(root.glob("*set-aside*"))
    assert temporaries(wd, out) == []


@pytest.mark.slow
def test_a_state_lost_after_the_manifest_recorded_success_adopts_the_output(finished_after_a_full_export, cli):
    """The run state's save failed (a full disk, a kill) just after the manifest recorded the verified
    output: resume adopts it from the manifest; the engine does not run again."""
    root, wd, out, _, resumed = finished_after_a_full_export
    assert resumed.rc == ExitCode.OK
    state = json.loads((wd / STATE_FILE).read_text())
    state["steps"]["execute"] = {"status": "running", "command_digest": state["steps"]["execute"]["command_digest"]}
    (wd / STATE_FILE).write_text(json.dumps(state))
    log = (wd / "logs" / "engine.log").read_bytes()
    export = {p.name: p.read_bytes() for p in out.iterdir()}
    res = cli("resume", "--workdir", wd, "--yes")
    assert res.rc == ExitCode.OK, res.err[-3000:]
    assert "Already executed and verified" in res.err
    assert (wd / "logs" / "engine.log").read_bytes() == log
    assert {p.name: p.read_bytes() for p in out.iterdir()} == export
    assert json.loads((wd / STATE_FILE).read_text())["steps"]["execute"]["status"] == "succeeded"


# --------------------------------------------------------------------------------------------
# Damaged state files over a finished run: a sentence, never a traceback, never the engine again
# --------------------------------------------------------------------------------------------

DAMAGE = {
    "run_state.json torn mid-write": (STATE_FILE, lambda b: b[: len(b) // 2], "is not valid JSON"),
    "run_state.json emptied": (STATE_FILE, lambda b: b"", "is not valid JSON"),
    "run_state.json not UTF-8": (STATE_FILE, lambda b: b"\xff\xfe" + b[:40], "cannot be read"),
    "run_state.json a list": (STATE_FILE, lambda b: b"[]", "is damaged: it holds a JSON list"),
    "run_state.json steps of strings": (STATE_FILE, lambda b: b'{"steps": {"execute": "done"}}', "step 'execute' has no status"),
    "run_state.json steps a string": (STATE_FILE, lambda b: b'{"steps": "x"}', "steps is a str, not a dict"),
    "quant_plan.json emptied": ("quant_plan.json", lambda b: b"", "is not valid JSON"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_state_files_stop_status_and_resume_in_one_sentence(finished_after_a_full_export, cli, tmp_path, case):
    root, wd, out, _, resumed = finished_after_a_full_export
    assert resumed.rc == ExitCode.OK
    name, damage, expected = DAMAGE[case]
    copy = tmp_path / "work"
    shutil.copytree(wd, copy)
    target = copy / name
    target.write_bytes(damage(target.read_bytes()))
    damaged = target.read_bytes()
    log = (copy / "logs" / "engine.log").read_bytes()
    export = {p.name: p.read_bytes() for p in out.iterdir()}
    res = cli("status", "--workdir", copy)
    if name == STATE_FILE:  # status reads only the state
        assert res.rc == ExitCode.USAGE and "Traceback" not in res.err, res.err
        assert len(error_lines(res.err)) == 1 and expected in res.err and "nothing was run" in res.err
    else:
        assert res.rc == ExitCode.OK, res.err
    res = cli("resume", "--workdir", copy, "--yes")
    assert res.rc == ExitCode.USAGE and "Traceback" not in res.err, res.err[-3000:]
    assert len(error_lines(res.err)) == 1 and expected in res.err and str(target) in res.err
    assert target.read_bytes() == damaged  # the damaged file is left for the user to see
    assert (copy / "logs" / "engine.log").read_bytes() == log  # the engine never ran again
    assert {p.name: p.read_bytes() for p in out.iterdir()} == export


# --------------------------------------------------------------------------------------------
# A read-only work dir or output location: refused before anything is read or run
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def read_only(directory: Path):
    """Make ``directory`` read-only: a read-only bind mount as root (root ignores modes), else chmod."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True)
    if mounted.returncode != 0 or subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)],
                                                 capture_output=True).returncode != 0:
        if mounted.returncode == 0:
            subprocess.run(["umount", str(directory)], check=False)
        pytest.skip("running as root without a way to mount read-only")
    try:
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


@pytest.mark.parametrize("which", ["work dir", "work dir's parent", "output's parent"])
def test_a_read_only_work_dir_or_output_is_refused_before_anything_runs(cli, tmp_path, which):
    model = make_model(tmp_path / "model")
    ro = tmp_path / "ro"
    wd = {"work dir": ro, "work dir's parent": ro / "work"}.get(which, tmp_path / "work")
    out = ro / "out" if which == "output's parent" else tmp_path / "out"
    with read_only(ro):
        res = cli("run", model, "-o", out, "--workdir", wd, "--offline", "--yes", "--scheme", "int8")
        assert res.rc == ExitCode.USAGE, res.err
        assert len(error_lines(res.err)) == 1 and "Traceback" not in res.err
        if which == "output's parent":
            assert f"error: Cannot create the output directory {out}: {ro} is " in res.err
            assert {p.name for p in wd.iterdir()} <= {".quark-ptq-eval.lock", "run_state.json"}
        else:
            anchor = "it" if wd == ro else f"{ro}, where it would be created,"
            assert f"error: Cannot use the work directory {wd}: {anchor} is " in res.err
        assert "read-only file system" in res.err or "not writable" in res.err
        assert list(ro.iterdir()) == []
        assert not (wd / "model_analysis.json").exists() and not out.exists()


def test_taking_the_work_dir_lock_sweeps_the_temporaries_a_killed_writer_left(tmp_path):
    from quark_ptq_eval.base.state import WorkdirLock

    left = [tmp_path / ".run_state.json.k3x_9q0a.tmp", tmp_path / "calibration_split" / ".calibration.jsonl.ab12cd34.tmp"]
    kept = [tmp_path / "notes.tmp", tmp_path / ".notes.tmp", tmp_path / "a" / "b" / ".deep.ab12cd34.tmp"]
    for p in left + kept:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("half")
    with WorkdirLock(tmp_path):
        assert [p for p in left if p.exists()] == []
    assert all(p.read_text() == "half" for p in kept)  # not ours, or deeper than an artifact's folder
