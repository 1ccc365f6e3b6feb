"""vLLM's serving benchmark (driver.py) as a process started beside the server it will measure.

The driver's import of vLLM costs ~10 s on a CPU host; started when the server starts, it imports while the
server loads (and, beside Tier 3, while lm-eval scores), then waits for ``go``: the timed requests are sent only
once the server is healthy and nothing else is using it. A server that never gets healthy ends it unused.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.evaluate.speed.driver import WAIT_FOR_GO

STOP_TIMEOUT_S = 30
POLL_S = 0.1  # how often a stepped run's log is read for its result line


class RequestsFailed(QpeError):
    """The server answered /health but failed requests of the benchmark: what it returned is no measurement."""


def failed_requests(paths: list[Path]) -> str | None:
    """``8 of 8 requests failed (repeat_1.json, ...)`` from vLLM's own result files, or None when all completed."""
    failed = total = 0
    where = []
    for path in paths:
        result = json.loads(path.read_text(encoding="utf-8"))
        n_failed = int(result.get("failed") or 0)
        failed, total = failed + n_failed, total + n_failed + int(result.get("completed") or 0)
        if n_failed:
            where.append(path.name)
    return f"{failed} of {total} requests failed ({', '.join(where)})" if failed else None


class PendingBench:
    """``argv`` (the driver's exact command) started now, waiting; ``run()`` sends it on, ``cancel()`` ends it."""

    def __init__(self, argv: list[str], out: Path, repeats: int):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.log_path = out, out / "bench.log"
        self.expected = [out / f"repeat_{i}.json" for i in range(1, repeats + 1)]
        for path in [out / "warmup.json", *self.expected]:
            path.unlink(missing_ok=True)  # only files this run writes are read as its results
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                            env={**os.environ, WAIT_FOR_GO: "1"})

    def run(self) -> list[Path]:
        """Measure now (the server is healthy and idle): vLLM's result file of each repeat."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(b"go\n")
            self.process.stdin.close()
        except BrokenPipeError:
            pass  # it ended already (an import that failed): its exit status and log say why, below
        code = self.process.wait()
        missing = [p.name for p in self.expected if not p.is_file()]
        if code != 0 or missing:
            tail = self.log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
            raise QpeError(f"vLLM's serving benchmark failed (exit {code}"
                           + (f", {', '.join(missing)} not written" if missing else "") + f"): "
                           f"{tail[0][:300] if tail else 'no output'}; see {self.log_path}.")
        warmup = self.out / "warmup.json"
        if failed := failed_requests([*([warmup] if warmup.is_file() else []), *self.expected]):
            raise RequestsFailed(f"the server failed requests: {failed}")
        return self.expected

    def one(self, name: str, seed: int, prompts: int, timeout_s: float) -> Path:
        """One run asked for now (driver.py's ``run NAME SEED PROMPTS``) on its healthy, idle server: vLLM's result
        file ``NAME.json``. Raises RequestsFailed when the server failed its requests, QpeError when the driver
        ended or did not answer within ``timeout_s``."""
        import time

        assert self.process.stdin is not None
        path = self.out / f"{name}.json"
        path.unlink(missing_ok=True)
        done = f"QPE_RESULT {name} "
        try:
            self.process.stdin.write(f"run {name} {seed} {prompts}\n".encode())
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # it ended (or was ended, its input closed): said below
        deadline = time.monotonic() + timeout_s
        while done not in self.log_path.read_text(encoding="utf-8", errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
                raise QpeError(f"vLLM's serving benchmark failed at {name} ("
                               + (f"exit {self.process.returncode}" if self.process.returncode is not None else
                                  f"no result after {timeout_s:g} s") + f"): {tail[0][:300] if tail else 'no output'}; "
                               f"see {self.log_path}.")
            time.sleep(POLL_S)
        if failed := failed_requests([path]):
            raise RequestsFailed(f"the server failed requests: {failed}")
        return path

    def cancel(self) -> None:
        """End it if it still waits or runs (its server failed, or the run was stopped): nothing is left behind.
        A driver still waiting has sent no request, so killing it loses nothing."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT_S)
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
