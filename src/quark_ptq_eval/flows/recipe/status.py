"""`quark-ptq-eval status`: where the run in a work dir stands (reads files only; fast)."""

from __future__ import annotations

import shlex
from pathlib import Path

from quark_ptq_eval.base.claims import holder_alive, read_holder
from quark_ptq_eval.base.gates import GATES, PIPELINE_GATES
from quark_ptq_eval.base.state import LOCK_FILE, STATE_FILE, RunState
from quark_ptq_eval.base.step_table import STEP_NAMES
from quark_ptq_eval.evaluate.tiers import tier_checkpoint


def describe_status(workdir: Path) -> dict:
    workdir = workdir.resolve()
    if not (workdir / STATE_FILE).exists():
        return {"workdir": str(workdir), "state": "none",
                "text": f"No run in {workdir}. Start one with: quark-ptq-eval run MODEL -o OUTPUT_DIR"}
    state = RunState.load(workdir)
    lines = [f"Run in {workdir}", f"  model:  {state.options.get('model')}",
             f"  output: {state.options.get('output_dir')}"]
    live = _liveness(workdir, state)
    dead = live is not None and live["state"] == "interrupted"
    for step in STEP_NAMES:
        info = state.steps.get(step)
        shown = "-" if not info else "interrupted" if dead and info["status"] == "running" else info["status"]
        lines.append(f"  {step:<9} {shown:<12} {info.get('at', '') if info else ''}")
    approved = [g for g in (*PIPELINE_GATES, "eval") if g in state.approvals]
    lines.append(f"  approved gates: {', '.join(approved) or 'none'}")
    nxt = None
    if live is not None:
        lines.append(live["line"])
        nxt = live["continue"]
        if nxt:
            lines.append(f"  continue with: {nxt}")
    elif state.waiting_for in GATES:
        gate = GATES[state.waiting_for]
        lines.append(f"  waiting at checkpoint {gate.number} ({gate.name}): {gate.question}")
        nxt = (state.pending or {}).get("continue") or _continue_command(workdir, gate.name)
        lines.append(f"  continue with: {nxt}")
    kind = live["state"] if live else "waiting" if state.waiting_for else "idle"
    return {"workdir": str(workdir), "state": kind,
            "waiting_for": state.waiting_for, "steps": state.steps, "approved": approved, "continue": nxt,
            "text": "\n".join(lines)}


def _liveness(workdir: Path, state: RunState) -> dict | None:
    """For a step recorded as running: is the process that ran it still alive (the work dir
    lock's holder, pid + start time)? None when no step is running."""
    running = [name for name in STEP_NAMES if (state.steps.get(name) or {}).get("status") == "running"]
    if not running:
        return None
    try:
        record = read_holder((workdir / LOCK_FILE).read_text(encoding="utf-8", errors="replace"))
    except OSError:
        record = None
    if record is not None and holder_alive(record):
        return {"state": "running", "continue": None,
                "line": f"  running: {running[0]} (pid {record['pid']}, started {record.get('started_at', '?')})"}
    return {"state": "interrupted", "continue": f"quark-ptq-eval resume --workdir {shlex.quote(str(workdir))}",
            "line": f"  interrupted: the process that ran {running[0]} is gone"}


def _continue_command(workdir: Path, gate: str) -> str:
    """For a run state written before pending gates were recorded with their command."""
    flag = tier_checkpoint()[1] if gate == "eval" else f"--approve {gate}"
    return f"quark-ptq-eval resume --workdir {shlex.quote(str(workdir))} {flag}"
