"""The work dir's run state and its lock.

``run_state.json`` records the options the run was started with, which gate was approved for
which digest, and each step's observed status, so ``status`` can say where a run stands and a
re-run continues from the last approved step. It is always written atomically.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeAlias

from quark_ptq_eval.base.claims import holder_record, open_lock_file, read_holder
from quark_ptq_eval.base.errors import UsageError, WorkdirLocked
from quark_ptq_eval.base.fsio import read_json, sweep_temporaries, write_json
from quark_ptq_eval.base.safety import check_workdir

STATE_FILE = "run_state.json"
LOCK_FILE = ".quark-ptq-eval.lock"


# What json.dumps writes: scalars, sequences (lists, tuples) and string-keyed mappings of them.
JsonValue: TypeAlias = "str | int | float | bool | None | Sequence[JsonValue] | Mapping[str, JsonValue]"


def digest(obj: JsonValue) -> str:
    """A stable content digest of a JSON-able object (what an approval is bound to)."""
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class RunState:
    workdir: Path
    options: dict[str, Any] = field(default_factory=dict)
    approvals: dict[str, str] = field(default_factory=dict)
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    waiting_for: str | None = None
    pending: dict[str, Any] | None = None  # the gate waited at: digest, question, the command that continues

    @classmethod
    def load(cls, workdir: str | os.PathLike[str]) -> RunState:
        workdir = Path(workdir)
        path = workdir / STATE_FILE
        if not path.exists():
            return cls(workdir)
        try:
            data = read_json(path, "run state")
        except UsageError as exc:  # torn or truncated: say so, and what is safe, never start over silently
            raise damaged_state(exc.message.rstrip(".")) from None
        problem = _shape_problem(data)
        if problem:
            raise damaged_state(f"The run state {path} is damaged: {problem}")
        return cls(
            workdir,
            options=dict(data.get("options") or {}),
            approvals=dict(data.get("approvals") or {}),
            steps=dict(data.get("steps") or {}),
            waiting_for=data.get("waiting_for"),
            pending=data.get("pending") if isinstance(data.get("pending"), dict) else None,
        )

    def save(self) -> None:
        write_json(
            self.workdir / STATE_FILE,
            {"options": self.options, "approvals": self.approvals, "steps": self.steps,
             "waiting_for": self.waiting_for, "pending": self.pending, "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        )

    def is_approved(self, gate: str, content_digest: str) -> bool:
        return self.approvals.get(gate) == content_digest

    def approve(self, gate: str, content_digest: str) -> None:
        self.approvals[gate] = content_digest
        if self.waiting_for == gate:
            self.waiting_for = self.pending = None
        self.save()

    def wait_for(self, gate: str, content_digest: str | None, question: str, continue_with: str) -> None:
        """Record the gate the run waits at, before asking: a stop or a crash leaves it readable."""
        self.waiting_for = gate
        self.pending = {"gate": gate, "digest": content_digest, "question": question, "continue": continue_with}
        self.save()

    def record_step(self, step: str, status: str, **details: Any) -> None:
        self.steps[step] = {"status": status, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **details}
        self.save()


def damaged_state(what: str) -> UsageError:
    return UsageError(
        f"{what}; nothing was run.",
        "It is written atomically, so a crash does not tear it: something else truncated or edited it. Restore it "
        "from a backup, or move it aside and start again with `quark-ptq-eval run` and the original arguments "
        "(finished artifacts are checked again; an existing output is only replaced with --overwrite).")


_SHAPE = {"options": dict, "approvals": dict, "steps": dict, "waiting_for": str, "pending": dict}


def _shape_problem(data: Any) -> str | None:
    """What in a parsed run state has the wrong type (a hand edit, a foreign file), or None."""
    if not isinstance(data, dict):
        return f"it holds a JSON {type(data).__name__}, not an object"
    for key, kind in _SHAPE.items():
        if data.get(key) is not None and not isinstance(data[key], kind):
            return f"{key} is a {type(data[key]).__name__}, not a {kind.__name__}"
    for name, step in (data.get("steps") or {}).items():
        if not isinstance(step, dict) or not isinstance(step.get("status"), str):
            return f"step {name!r} has no status"
    if not all(isinstance(v, str) for v in (data.get("approvals") or {}).values()):
        return "an approval is not a digest"
    return None


class WorkdirLock:
    """Exclusive lock on a work dir. The kernel drops it when its holder dies, so a lock file
    left by a killed run is stale by construction and is simply taken over."""

    def __init__(self, workdir: str | os.PathLike[str]):
        self.path = Path(workdir) / LOCK_FILE
        self._fh: TextIO | None = None

    def __enter__(self) -> WorkdirLock:
        check_workdir(self.path.parent)  # read-only: refused now, not when the first artifact is written
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = os.fdopen(open_lock_file(self.path), "r+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            text = fh.read()
            record = read_holder(text)
            holder = f"pid {record['pid']}" if record else text.strip() or "another process"
            fh.close()
            raise WorkdirLocked(
                f"Another quark-ptq-eval run ({holder}) is using the work directory {self.path.parent}.",
                "Wait for it to finish or use another --workdir.",
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(holder_record(self.path.parent)))  # pid + start time: `status` tells a dead holder
        fh.flush()
        self._fh = fh
        sweep_temporaries(self.path.parent)  # a killed holder's half-written temporaries: ours to remove now
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fh:
            self._fh.seek(0)
            self._fh.truncate()
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None
