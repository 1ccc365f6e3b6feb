"""Checkpoints: one mechanism for every gate of the recipe.

A gate is approved for one exact *digest* of what the user saw (the analysis, the plan, the
command line, the verified output). Approvals live in the work dir's state file, so a resumed
run skips gates already approved for the same content, and any change to that content (a new
scheme, an edited manifest) invalidates the approval and asks again. Who says yes is pluggable:
flags for batch use, the terminal for people, a callback for notebooks and other tools.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from .errors import CheckpointPending, UsageError


@dataclass(frozen=True)
class Gate:
    name: str  # flag name used in --approve
    number: str  # as the recipe counts them: "1".."4", "eval", "fix", "overwrite"
    question: str
    reason: str


GATES: dict[str, Gate] = {
    g.name: g
    for g in (
        Gate("intake", "1", "Is this analysis of the model right?",
             "Everything downstream (template, exclusions, scheme support) depends on it."),
        Gate("plan", "2", "Approve this quantization plan?",
             "The scheme, exclusions and calibration decide the model's accuracy."),
        Gate("execute", "3", "Shall I run this exact command?",
             "Execution gate: nothing is created, downloaded or run before an explicit yes."),
        Gate("result", "4", "Accept this verified quantized model?",
             "Validation and evaluation build on the output you accept here."),
        Gate("eval", "eval", "Run this evaluation tier?",
             "Evaluation costs time (Tier 2 can take hours); it runs only on opt-in."),
        Gate("overwrite", "overwrite", "Replace the contents of the non-empty output directory?",
             "Files you own are never deleted without your approval."),
        Gate("fix", "fix", "Apply this fix and re-validate?",
             "Fixes touch the output directory; they are applied only on approval."),
        Gate("baseline", "baseline", "Also evaluate the unquantized source model?",
             "An exact delta needs the baseline under the same settings: about double the time."),
    )
}
PIPELINE_GATES = ("intake", "plan", "execute", "result")


class Approver(Protocol):
    interactive: bool

    def __call__(self, gate: Gate, summary: str) -> bool: ...


class FlagApprover:
    """Approvals given up front (``--approve intake,plan`` or ``--yes``)."""

    interactive = False

    def __init__(self, approved: Iterable[str] = (), all_gates: bool = False):
        self.approved = set(approved)
        unknown = self.approved - set(GATES)
        if unknown:
            raise UsageError(
                f"Unknown gate(s) in --approve: {', '.join(sorted(unknown))}.",
                f"Known gates: {', '.join(GATES)}.",
            )
        # --yes approves every gate but the two that cost data or time beyond the plan:
        # replacing a non-empty output (--overwrite) and running the baseline (--baseline).
        self.all_gates = all_gates

    def __call__(self, gate: Gate, summary: str) -> bool:
        if gate.name in self.approved:
            return True
        return self.all_gates and gate.name not in ("overwrite", "baseline")


class TerminalApprover(FlagApprover):
    """Asks on the terminal for gates not already approved by flags."""

    interactive = True

    def __call__(self, gate: Gate, summary: str) -> bool:
        if super().__call__(gate, summary):
            return True
        print(f"\nCheckpoint {gate.number}: {gate.question}", file=sys.stderr)
        try:
            answer = input("[y/N] ").strip().lower()
        except EOFError:
            return False
        return answer in ("y", "yes")


    def choose(self, question: str, choices: tuple[str, ...]) -> str | None:
        """Ask for one of ``choices`` (used by the evaluation checkpoint); None when unanswered."""
        print(f"\n{question} [{'/'.join(choices)}]", file=sys.stderr)
        try:
            answer = input("> ").strip()
        except EOFError:
            return None
        return answer if answer in choices else None


class CallbackApprover:
    """For notebooks and other tools: ``CallbackApprover(lambda gate, summary: ...)``."""

    interactive = False

    def __init__(self, callback: Callable[[Gate, str], bool]):
        self.callback = callback

    def __call__(self, gate: Gate, summary: str) -> bool:
        return bool(self.callback(gate, summary))


def require(gate_name: str, approver: Approver, summary: str, continue_hint: str) -> None:
    """Ask ``approver`` for ``gate_name``; stop with :class:`CheckpointPending` when refused."""
    gate = GATES[gate_name]
    if approver(gate, summary):
        return
    raise CheckpointPending(
        f"Stopped at checkpoint {gate.number} ({gate.name}): {gate.question}",
        f"To continue: {continue_hint}",
    )
