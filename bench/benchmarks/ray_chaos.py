"""Ray chaos campaign: `compare --ray` and `sweep --ray` on a loopback cluster, faults injected at seeded instants.

A cluster of three nodes on this host, each brought up with `ray start` (its own process group): a head that
holds no cell (0 CPU: the drivers and the GCS) and two workers of 1 CPU each. The reference runs once per flow,
undisturbed: a `compare` of three schemes of the embedded tiny Llama and a `sweep` of two tiny families x one
scheme; each cell's export digests, validation and Tier 1 figures are kept. Each trial then runs one flow (they
alternate) from scratch on a fresh output root, the driver a CLI process as a user starts it, and injects one
fault of a kind the seed draws (every kind in turn, in a seeded order), at an instant drawn over the flow's
reference span:

- ``worker_kill``: SIGKILL of every process of a worker node (the node running a cell then, if any): Ray retries
  the cell on the other node;
- ``node_replace``: a worker node removed (SIGTERM to its processes, SIGKILL after 10 s) and a fresh one added;
- ``driver_kill``: SIGKILL of the driver (its cells go with its job), then the user's re-run (`resume`);
- ``engine_kill``: SIGKILL of one cell's Quark engine, mid-export (once its staging dir holds a file) or early
  in its life: the cell fails at execute and the user's re-run (``--approve overwrite``) sets the partial aside.

A flow that ends with a failed cell or at a gate is run again with the approvals a user gives (at most
``MAX_RESUMES``); then every cell must have, against the reference: the same export bytes (sha256 of every file
but the chosen scheme's model card, which names the run's paths), the same validation status and checks, the
same Tier 1 figures; one engine run recorded succeeded (no cell completed twice); nothing written into the export
after it was validated and evaluated, what was validated being the export's final files (no half-written export
read); no staging dir, claim, temporary file or held lock left; and the report naming every cell Ray retried
(its attempts as recorded by the cells) and no other. The figure is the mismatches: zero.

    heavy .venv/bin/python -m bench.benchmarks.ray_chaos --trials 30 --seed 1

The planted bug (``--plant early-result``; tests/reliability/test_ray_chaos.py): every cell's worker runs the
execute step with its judgement of the engine's run removed, so the export is renamed into place and recorded
succeeded whether or not the engine finished writing it; an engine killed before its export is complete then
leaves a half export as the cell's result, and the campaign must report mismatches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from bench.benchmarks.crash_campaign import _count, leftovers, sha256  # noqa: E402

KINDS = ("worker_kill", "node_replace", "driver_kill", "engine_kill")
FLOWS = ("compare", "sweep")
SCHEMES = {"compare": ["int8", "int4_wo_128", "fp8"], "sweep": ["int8"]}
SWEEP_MODELS = ("llama", "qwen3")
APPROVE = "intake,plan,execute,result"
MAX_RESUMES = 3
RUN_TIMEOUT_S = 900.0
FIGURES = ("status", "perplexity", "kl_mean", "ppl_increase_pct", "top1_agreement", "size_bytes", "bits_per_weight",
           "verdict")
PLANTS = {"early-result": "bench.benchmarks.ray_chaos.plant_early_result"}


def plant_early_result() -> None:
    """The planted bug, run in every worker of the driver's job (Ray's ``worker_process_setup_hook``): the execute
    step no longer judges the engine's run before the export is renamed into place and recorded succeeded."""
    from quark_ptq_eval.execute import step

    step._judge_run = lambda *args, **kwargs: None  # type: ignore[assignment]


# --- the cluster ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_env(extra: dict[str, str] | None = None, driver: bool = False) -> dict[str, str]:
    """What every node and driver runs with: our sources first, offline, one thread per torch (1-CPU nodes).
    A node joins the head only with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1; a driver takes 0, or it looks for its
    raylet at the host's network address instead of the cluster's 127.0.0.1 (bench_ray_compare.py)."""
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    # no engine host (the suite's): a cell's engine is its worker's own child, and goes with its node
    env = {k: v for k, v in os.environ.items() if k != "QUARK_PTQ_EVAL_ENGINE_HOST"}
    return {**env, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0" if driver else "1", "RAY_USAGE_STATS_ENABLED": "0",
            **(extra or {})}


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """``sig`` to the process group led by ``pid`` and to every descendant (a child may have a session of its own)."""
    try:
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    for proc in family:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            proc.send_signal(sig)


@dataclass
class Node:
    name: str
    proc: subprocess.Popen
    node_id: str | None = None


class LoopbackCluster:
    """A head (0 CPU) and ``workers`` worker nodes of 1 CPU, each a `ray start --block` in a process group of its own."""

    def __init__(self, where: Path, workers: int = 2, env: dict[str, str] | None = None):
        self.where, self.env, self.port = where, node_env(env), _free_port()
        self.temp = Path(f"/tmp/qpe-chaos-{os.getpid()}-{self.port}")  # a socket path holds 107 bytes
        self.nodes: dict[str, Node] = {}
        self.counter = 0
        where.mkdir(parents=True, exist_ok=True)
        self.head = self._start("head", ["--head", f"--port={self.port}", "--num-cpus=0", "--include-dashboard=false",
                                         f"--dashboard-port={_free_port()}", f"--temp-dir={self.temp}"])
        try:
            self._wait_gcs()
            self.restore(workers)
        except BaseException:
            self.shutdown()
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start(self, name: str, args: list[str]) -> Node:
        log = open(self.where / f"node-{name}.log", "wb")  # noqa: SIM115 - the node's own, closed with it
        proc = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", *args,
                                 "--node-ip-address=127.0.0.1", f"--object-store-memory={80 * 2**20}",
                                 f"--dashboard-agent-listen-port={_free_port()}", "--disable-usage-stats", "--block"],
                                env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        log.close()
        return Node(name, proc)

    def _wait_gcs(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            if self.head.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise SystemExit(f"the Ray head did not come up; see {self.where / 'node-head.log'}")

    def add_worker(self, tries: int = 6) -> Node:
        """A worker node, once it is registered with the GCS (`ray start` gives a raylet 30 s to register, which a
        busy 2-core host can exceed: such a start is tried again)."""
        for n in range(tries):
            time.sleep(5.0 * n)
            self.counter += 1
            node = self._start(f"w{self.counter}", [f"--address={self.address}", "--num-cpus=1",
                                                    f"--node-manager-port={_free_port()}"])
            self.nodes[node.name] = node
            deadline = time.monotonic() + 180
            while node.proc.poll() is None and time.monotonic() < deadline and not self._is_alive(node):
                time.sleep(0.5)
            if self._is_alive(node):
                return node
            self.kill(node)
        raise SystemExit(f"no worker node came up in {tries} tries; see {self.where}")

    def node_id_of(self, node: Node) -> str | None:
        """The node's Ray id, from its raylet's command line."""
        if node.node_id is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                for proc in psutil.Process(node.proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        for arg in proc.cmdline():
                            if arg.startswith("--node_id="):
                                node.node_id = arg.split("=", 1)[1]
        return node.node_id

    def alive(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.proc.poll() is None]

    def _is_alive(self, node: Node) -> bool:
        """Whether ``node`` runs, registered: `ray start` says so once the GCS has its node info (no driver of
        this process: a test process may be connected to a cluster of its own)."""
        log = self.where / f"node-{node.name}.log"
        return node.proc.poll() is None and "Ray runtime started" in log.read_text(encoding="utf-8", errors="replace")

    def kill(self, node: Node, sig: int = signal.SIGKILL) -> None:
        kill_group(node.proc.pid, sig)
        try:
            node.proc.wait(timeout=10 if sig != signal.SIGKILL else 30)
        except subprocess.TimeoutExpired:
            kill_group(node.proc.pid, signal.SIGKILL)
            node.proc.wait(timeout=30)
        self.nodes.pop(node.name, None)

    def restore(self, workers: int = 2) -> None:
        """Back to ``workers`` live worker nodes between trials."""
        for node in [n for n in self.nodes.values() if n.proc.poll() is not None]:
            self.kill(node)
        while len(self.alive()) < workers:
            self.add_worker()

    def shutdown(self) -> None:
        for driver in DRIVERS:
            if driver.poll() is None:
                kill_group(driver.pid)
        for node in [*self.nodes.values(), self.head]:
            kill_group(node.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=30)
        # anything of this cluster's session still alive (a worker reparented away from its raylet)
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.NoSuchProcess):
                if any(str(self.temp) in a for a in proc.info["cmdline"] or []):
                    proc.kill()
        shutil.rmtree(self.temp, ignore_errors=True)


# --- the flows -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Assets:
    models: dict[str, Path]  # tiny family -> checkpoint
    corpus: Path
    eval_text: Path


def build_assets(root: Path) -> Assets:
    """The embedded tiny Llama and Qwen3 (the tests' families), their corpus and a held-out evaluation text."""
    from quark_ptq_eval.flows.demo import build_corpus, build_tiny_model

    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.txt"
    if not corpus.exists():
        build_corpus(corpus)
    models = {}
    for arch in SWEEP_MODELS:
        models[arch] = root / f"tiny-{arch}"
        if not (models[arch] / "config.json").exists():
            build_tiny_model(models[arch], corpus, arch=arch)
    eval_text = root / "eval.txt"
    if not eval_text.exists():
        text = corpus.read_text(encoding="utf-8")
        eval_text.write_text(text[len(text) // 2: len(text) // 2 + 8_000], encoding="utf-8")
    return Assets(models, corpus, eval_text)


OPTIONS = {"num_calib_samples": 8, "calib_seq_len": 64, "seq_len": 128, "max_windows": 2, "eval_device": "cpu",
           "top_k": 16, "offline": True}


def first_argv(flow: str, assets: Assets, out: Path, address: str) -> list[str]:
    """The flow's first call, as a user types it."""
    if flow == "compare":
        flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in OPTIONS.items()]
        return ["compare", str(assets.models["llama"]), "--schemes", ",".join(SCHEMES["compare"]), "-o", str(out),
                "--calib-data", str(assets.corpus), "--eval-data", str(assets.eval_text), *flags,
                "--approve", APPROVE, f"--ray={address}", "--quiet"]
    grid = out.parent / "grid.yaml"
    grid.write_text(yaml.safe_dump({"models": {a: str(assets.models[a]) for a in SWEEP_MODELS},
                                    "schemes": SCHEMES["sweep"],
                                    "options": {"calib_data": str(assets.corpus), "eval_data": str(assets.eval_text),
                                                **OPTIONS}}), encoding="utf-8")
    return ["sweep", str(grid), "-o", str(out), "--approve", APPROVE, f"--ray={address}", "--quiet"]


def resume_argv(flow: str, out: Path, address: str) -> list[str]:
    """The user's re-run after a stop: the stored options, the approvals again, a kill's partial set aside."""
    if flow == "compare":
        return ["compare", "-o", str(out), "--approve", APPROVE + ",overwrite", f"--ray={address}", "--quiet"]
    return ["sweep", str(out.parent / "grid.yaml"), "-o", str(out), "--approve", APPROVE + ",overwrite",
            f"--ray={address}", "--quiet"]


def comparisons(flow: str, out: Path) -> dict[str, Path]:
    """The flow's comparison roots by a label: the compare's own, or one per swept model."""
    return {"compare": out} if flow == "compare" else {m: out / m for m in SWEEP_MODELS}


def cells(flow: str, out: Path) -> dict[str, tuple[Path, str]]:
    """Every cell of the flow: 'label/scheme' -> (its comparison root, scheme)."""
    return {f"{label}/{s}": (root, s) for label, root in comparisons(flow, out).items() for s in SCHEMES[flow]}


DRIVERS: list[subprocess.Popen] = []  # stopped with the cluster when the campaign is


def start_driver(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "ab") as fh:
        fh.write(f"\n$ quark-ptq-eval {' '.join(argv)}\n".encode())
        fh.flush()
        DRIVERS.append(subprocess.Popen([sys.executable, "-m", "quark_ptq_eval", *argv], stdout=fh, stderr=fh,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True))
    return DRIVERS[-1]


# --- what a finished cell is -----------------------------------------------------------------------------------
@dataclass
class CellResult:
    export: dict[str, str]  # file -> sha256 (the model card left out: it names the run's paths)
    validation: dict[str, Any]  # status and each check's status
    figures: dict[str, Any]  # the comparison's row: Tier 1 figures and status


def export_digests(out: Path) -> dict[str, str]:
    if not out.is_dir():
        return {}
    return {str(p.relative_to(out)): sha256(p) for p in sorted(out.rglob("*")) if p.is_file() and p.name != "README.md"}


def validation_of(workdir: Path) -> dict[str, Any]:
    try:
        report = json.loads((workdir / "validation_report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"status": None}
    return {"status": report.get("status"), "evidence": report.get("evidence")}  # each check's outcome and counts


def row_of(root: Path, scheme: str) -> dict[str, Any]:
    try:
        doc = json.loads((root / "comparison.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return next((r for r in doc.get("schemes") or [] if r.get("scheme") == scheme), {})


def cell_result(root: Path, scheme: str) -> CellResult:
    row = row_of(root, scheme)
    return CellResult(export_digests(root / "models" / scheme), validation_of(root / "work" / scheme),
                      {k: row.get(k) for k in FIGURES})


def same_figures(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for key in FIGURES:
        x, y = a.get(key), b.get(key)
        if isinstance(x, float) and isinstance(y, float):
            if not math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12):
                return False
        elif x != y:
            return False
    return True


# --- a trial ---------------------------------------------------------------------------------------------------
@dataclass
class Trial:
    number: int
    flow: str
    kind: str
    instant: float
    fault: dict[str, Any] = field(default_factory=dict)  # what was struck, when, where
    runs: list[int] = field(default_factory=list)  # each driver call's exit code
    retries: int = 0  # cells' attempts beyond their first, over every driver call
    reported_retried: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    seconds: float = 0.0


def engine_of(staging: Path) -> psutil.Process | None:
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if any("quark_api_engine" in a for a in cmd) and str(staging) in cmd:
            return proc
    return None


def running_cells(flow: str, out: Path) -> list[str]:
    """The cells whose engine runs now (any node: they all live on this host)."""
    return [key for key, (root, s) in cells(flow, out).items() if engine_of(root / "models" / f"{s}.partial")]


def attempts_of(root: Path, scheme: str) -> list[dict[str, Any]]:
    from quark_ptq_eval.flows.compare.ray_cell import read_attempts

    return read_attempts(root / "work" / scheme)


def _wait(driver: subprocess.Popen, seconds: float) -> bool:
    """False when the driver ended first."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        driver.wait(timeout=max(0.0, seconds))
        return False
    return True


def strike(trial: Trial, cluster: LoopbackCluster, driver: subprocess.Popen, out: Path, rng: random.Random,
           t0: float, mode: str | None) -> None:
    """The trial's fault, at its instant (or, for an engine, at its moment after it; ``mode`` for a node kind:
    ``engine``, the node of the first cell whose engine runs from the instant on)."""
    if not _wait(driver, trial.instant - (time.monotonic() - t0)):
        trial.fault = {"struck": False, "why": "the run ended before the instant"}
        return
    at = round(time.monotonic() - t0, 1)
    if trial.kind == "driver_kill":
        kill_group(driver.pid)
        driver.wait()
        trial.fault = {"struck": True, "at": at, "what": "driver", "running": running_cells(trial.flow, out)}
    elif trial.kind in ("worker_kill", "node_replace"):
        while mode == "engine" and driver.poll() is None and not running_cells(trial.flow, out):
            time.sleep(0.05)  # the suite's slice: from the instant on, the first node to run a cell's engine
        at = round(time.monotonic() - t0, 1)
        busy = {a[-1].get("node_id") for key, (root, s) in cells(trial.flow, out).items()
                if key in running_cells(trial.flow, out) and (a := attempts_of(root, s))}
        workers = cluster.alive()
        holding = [n for n in workers if cluster.node_id_of(n) in busy]
        node = rng.choice(holding or workers)
        trial.fault = {"struck": True, "at": at, "what": node.name, "node_id": cluster.node_id_of(node),
                       "held_cell": bool(holding)}
        cluster.kill(node, signal.SIGKILL if trial.kind == "worker_kill" else signal.SIGTERM)
        if trial.kind == "node_replace":  # another node joins once the removed one's processes are gone
            trial.fault["added"] = cluster.add_worker().name
    else:
        _strike_engine(trial, driver, out, rng, t0, mode or rng.choice(("export", "early")))


def _strike_engine(trial: Trial, driver: subprocess.Popen, out: Path, rng: random.Random, t0: float,
                   mode: str) -> None:
    """SIGKILL of one cell's engine: the first cell to start its engine from the instant on; ``export``: once its
    staging dir holds a file, ``early``: 0.5-3 s into its life (before it writes)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    target = None
    while target is None and driver.poll() is None and time.monotonic() < deadline:
        busy = running_cells(trial.flow, out)
        target = rng.choice(busy) if busy else None
        time.sleep(0.05)
    if target is None:
        trial.fault = {"struck": False, "why": "no engine ran after the instant"}
        return
    root, scheme = cells(trial.flow, out)[target]
    staging = root / "models" / f"{scheme}.partial"
    engine = engine_of(staging)
    if mode == "early":
        time.sleep(rng.uniform(0.5, 3.0))
    while engine is not None and engine.is_running() and mode == "export" and not any(staging.glob("*")):
        time.sleep(0.005)
    written = sorted(p.name for p in staging.glob("*")) if staging.is_dir() else []
    if engine is None or not engine.is_running():
        trial.fault = {"struck": False, "why": f"{target}'s engine ended first", "cell": target}
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        engine.kill()
    trial.fault = {"struck": True, "at": round(time.monotonic() - t0, 1), "what": f"engine of {target}",
                   "cell": target, "mode": mode, "staging_held": written}


def run_trial(number: int, flow: str, kind: str, span: float, refs: dict[str, CellResult], cluster: LoopbackCluster,
              assets: Assets, where: Path, rng: random.Random, plant: str | None = None,
              engine_mode: str | None = None, instant: float | None = None) -> Trial:
    """One trial: ``instant`` (seconds after the driver's start) overrides the seeded draw over ``span``."""
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    out, log = where / "out", where / "driver.log"
    drawn = round(rng.uniform(0.05, 0.8) * span, 1)
    trial = Trial(number, flow, kind, drawn if instant is None else instant)
    env = node_env(_plant_env(plant), driver=True)
    t0 = time.monotonic()
    driver = start_driver(first_argv(flow, assets, out, cluster.address), log, env)
    strike(trial, cluster, driver, out, rng, t0, engine_mode)
    rc = _finish(driver)
    trial.runs.append(rc)
    while len(trial.runs) <= MAX_RESUMES and (rc != 0 or not _all_evaluated(flow, out)):
        cluster.restore()  # the user's cluster, whole again before the re-run
        rc = _finish(start_driver(resume_argv(flow, out, cluster.address), log, env))
        trial.runs.append(rc)
    cluster.restore()
    if rc != 0:
        trial.mismatches.append(f"the flow did not finish after {len(trial.runs)} runs (exit {rc}); see {log}")
    trial.mismatches += check(flow, out, refs, trial)
    trial.seconds = round(time.monotonic() - t0, 1)
    if not trial.mismatches:
        shutil.rmtree(where, ignore_errors=True)  # kept for inspection only when something differs
    return trial


def _plant_env(plant: str | None) -> dict[str, str]:
    if plant is None:
        return {}
    hook = {"runtime_env": {"worker_process_setup_hook": PLANTS[plant]}}
    return {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(hook)}


def _finish(driver: subprocess.Popen) -> int:
    try:
        return driver.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_group(driver.pid)
        driver.wait()
        return -9


def _all_evaluated(flow: str, out: Path) -> bool:
    return all(row_of(root, s).get("status") == "evaluated" for root, s in cells(flow, out).values())


def check(flow: str, out: Path, refs: dict[str, CellResult], trial: Trial) -> list[str]:
    """Every difference between the trial's end state and the undisturbed run's, cell by cell."""
    problems: list[str] = []
    for key, (root, scheme) in cells(flow, out).items():
        ref, got = refs[f"{flow}:{key}"], cell_result(root, scheme)
        model, wd = root / "models" / scheme, root / "work" / scheme
        if got.export != ref.export:
            differ = sorted(f for f in set(got.export) | set(ref.export) if got.export.get(f) != ref.export.get(f))
            problems.append(f"{key}: export differs from the undisturbed run's ({', '.join(differ) or 'no export'})")
        if got.validation != ref.validation:
            problems.append(f"{key}: validation {got.validation} != undisturbed {ref.validation}")
        if not same_figures(got.figures, ref.figures):
            problems.append(f"{key}: Tier 1 {got.figures} != undisturbed {ref.figures}")
        problems += [f"{key}: {p}" for p in _completed_once(wd) + _read_whole(model, wd) + leftovers(model, wd)]
        problems += [f"{key}: {p}" for p in _names_retries(root, scheme, trial, key)]
    return problems


def _completed_once(wd: Path) -> list[str]:
    try:
        runs = yaml.safe_load((wd / "run_manifest.yaml").read_text(encoding="utf-8")).get("runs") or []
    except (OSError, yaml.YAMLError, AttributeError):
        return ["no readable run manifest"]
    done = sum(r.get("status") == "succeeded" for r in runs)
    return [] if done == 1 else [f"its engine completed {done} times ({[r.get('status') for r in runs]})"]


def _read_whole(model: Path, wd: Path) -> list[str]:
    """What validation and Tier 1 read was the export's final bytes: nothing of the export written after their
    reports, and the engine's verified facts (files, size) those of the final export."""
    problems = []
    files = [p for p in model.rglob("*") if p.is_file() and p.name != "README.md"] if model.is_dir() else []
    last = max((p.stat().st_mtime for p in files), default=0.0)
    for report in ("validation_report.json", "eval_results.json"):
        path = wd / report
        if not path.is_file():
            problems.append(f"no {report}")
        elif path.stat().st_mtime < last:
            problems.append(f"the export was written after its {report}")
    with contextlib.suppress(OSError, ValueError):
        validated = json.loads((wd / "validation_report.json").read_text(encoding="utf-8")).get("quantized_model_dir")
        if not validated or Path(validated).resolve() != model.resolve():
            problems.append(f"validation read {validated}, not the export {model}")
    try:
        runs = yaml.safe_load((wd / "run_manifest.yaml").read_text(encoding="utf-8")).get("runs") or []
    except (OSError, yaml.YAMLError, AttributeError):
        runs = []
    verified = next((r.get("observed") or {} for r in reversed(runs) if r.get("status") == "succeeded"), {})
    size = sum(p.stat().st_size for p in files if p.parent == model)
    if verified and (sorted(verified.get("files") or []) != sorted(p.name for p in model.iterdir() if p.is_file()
                                                                   and p.name != "README.md")
                     or verified.get("size_bytes") not in (size, None)):
        problems.append(f"the verified export ({verified.get('files')}, {verified.get('size_bytes')} B) is not the "
                        f"final one ({size} B)")
    return problems


def _names_retries(root: Path, scheme: str, trial: Trial, key: str) -> list[str]:
    """The report names the cells Ray retried in its last dispatch (their own attempt records), and no other."""
    try:
        doc = json.loads((root / "comparison.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ["no comparison.json"]
    attempts = attempts_of(root, scheme)
    trial.retries += max(0, len(attempts) - len({a.get("token") for a in attempts}))
    cell = ((doc.get("cluster") or {}).get("cells") or {}).get(scheme)
    if cell is None:  # evaluated by an earlier call of this comparison: this call dispatched nothing for it
        return []
    token_attempts = [a for a in attempts if a.get("token") == (attempts[-1].get("token") if attempts else None)]
    retried = len(token_attempts) > 1
    report = (root / "comparison_report.md").read_text(encoding="utf-8") if (root / "comparison_report.md").is_file() else ""
    section = report.split("\n## Cluster", 1)[1] if "\n## Cluster" in report else ""
    row = next((ln for ln in section.splitlines() if ln.startswith(f"| {scheme} | ")), "")
    problems = []
    if cell.get("attempts") != len(token_attempts) or bool(cell.get("retried")) != retried:
        problems.append(f"the report says {cell.get('attempts')} attempt(s), retried {cell.get('retried')}; the cell "
                        f"recorded {len(token_attempts)}")
    if retried != ("retried:" in row):
        problems.append(f"the report's Cluster row does not say what was retried: {row!r}")
    if retried:
        trial.reported_retried.append(key)
    return problems


# --- the reference and the campaign ----------------------------------------------------------------------------
def take_reference(flow: str, cluster: LoopbackCluster, assets: Assets, where: Path) -> tuple[float, dict[str, CellResult]]:
    """The flow undisturbed: its wall time and each cell's result (an earlier campaign's, under the same root,
    when it finished: ``reference.json`` keeps its wall time)."""
    out, kept = where / "out", where / "reference.json"
    if not (kept.is_file() and _all_evaluated(flow, out)):
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        t0 = time.monotonic()
        rc = _finish(start_driver(first_argv(flow, assets, out, cluster.address), where / "driver.log",
                                  node_env(driver=True)))
        if rc != 0 or not _all_evaluated(flow, out):
            raise SystemExit(f"the undisturbed {flow} did not finish (exit {rc}); see {where / 'driver.log'}")
        kept.write_text(json.dumps({"seconds": round(time.monotonic() - t0, 1)}), encoding="utf-8")
    seconds = float(json.loads(kept.read_text(encoding="utf-8"))["seconds"])
    return seconds, {f"{flow}:{key}": cell_result(root, s) for key, (root, s) in cells(flow, out).items()}


def schedule(trials: int, rng: random.Random) -> list[tuple[str, str]]:
    """(flow, kind) per trial: the flows alternate; every kind once in each block of four, in a seeded order."""
    kinds: list[str] = []
    while len(kinds) < trials:
        block = list(KINDS)
        rng.shuffle(block)
        kinds += block
    return [(FLOWS[n % len(FLOWS)], kinds[n]) for n in range(trials)]


def summarize(trials: list[Trial], refs_s: dict[str, float], seed: int, started: float) -> dict[str, Any]:
    struck = [t for t in trials if t.fault.get("struck")]
    return {"trials": len(trials), "seed": seed, "faults": _count(t.kind for t in struck),
            "not_struck": _count(t.kind for t in trials if not t.fault.get("struck")),
            "flows": _count(t.flow for t in trials), "retries": sum(t.retries for t in trials),
            "reported_retried": sum(len(t.reported_retried) for t in trials),
            "reruns": sum(len(t.runs) - 1 for t in trials), "mismatches": sum(1 for t in trials if t.mismatches),
            "reference_s": {k: round(v, 1) for k, v in refs_s.items()}, "wall_s": round(time.monotonic() - started),
            "load": [round(x, 2) for x in os.getloadavg()]}


def table(summary: dict[str, Any]) -> str:
    rows = [("trials", summary["trials"]), ("seed", summary["seed"]),
            *((f"faults: {k}", summary["faults"].get(k, 0)) for k in KINDS),
            ("faults that found nothing to strike", sum(summary["not_struck"].values())),
            ("retries (Ray attempts beyond a cell's first)", summary["retries"]),
            ("cells the report names retried", summary["reported_retried"]),
            ("re-runs by the user (resume)", summary["reruns"]), ("mismatches", summary["mismatches"]),
            ("wall", f"{summary['wall_s']} s"), ("load average (1, 5, 15 min)", " ".join(map(str, summary["load"])))]
    return "\n".join(f"{k:<48} {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--root", type=Path, default=ROOT / ".bench" / "ray-chaos")
    ap.add_argument("--budget-s", type=float, default=None, help="start no trial after this many seconds")
    ap.add_argument("--plant", choices=sorted(PLANTS), default=None, help="run every trial with a planted bug")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped campaign stops its cluster too
    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("QUARK_PTQ_EVAL_CACHE", str(root / "cache"))
    started, rng = time.monotonic(), random.Random(args.seed)
    assets = build_assets(root / "assets")
    cluster = LoopbackCluster(root / "cluster")
    trials: list[Trial] = []
    spans: dict[str, float] = {}
    failure = None
    try:
        refs: dict[str, CellResult] = {}
        for flow in FLOWS:
            spans[flow], got = take_reference(flow, cluster, assets, root / "reference" / flow)
            refs.update(got)
            print(f"reference {flow}: {spans[flow]:.1f} s, {len(got)} cells, load {os.getloadavg()[0]:.2f}", flush=True)
        for n, (flow, kind) in enumerate(schedule(args.trials, rng)):
            if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: stopping after {n} trials", flush=True)
                break
            trial = run_trial(n, flow, kind, spans[flow], refs, cluster, assets, root / "trials" / f"{n:03d}", rng,
                              args.plant)
            trials.append(trial)
            print(f"trial {n:3d} {flow:<7} {kind:<12} instant {trial.instant:6.1f} s; {json.dumps(trial.fault)}; "
                  f"runs {trial.runs}; retries {trial.retries}; {trial.seconds:.0f} s; load {os.getloadavg()[0]:.2f}; "
                  f"{'OK' if not trial.mismatches else 'MISMATCH: ' + ' | '.join(trial.mismatches)}", flush=True)
    except (SystemExit, Exception) as exc:  # noqa: BLE001 - the harness stopped: the trials so far still count
        failure = f"the campaign stopped after {len(trials)} trials: {exc}"
        print(failure, flush=True)
    finally:
        cluster.shutdown()
    summary = {**summarize(trials, spans, args.seed, started), "stopped": failure}
    (root / "campaign.json").write_text(json.dumps({**summary, "detail": [asdict(t) for t in trials]}, indent=1))
    print(table(summary), flush=True)
    return 1 if summary["mismatches"] or failure else 0


if __name__ == "__main__":
    sys.exit(main())
