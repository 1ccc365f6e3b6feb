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
from pathlib import Path
from typing import Any, NoReturn, Protocol, runtime_checkable

from quark_ptq_eval.base.errors import CheckpointPending, UsageError
from quark_ptq_eval.base.state import RunState, digest


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
# The recipe's numbered checkpoints 1-4, in order (the run manifest lists them).
PIPELINE_GATES = tuple(g.name for g in sorted(GATES.values(), key=lambda g: g.number) if g.number.isdigit())


class Approver(Protocol):
    interactive: bool

    def __call__(self, gate: Gate, summary: str) -> bool: ...

    def weighs(self, gate: str) -> bool:
        """Whether a yes to ``gate`` is given with its content in view (the gate named, a person at
        the terminal, a tool handed the summary) rather than by a blanket --yes: a plan this host
        cannot hold is approved only so."""
        ...


@runtime_checkable
class Chooser(Protocol):
    """An approver that can answer a choice on the spot (a person at a terminal)."""

    def choose(self, question: str, choices: tuple[str, ...]) -> str | None: ...


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

    def weighs(self, gate: str) -> bool:
        return gate in self.approved  # named by --approve; --yes alone weighs nothing


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

    def weighs(self, gate: str) -> bool:
        return True  # the person answering sees the gate's table


    def choose(self, question: str, choices: tuple[str, ...]) -> str | None:
        """Ask for one of ``choices`` (used by the evaluation checkpoint); None when unanswered."""
        print(f"\n{question} [{'/'.join(choices)}]", file=sys.stderr)
        try:
            answer = input("> ").strip()
        except EOFError:
            return None
        return answer if answer in choices else None

    def ask_text(self, question: str, default: str | None = None) -> str | None:
        """A free answer (a path); Enter takes ``default``. None when unanswered."""
        print(f"\n{question}", file=sys.stderr)
        try:
            answer = input(f"[{default}] > " if default else "> ").strip()
        except EOFError:
            return None
        return answer or default


class CallbackApprover:
    """For notebooks and other tools: ``CallbackApprover(lambda gate, summary: ...)``."""

    interactive = False

    def __init__(self, callback: Callable[[Gate, str], bool]):
        self.callback = callback

    def __call__(self, gate: Gate, summary: str) -> bool:
        return bool(self.callback(gate, summary))

    def weighs(self, gate: str) -> bool:
        return True  # the callback is handed the gate's summary


class Gatekeeper:
    """Every approval of the recipe goes through here, and nowhere else.

    An approval is bound to a digest of what the user saw (``content``). With a run state
    (``run_state.json``) it is recorded there, a gate already approved for the same content is
    not asked again, and a refused gate is recorded as pending with the exact command that
    continues, which ``status`` shows. Without one (the `eval` and `validate` commands on their
    own) the same questions are asked and the same stops are raised; nothing is recorded.
    """

    def __init__(self, approver: Approver, state: RunState | None = None,
                 continue_with: Callable[[str], str] | None = None):
        self.approver = approver
        self.state = state
        self._continue_with = continue_with or (lambda flags: f"re-run with {flags}")

    @property
    def can_choose(self) -> bool:
        """Can the approver answer a choice on the spot (a person at a terminal)?"""
        return isinstance(self.approver, Chooser)

    def continue_command(self, flags: str) -> str:
        return self._continue_with(flags)

    def require(self, gate_name: str, content: Any, summary: str, advice: str = "") -> None:
        """Go on only once ``gate_name`` is approved for ``content`` (a digest string, or anything
        JSON-able, digested here); else stop with CheckpointPending."""
        gate, bound = GATES[gate_name], _bound(content)
        if self.state is not None and self.state.is_approved(gate_name, bound):
            return
        command = self.continue_command(f"--approve {gate_name}")
        self._pending(gate_name, bound, command)
        if self.approver(gate, summary):
            self._approved(gate_name, bound)
            return
        raise CheckpointPending(f"Stopped at checkpoint {gate.number} ({gate.name}): {gate.question}",
                                f"To continue: {command}" + (f" {advice}" if advice else ""))

    def opt_in(self, gate_name: str, content: Any, summary: str) -> bool:
        """A yes/no that costs time when yes (the baseline): a refusal does not stop the run."""
        gate, bound = GATES[gate_name], _bound(content)
        if self.state is not None and self.state.is_approved(gate_name, bound):
            return True
        if not self.approver(gate, summary):
            return False
        self._approved(gate_name, bound)
        return True

    def choose(self, gate_name: str, question: str, choices: tuple[str, ...], message: str, flag: str) -> str:
        """One of ``choices``: asked when the approver can answer on the spot, else a stop whose
        continue command passes ``flag`` (e.g. ``--eval-tier ppl|lm_eval|vllm|skip``)."""
        answer = self.approver.choose(question, choices) if isinstance(self.approver, Chooser) else None
        if answer is None:
            self.stop(gate_name, message, flag)
        self.chosen(gate_name, answer)
        return answer

    def ask_path(self, gate_name: str, question: str, default: str | None = None, tries: int = 3) -> str | None:
        """A local path that must exist, asked on the spot (a person at a terminal; Enter takes
        ``default``) and recorded as the gate's answer; None when no one can answer."""
        ask: Callable[[str, str | None], str | None] | None = getattr(self.approver, "ask_text", None)
        if ask is None:
            return None
        for _ in range(tries):
            answer = ask(question, default)
            if answer is None:
                return None
            path = Path(answer).expanduser()
            if path.exists():
                self.chosen(gate_name, str(path.resolve()))
                return str(path.resolve())
            print(f"  {answer} does not exist.", file=sys.stderr)
        return None

    def chosen(self, gate_name: str, answer: str) -> None:
        """Record a choice given up front (a flag) or on the spot."""
        self._approved(gate_name, _bound({"chosen": answer}))

    def stop(self, gate_name: str, message: str, flag: str) -> NoReturn:
        """Stop at ``gate_name`` without asking: it needs an answer only a new command can give."""
        command = self.continue_command(flag)
        self._pending(gate_name, None, command)
        raise CheckpointPending(message, f"To continue: {command}")

    def _pending(self, gate_name: str, bound: str | None, command: str) -> None:
        if self.state is not None:
            self.state.wait_for(gate_name, bound, GATES[gate_name].question, command)

    def _approved(self, gate_name: str, bound: str) -> None:
        if self.state is not None:
            self.state.approve(gate_name, bound)


def as_gatekeeper(approver: Approver | Gatekeeper) -> Gatekeeper:
    """Library entry points take an approver or the run's gatekeeper; both end up here."""
    return approver if isinstance(approver, Gatekeeper) else Gatekeeper(approver)


def _bound(content: Any) -> str:
    return content if isinstance(content, str) else digest(content)


def require(gate_name: str, approver: Approver, summary: str, continue_hint: str) -> None:
    """Ask ``approver`` for ``gate_name`` outside a run (no state to record in); stop with
    :class:`CheckpointPending` when refused. Bound to ``summary``, what the user was shown."""
    keeper = approver if isinstance(approver, Gatekeeper) else Gatekeeper(approver, continue_with=lambda _: continue_hint)
    keeper.require(gate_name, digest(summary), summary)
