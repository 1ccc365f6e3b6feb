"""Phase 1, step 4 — execute the approved command and verify its output on disk."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from quark_ptq_eval.base.artifacts import ModelAnalysis, RunManifest
from quark_ptq_eval.base.claims import OutputClaim, make_staging, rename_no_replace
from quark_ptq_eval.base.errors import QpeError, UsageError
from quark_ptq_eval.base.fsio import DiskFullError, space_hint
from quark_ptq_eval.base.gates import Gatekeeper
from quark_ptq_eval.base.safety import check_free_space, is_nonempty_dir
from quark_ptq_eval.base.state import RunState, digest
from quark_ptq_eval.base.ui import Reporter
from quark_ptq_eval.execute.classify import asked_of, classify_failure
from quark_ptq_eval.execute.file_modes import apply_umask
from quark_ptq_eval.execute.inspect_output import inspect_output
from quark_ptq_eval.execute.runner import EngineEcho, EngineRunner, RunResult, raise_if_interrupted
from quark_ptq_eval.execute.staging import stage_source
from quark_ptq_eval.plan.engines import ENGINES, get_engine


class ExecuteServices(Protocol):
    """What this step needs of the running recipe (flows' RunServices), without importing it."""

    workdir: Path  # where the engine runs and the manifest's runs are recorded
    ui: Reporter
    state: RunState
    gates: Gatekeeper
    engine_runner: EngineRunner  # run_command (a child process) or e.g. in_process.InProcessRunner


class EngineFailed(QpeError):
    pass


@dataclass(frozen=True)
class VerifiedOutput:
    """The execute step's artifact: the export it verified on disk (``inspect_output``'s facts)."""

    dir: str
    files: tuple[str, ...]
    shards: tuple[str, ...]
    tensor_count: int
    quant_method: str | None
    size_bytes: int
    tokenizer_files: tuple[str, ...]

    @classmethod
    def from_facts(cls, facts: dict[str, Any]) -> VerifiedOutput:
        return cls(str(facts.get("dir", "")), tuple(facts.get("files") or ()), tuple(facts.get("shards") or ()),
                   int(facts.get("tensor_count") or 0), facts.get("quant_method"), int(facts.get("size_bytes") or 0),
                   tuple(facts.get("tokenizer_files") or ()))

    @property
    def digest(self) -> str:
        """What the result gate is bound to: the facts that stay the same while the export does."""
        return digest({"files": list(self.files), "shards": list(self.shards), "tensor_count": self.tensor_count,
                       "quant_method": self.quant_method, "size_bytes": self.size_bytes})


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def estimated_output_bytes(analysis: ModelAnalysis) -> int:
    return int(analysis.size["bytes"] * 0.6) + (1 << 20)


def _set_aside(recipe: ExecuteServices, path: Path, why: str) -> Path:
    """Move ``path`` out of the way (never delete it), after the overwrite approval."""
    # Bound to what is there now: a different leftover at the same path asks again.
    listing = sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                     for p in path.rglob("*") if p.is_file())
    recipe.gates.require("overwrite", digest([str(path), listing]), f"{path} {why}")
    aside = path.with_name(f"{path.name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
    path.rename(aside)
    recipe.ui.info(f"Moved {path} aside to {aside} (nothing deleted).")
    return aside


def execute_manifest(recipe: ExecuteServices, manifest_file: Path, analysis: ModelAnalysis, output_dir: Path,
                     overwrite: bool, claims: contextlib.ExitStack) -> VerifiedOutput:
    """Run the approved ``manifest_file`` (run_manifest.yaml as it is on disk, and only if that was
    approved) and verify its output; ``claims`` holds the output's claim until the run ends."""
    on_disk = RunManifest.load(manifest_file.parent)
    done = _already_verified(recipe, on_disk, output_dir, claims)
    if done is not None:
        return VerifiedOutput.from_facts(done)
    staging = _prepare(recipe, on_disk, analysis, output_dir, overwrite, claims)
    run: dict[str, Any] = {"status": "running", "started_at": _now(), "command_digest": on_disk.command_digest}
    on_disk.runs.append(run)
    on_disk.write(recipe.workdir)
    recipe.state.record_step("execute", "running", command_digest=on_disk.command_digest)
    try:
        result = _run(recipe, on_disk)
    except OSError as exc:  # the engine could not even start (argv[0] missing, not executable, ...)
        run.update(status="failed", finished_at=_now(), failure={"cause": "environment", "evidence": [str(exc)]})
        _record(recipe, on_disk, run, inspect_output(staging), "failed")
        raise EngineFailed(f"The engine could not be started: {exc.strerror or exc} ({on_disk.command['argv'][0]}).",
                           "Check the installation with `quark-ptq-eval preflight`.") from None
    if staging.is_dir():
        apply_umask(staging)  # the libraries write 0600: readable by a server running as another user, as cp gives
    _judge_run(recipe, on_disk, run, result, staging, estimated_output_bytes(analysis))
    rename_no_replace(staging, output_dir)
    facts = inspect_output(output_dir)
    run["status"] = "succeeded"
    _record(recipe, on_disk, run, facts, "succeeded", output_dir=str(output_dir))
    recipe.ui.table("Verified output", [("dir", output_dir), ("shards", ", ".join(facts["shards"])),
                                        ("tensors", facts["tensor_count"]), ("quant_method", facts["quant_method"]),
                                        ("tokenizer", ", ".join(facts["tokenizer_files"])),
                                        ("size", f"{facts['size_bytes'] / 2**20:.2f} MiB"),
                                        ("engine time", f"{result.seconds:.1f} s")])
    return VerifiedOutput.from_facts(facts)


def _already_verified(recipe: ExecuteServices, on_disk: RunManifest, output_dir: Path,
                      claims: contextlib.ExitStack) -> dict[str, Any] | None:
    """The facts of this exact command's verified output, when a resumed run already made it."""
    previous = recipe.state.steps.get("execute", {})
    last = on_disk.runs[-1] if on_disk.runs else {}
    # The state says so, or, when recording it failed (a full disk, a kill), the manifest written just before.
    if (previous.get("status") == "succeeded" and previous.get("command_digest") == on_disk.command_digest
            and previous.get("output_dir") == str(output_dir)) or (
            last.get("status") == "succeeded" and last.get("command_digest") == on_disk.command_digest
            and on_disk.outputs.get("quantized_model_dir") == str(output_dir)):
        claims.enter_context(OutputClaim(output_dir, recipe.workdir))  # a killed run's stale claim: ours now
        if output_dir.is_dir():
            apply_umask(output_dir)  # an output verified before its modes were set (an older run)
        facts = inspect_output(output_dir)
        if facts.get("ok"):
            recipe.ui.info(f"Already executed and verified: {output_dir}")
            if previous.get("status") != "succeeded":  # adopted from the manifest: the state says so again
                recipe.state.record_step("execute", "succeeded", command_digest=on_disk.command_digest,
                                         output_dir=str(output_dir))
            return facts
    return None


def _prepare(recipe: ExecuteServices, on_disk: RunManifest, analysis: ModelAnalysis, output_dir: Path,
             overwrite: bool, claims: contextlib.ExitStack) -> Path:
    """Everything before the engine starts: the output claimed, the execution gate passed, old
    partial outputs set aside, calibration and source staged, the staging dir made; returns it."""
    staging = Path(on_disk.outputs["staging_dir"])
    if is_nonempty_dir(output_dir) and not overwrite:
        raise UsageError(f"The output directory {output_dir} is not empty.",
                         "Choose another -o, or pass --overwrite (its contents are moved aside, not deleted).")
    check_free_space(output_dir, estimated_output_bytes(analysis))
    recipe.gates.require("execute", on_disk.command_digest, on_disk.command["shell"])
    output_dir.parent.mkdir(parents=True, exist_ok=True)  # approved: the output's folder may be new (compare)
    claims.enter_context(OutputClaim(output_dir, recipe.workdir))  # a second run aimed here stops (exit 5)
    if staging.is_dir() and not staging.is_symlink() and not any(staging.iterdir()):
        staging.rmdir()  # an empty staging dir of a run that died before its engine wrote: nothing to keep
    resuming = _engine_resumes(on_disk, staging)
    if resuming:
        recipe.ui.info(f"Resuming the engine's partial output in {staging}: the same approved command wrote it, "
                       "and this engine goes on from its last finished step.")
    elif staging.exists():
        _set_aside(recipe, staging, "holds a partial output from an interrupted or failed run")
    if is_nonempty_dir(output_dir):
        _set_aside(recipe, output_dir, "is not empty and will be replaced")
    get_engine(on_disk.engine["name"]).prepare_calibration(on_disk)
    stage_source(on_disk.inputs.get("source_reading") or {}, Path(on_disk.inputs["model_dir"]), recipe.ui.info)
    if not resuming:
        make_staging(staging)  # exclusively: this run's alone
    return staging


def _engine_resumes(on_disk: RunManifest, staging: Path) -> bool:
    """Whether the partial output in ``staging`` is one the engine resumes (the sequential engine's finished
    blocks): the engine keeps its state there, and the run that left it ran this same approved command."""
    entry = ENGINES.get(on_disk.engine["name"])
    last = on_disk.runs[-1] if on_disk.runs else {}
    return bool(entry and entry.resumes_in and staging.is_dir() and not staging.is_symlink()
                and (staging / entry.resumes_in).is_dir() and last.get("command_digest") == on_disk.command_digest)


def _judge_run(recipe: ExecuteServices, on_disk: RunManifest, run: dict[str, Any], result: RunResult,
               staging: Path, needed: int) -> None:
    """Record how the engine ended; raise unless it exited 0 with a usable output."""
    facts = inspect_output(staging)
    run.update(finished_at=_now(), returncode=result.returncode, seconds=round(result.seconds, 1), log=str(result.log))
    if result.interrupted:
        run["status"] = "interrupted"
        _record(recipe, on_disk, run, facts, "interrupted")
        raise_if_interrupted(result)
    full = [ln.strip() for ln in result.tail if OUT_OF_SPACE.search(ln)] if result.returncode != 0 else []
    if full:
        run.update(status="failed", failure={"cause": "export", "evidence": full[-2:], "returncode": result.returncode,
                                             "proposal": "Free disk space at the output location, then resume."})
        _record(recipe, on_disk, run, facts, "failed")
        shutil.rmtree(staging, ignore_errors=True)  # this run's own (made exclusively), half-written: its space back
        err = _errno_of(full[-1])  # the engine's own line stays in the manifest's failure evidence
        raise DiskFullError(f"The engine could not write the export into {staging}: {os.strerror(err)}; the partial "
                            "export was removed.", space_hint(staging.parent, needed, err))
    if result.returncode != 0 or not facts.get("ok"):
        failure = classify_failure(result.tail, result.returncode, asked_of(on_disk.command["argv"]))
        run.update(status="failed", failure=failure)
        _record(recipe, on_disk, run, facts, "failed")
        why = f"exit code {result.returncode}" if result.returncode else _no_output_why(facts, result.tail)
        raise EngineFailed(
            f"The engine failed ({failure['cause']}: {why}); evidence: {' | '.join(failure['evidence'][-2:]) or 'none'}.",
            f"Suggested change: {failure['proposal']} Full log: {result.log}",
        )


OUT_OF_SPACE = re.compile(r"No space left on device|File too large|Disk quota exceeded|Errno (28|27|122)\b|"
                          r"os error (28|27|122)\b")


def _errno_of(line: str) -> int:
    return errno.EFBIG if re.search(r"File too large|\b27\b", line) else errno.ENOSPC


def _no_output_why(facts: dict[str, Any], tail: list[str]) -> str:
    """An engine that exits 0 without a usable output: what is missing, and its own error line."""
    said = [ln.strip() for ln in tail if re.search(r"ERROR|Error|error:", ln)]
    own = f"; the engine's log says: {said[-1]}" if said else ""
    return f"exit code 0 but {'; '.join(facts.get('problems') or ['no usable output'])}{own}"


def _run(recipe: ExecuteServices, manifest: RunManifest) -> RunResult:
    echo = None if recipe.ui.quiet else EngineEcho(recipe.ui)
    try:
        return recipe.engine_runner(manifest.command["argv"], manifest.command.get("env", {}),
                                    Path(manifest.outputs["log"]), recipe.workdir, echo=echo)
    finally:
        if echo is not None:
            echo.close()


def _record(recipe: ExecuteServices, manifest: RunManifest, run: dict[str, Any], facts: dict[str, Any], status: str,
            **extra: Any) -> None:
    run["observed"] = {k: facts.get(k) for k in ("dir", "files", "shards", "size_bytes", "quant_method", "problems")}
    manifest.observed = run["observed"]
    manifest.write(recipe.workdir)
    recipe.state.record_step("execute", status, command_digest=manifest.command_digest, **extra)
