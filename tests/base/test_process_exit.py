"""exit_now: the exit code and the library exit hooks survive skipping the interpreter's teardown; a command
that leaves a non-daemon thread running is joined as by a plain exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import atexit, sys, tempfile, threading, time
from pathlib import Path
from quark_ptq_eval.base.process_exit import exit_now
out = Path(sys.argv[1])
atexit.register(lambda: (out / "hook").write_text("ran"))
kept = tempfile.TemporaryDirectory(dir=out)  # never cleaned up explicitly: its finalizer runs at exit
(Path(kept.name) / "f").write_text("x")
if sys.argv[2] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done"))).start()
print("buffered, not flushed", end="")
exit_now(5)
"""


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), mode], capture_output=True, text=True,
                          timeout=60)


def test_the_code_the_output_and_the_exit_hooks_survive(tmp_path):
    res = _run(tmp_path, "plain")
    assert res.returncode == 5 and res.stdout == "buffered, not flushed", res.stderr
    assert (tmp_path / "hook").read_text() == "ran"
    assert [p.name for p in tmp_path.iterdir()] == ["hook"]  # the temporary directory's finalizer ran


def test_a_running_non_daemon_thread_is_joined_as_by_a_plain_exit(tmp_path):
    res = _run(tmp_path, "thread")
    assert res.returncode == 5 and (tmp_path / "thread").read_text() == "done", res.stderr
    assert (tmp_path / "hook").read_text() == "ran"
