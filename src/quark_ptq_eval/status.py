"""`quark-ptq-eval status`: where the run in a work dir stands (reads files only; fast)."""

from __future__ import annotations

import shlex
from pathlib import Path

from .checkpoints import GATES, PIPELINE_GATES
from .evaluate.tiers import tier_checkpoint
from .state import STATE_FILE, RunState
from .steps import STEP_NAMES


def describe_status(workdir: Path) -> dict:
    workdir = workdir.resolve()
    if not (workdir / STATE_FILE).exists():
        return {"workdir": str(workdir), "state": "none",
                "text": f"No run in {workdir}. Start one with: quark-ptq-eval run MODEL -o OUTPUT_DIR"}
    state = RunState.load(workdir)
    lines = [f"Run in {workdir}", f"  model:  {state.options.get('model')}",
             f"  output: {state.options.get('output_dir')}"]
    for step in STEP_NAMES:
        info = state.steps.get(step)
        lines.append(f"  {step:<9} {info['status'] if info else '-':<12} {info.get('at', '') if info else ''}")
    approved = [g for g in (*PIPELINE_GATES, "eval") if g in state.approvals]
    lines.append(f"  approved gates: {', '.join(approved) or 'none'}")
    nxt = None
    if state.waiting_for:
        gate = GATES[state.waiting_for]
        lines.append(f"  waiting at checkpoint {gate.number} ({gate.name}): {gate.question}")
        nxt = (state.pending or {}).get("continue") or _continue_command(workdir, gate.name)
        lines.append(f"  continue with: {nxt}")
    return {"workdir": str(workdir), "state": "waiting" if state.waiting_for else "idle",
            "waiting_for": state.waiting_for, "steps": state.steps, "approved": approved, "continue": nxt,
            "text": "\n".join(lines)}


def _continue_command(workdir: Path, gate: str) -> str:
    """For a run state written before pending gates were recorded with their command."""
    flag = tier_checkpoint()[1] if gate == "eval" else f"--approve {gate}"
    return f"quark-ptq-eval resume --workdir {shlex.quote(str(workdir))} {flag}"
