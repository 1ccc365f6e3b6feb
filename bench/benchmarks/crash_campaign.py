"""Crash campaign: the demo recipe SIGKILLed at random instants, resumed, compared with a clean run.

One clean reference run of the demo recipe (``cli/demo.demo_args``: the embedded tiny Llama,
int8, Tier 1 with the baseline) gives the end state every trial must reach and the span instants
are drawn over. Each trial then starts the same recipe from scratch in a fresh work dir and output,
SIGKILLs the whole process tree (its process group and the engine's, which runs in a session of its
own) at an instant drawn uniformly over the reference's wall time, and runs ``resume --yes`` until
it finishes; with probability ``--rekill`` a resume is killed too (at most ``--max-kills`` kills a
trial). After every stop ``status --json`` must tell the truth; at the end:

- every file of the export byte-identical to the reference's (where safetensors bytes differ, the
  tensor layout is compared and the difference is reported as a mismatch all the same);
- the work dir holds the reference's artifacts, each schema-valid, with the same validation status
  and evaluation verdict;
- no ``OUT.partial`` staging dir, no output claim, no temporary file, a free work dir lock;
- ``status`` says every step done.

A trial covers the code paths from its kill instant onwards as a user's resume meets them: earlier
steps are redone or skipped by the recipe itself, never by this script. Trials whose instant falls
after the run has ended count as "not killed".

    heavy .venv/bin/python -m bench.benchmarks.crash_campaign --trials 50 --seed 1
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from quark_ptq_eval.base.state import LOCK_FILE, STATE_FILE  # noqa: E402
from quark_ptq_eval.base.step_table import STEP_NAMES  # noqa: E402
from quark_ptq_eval.cli.demo import demo_args  # noqa: E402

FINISHED = ("done", "succeeded", "success", "skipped", "written", "none")  # "written"/"none": the card step
WORK_ARTIFACTS_SKIPPED = ("logs", LOCK_FILE)  # logs differ by design; the lock is checked on its own


@dataclass
class Reference:
    seconds: float
    export: dict[str, str]  # file -> sha256
    layout: dict[str, dict]  # safetensors file -> {tensor: [dtype, shape]}
    artifacts: list[str]  # work dir entries a finished run leaves
    validation: str
    verdict: str | None
    exact: bool = True  # two clean runs gave byte-identical exports: demand the same of every trial


@dataclass
class Trial:
    number: int
    instant: float
    kills: list[dict] = field(default_factory=list)  # {at, phase}
    resumes: int = 0
    restarts: int = 0  # `run` again: killed before its first state write, `resume` finds no run
    stops: list[dict] = field(default_factory=list)  # {rc, status}
    mismatches: list[str] = field(default_factory=list)
    set_aside: int = 0
    seconds: float = 0.0


def cli(*args: str | Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quark_ptq_eval", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "quark_ptq_eval", *args], stdout=fh, stderr=fh,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group and every descendant (the engine has a session of its own)."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    for pid in {proc.pid, *(p.pid for p in descendants)}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(descendants, timeout=30)


def strike(proc: subprocess.Popen, at: float | None) -> bool:
    """Wait until ``at`` seconds after the start (None: until it ends); kill the tree if still alive."""
    try:
        proc.wait(timeout=at)
        return False
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        return True


def read_state(workdir: Path) -> dict:
    try:
        data = json.loads((workdir / STATE_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def phase_of(workdir: Path) -> str:
    """The first step a killed run had not finished (from its own run state)."""
    steps = read_state(workdir).get("steps") or {}
    return next((s for s in STEP_NAMES if (steps.get(s) or {}).get("status") not in FINISHED), "summary")


def status_problems(workdir: Path, finished: bool) -> list[str]:
    """``status --json`` at a stop: no traceback, not 'running' with nobody alive, and the truth."""
    res = cli("status", "--workdir", workdir, "--json", timeout=120)
    if res.returncode != 0 or "Traceback" in res.stderr:
        return [f"status exited {res.returncode}: {res.stderr.strip()[-300:]}"]
    st = json.loads(res.stdout)
    steps = read_state(workdir).get("steps") or {}
    running = [s for s in STEP_NAMES if (steps.get(s) or {}).get("status") == "running"]
    problems = []
    if st["state"] == "running":
        problems.append("status says running after every process was killed")
    if running and (st["state"] != "interrupted" or "resume --workdir" not in (st.get("continue") or "")):
        problems.append(f"status {st['state']!r} for a run killed in {running[0]} (expected interrupted + resume)")
    if finished and not all((st["steps"].get(s) or {}).get("status") in FINISHED for s in STEP_NAMES):
        problems.append(f"status after the run finished: {st['steps']}")
    if finished and st["state"] != "idle":
        problems.append(f"status state {st['state']!r} after the run finished")
    return problems


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def layout(path: Path) -> dict:
    from quark_ptq_eval.base.safetensors_io import read_header

    return {name: [t.dtype, list(t.shape)] for name, t in sorted(read_header(path).tensors.items())}


def export_files(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): _digest(p, out.parent) for p in sorted(out.rglob("*")) if p.is_file()}


def _digest(path: Path, where: Path) -> str:
    """A file's sha256; the model card's with this trial's own folder written as one placeholder: it names
    the run's paths (the manifest's exact command), which differ from the reference's and nothing else."""
    if path.name != "README.md":
        return sha256(path)
    return hashlib.sha256(path.read_bytes().replace(str(where).encode(), b"<ROOT>")).hexdigest()


def reports(workdir: Path) -> tuple[str, str | None]:
    """(validation status, evaluation verdict) from the run's own reports."""
    validation = json.loads((workdir / "validation_report.json").read_text())
    summary = json.loads((workdir / "run_summary.json").read_text())
    return str(validation.get("status")), _verdict(summary)


def _verdict(summary: dict) -> str | None:
    ev = summary.get("evaluation") or summary.get("eval") or {}
    return ev.get("verdict") if isinstance(ev, dict) else None


def take_reference(model: Path, corpus: Path, where: Path) -> Reference:
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    out, wd = where / "out", where / "work"
    t = time.monotonic()
    proc = start(demo_args(model, corpus, out, wd), where / "cli.log")
    proc.wait()
    seconds = time.monotonic() - t
    if proc.returncode != 0:
        raise SystemExit(f"the reference run failed (rc {proc.returncode}); see {where / 'cli.log'}")
    validation, verdict = reports(wd)
    return Reference(seconds, export_files(out), {f: layout(out / f) for f in export_files(out) if f.endswith(".safetensors")},
                     sorted(p.name for p in wd.iterdir() if p.name not in WORK_ARTIFACTS_SKIPPED), validation, verdict)


def compare(ref: Reference, out: Path, wd: Path) -> list[str]:
    """Every difference between a finished trial's end state and the reference's."""
    if not out.is_dir():
        return [f"no export at {out}"]
    got = export_files(out)
    problems = [f"export files differ: missing {sorted(set(ref.export) - set(got))}, extra {sorted(set(got) - set(ref.export))}"
                ] if set(got) != set(ref.export) else []
    for name in sorted(set(got) & set(ref.export)):
        if got[name] != ref.export[name]:
            same = name in ref.layout and layout(out / name) == ref.layout[name]
            if same and not ref.exact:
                continue  # an engine that is not deterministic: the layout and the verdict must agree
            problems.append(f"{name} differs from the reference ({'same layout, other bytes' if same else 'other layout'})")
    entries = sorted(p.name for p in wd.iterdir() if p.name not in WORK_ARTIFACTS_SKIPPED)
    if entries != ref.artifacts:
        problems.append(f"work dir entries differ: missing {sorted(set(ref.artifacts) - set(entries))}, "
                        f"extra {sorted(set(entries) - set(ref.artifacts))}")
    problems += artifact_problems(wd)
    try:
        if reports(wd) != (ref.validation, ref.verdict):
            problems.append(f"validation/verdict {reports(wd)} != reference {(ref.validation, ref.verdict)}")
    except (OSError, ValueError) as exc:
        problems.append(f"a report cannot be read: {exc}")
    return problems + leftovers(out, wd)


def artifact_problems(wd: Path) -> list[str]:
    from quark_ptq_eval.base.artifacts import ModelAnalysis, QuantPlan, RunManifest
    from quark_ptq_eval.base.errors import QpeError

    problems = []
    for cls in (ModelAnalysis, QuantPlan, RunManifest):  # load() validates against base/schemas/
        try:
            cls.load(wd)
        except QpeError as exc:
            problems.append(f"{cls.FILENAME}: {exc.message}")
    for p in wd.iterdir():
        try:
            if p.suffix == ".json":
                json.loads(p.read_text())
            elif p.suffix == ".yaml":
                yaml.safe_load(p.read_text())
            elif p.suffix == ".md" and not p.read_text().strip():
                problems.append(f"{p.name} is empty")
        except (OSError, ValueError, yaml.YAMLError) as exc:
            problems.append(f"{p.name} is not complete: {exc}")
    runs = yaml.safe_load((wd / "run_manifest.yaml").read_text()).get("runs") or []
    if not runs or runs[-1].get("status") != "succeeded":
        problems.append(f"the manifest's last run is not 'succeeded': {[r.get('status') for r in runs]}")
    return problems


def leftovers(out: Path, wd: Path) -> list[str]:
    import fcntl

    found = [str(p) for p in (Path(f"{out}.partial"), out.with_name(f".{out.name}.quark-ptq-eval.lock")) if p.exists()]
    found += [str(p) for d in (out, wd) for p in d.rglob("*.tmp")]
    lock = wd / LOCK_FILE
    if lock.exists():
        with open(lock, "rb") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                found.append(f"{lock} still held")
            if fh.read().strip():
                found.append(f"{lock} still names a holder")
    return [f"left behind: {f}" for f in found]


def run_trial(number: int, ref: Reference, model: Path, corpus: Path, where: Path, rng: random.Random,
              rekill: float, max_kills: int) -> Trial:
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    out, wd, log = where / "out", where / "work", where / "cli.log"
    trial, t0 = Trial(number, round(rng.uniform(0, ref.seconds), 2)), time.monotonic()
    proc, at = start(demo_args(model, corpus, out, wd), log), trial.instant
    overwrite: list[str] = []
    while True:  # after a restart `at` is None: the run goes to its end (or the next check)
        if strike(proc, at):
            trial.kills.append({"at": at, "phase": phase_of(wd)})
            trial.mismatches += status_problems(wd, finished=False)
        elif proc.returncode == 0:
            break
        elif proc.returncode == 3 and not overwrite:  # a staging dir left by the kill: set aside with approval
            overwrite = ["--overwrite"]
            trial.stops.append({"rc": 3, "problems": status_problems(wd, finished=False)})
            trial.mismatches += trial.stops[-1]["problems"]
        elif proc.returncode == 2 and not (wd / STATE_FILE).exists():
            # killed before the run recorded anything: resume rightly knows no run; the user runs it again
            trial.stops.append({"rc": 2, "problems": status_problems(wd, finished=False)})
            trial.mismatches += trial.stops[-1]["problems"]
            trial.restarts += 1
            proc, at = start(demo_args(model, corpus, out, wd), log), None
            continue
        else:
            trial.mismatches.append(f"a run ended with exit {proc.returncode}; see {log}")
            break
        killing = len(trial.kills) < max_kills and rng.random() < rekill
        at = round(rng.uniform(0, ref.seconds), 2) if killing else None
        trial.resumes += 1
        proc = start(["resume", "--workdir", str(wd), "--yes", *overwrite], log)
    if not trial.mismatches:
        trial.mismatches += status_problems(wd, finished=True) + compare(ref, out, wd)
    trial.set_aside = len(list(where.glob("out*.set-aside-*")))
    trial.seconds = round(time.monotonic() - t0, 1)
    if not trial.mismatches:
        shutil.rmtree(where, ignore_errors=True)  # kept for inspection only when something differs
    return trial


def prepare(root: Path) -> tuple[Path, Path]:
    """The model and corpus of ``make demo``: the sensitivity bench's builder, not a second copy."""
    from bench.benchmarks.bench_sensitivity_effect import demo_model

    return demo_model(root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rekill", type=float, default=0.25, help="chance that a resume is killed too")
    ap.add_argument("--max-kills", type=int, default=3, help="kills per trial at most")
    ap.add_argument("--root", type=Path, default=ROOT / ".bench" / "crash-campaign")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting trials after this many seconds")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("QUARK_PTQ_EVAL_CACHE", str(root / "cache"))  # the catalog, warmed by the reference
    model, corpus = prepare(root)
    started, rng = time.monotonic(), random.Random(args.seed)
    # Two clean runs: the first warms the per-install caches (Quark's catalog) a user's second run finds
    # warm, and shows whether the engine is deterministic; the second gives the span instants are drawn over.
    first = take_reference(model, corpus, root / "reference-0")
    ref = take_reference(model, corpus, root / "reference")
    deterministic = ref.exact = first.export == ref.export
    print(f"first clean run {first.seconds:.1f} s; two clean runs' exports byte-identical: {deterministic}")
    if not deterministic:
        print("  files that differ: " + ", ".join(f for f in ref.export if first.export.get(f) != ref.export[f]))
    print(f"reference: {ref.seconds:.1f} s, {len(ref.export)} export files, validation {ref.validation}, "
          f"verdict {ref.verdict}, load {os.getloadavg()[0]:.2f}", flush=True)
    trials: list[Trial] = []
    for n in range(args.trials):
        if args.budget_s is not None and time.monotonic() - started > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: stopping after {n} trials", flush=True)
            break
        trial = run_trial(n, ref, model, corpus, root / "trials" / f"{n:03d}", rng, args.rekill, args.max_kills)
        trials.append(trial)
        kills = ", ".join(f"{k['at']:.1f} s ({k['phase']})" for k in trial.kills) or "none (ended first)"
        print(f"trial {n:3d}: instant {trial.instant:6.1f} s; kills: {kills}; resumes {trial.resumes}; restarts {trial.restarts}; "
              f"set aside {trial.set_aside}; {trial.seconds:.0f} s; load {os.getloadavg()[0]:.2f}; "
              f"{'OK' if not trial.mismatches else 'MISMATCH: ' + ' | '.join(trial.mismatches)}", flush=True)
    summary = {"reference_seconds": round(ref.seconds, 1), "clean_runs_identical": deterministic, "trials": len(trials),
               "killed_trials": sum(1 for t in trials if t.kills), "kills": sum(len(t.kills) for t in trials),
               "resumes": sum(t.resumes for t in trials), "restarts": sum(t.restarts for t in trials), "mismatches": sum(1 for t in trials if t.mismatches),
               "set_aside": sum(t.set_aside for t in trials), "seed": args.seed,
               "phases": _count(k["phase"] for t in trials for k in t.kills), "load_end": os.getloadavg(),
               "instants": [t.instant for t in trials], "detail": [asdict(t) for t in trials]}
    (root / "campaign.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "detail"}), flush=True)
    return 1 if summary["mismatches"] else 0


def _count(items) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


if __name__ == "__main__":
    sys.exit(main())
