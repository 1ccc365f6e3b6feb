"""The local comparison of the tiny model that test_compare.py checks and test_compare_ray.py compares
a Ray comparison against: one run, shared by the session (conftest.py's ``compared`` fixture)."""

from __future__ import annotations

from pathlib import Path

SCHEMES = ["int8", "int4_wo_128", "no_such_scheme"]
SEQ_LEN, WINDOWS = 128, 8
TASKS_DIR = Path(__file__).parent / "data" / "eval_tasks"
TASK, TASK_DOCS = "qpe_docstring_mc", 6


def compare_kwargs(corpus: Path, eval_text: Path) -> dict:
    return dict(calib_data=str(corpus), num_calib_samples=8, calib_seq_len=64, eval_data=eval_text,
                seq_len=SEQ_LEN, max_windows=WINDOWS, eval_device="cpu", top_k=16, offline=True,
                tasks=[TASK], include_path=TASKS_DIR, limit=TASK_DOCS, goal="smallest model")


def write_eval_text(corpus: Path, path: Path) -> Path:
    text = corpus.read_text(encoding="utf-8")
    path.write_text(text[len(text) // 2 : len(text) // 2 + 8_000], encoding="utf-8")
    return path


class Interrupt:
    """Progress hook: Ctrl-C right after the first scheme is done (what an interrupted sweep leaves)."""

    def __init__(self, after: int | None):
        self.after, self.events = after, []

    def __call__(self, event: str, scheme: str) -> None:
        self.events.append((event, scheme))
        if self.after is not None and sum(e == "done" for e, _ in self.events) >= self.after:
            raise KeyboardInterrupt


def run_local_compare(model: Path, corpus: Path, eval_text: Path, root: Path) -> dict:
    """The comparison driven gate by gate, interrupted after one scheme, then resumed."""
    import pytest

    from quark_ptq_eval import compare
    from quark_ptq_eval.base.errors import CheckpointPending
    from quark_ptq_eval.base.gates import FlagApprover
    from quark_ptq_eval.base.state import RunState

    kwargs = compare_kwargs(corpus, eval_text)
    stops = []
    for approve in (["intake"], ["plan"]):
        with pytest.raises(CheckpointPending) as exc:
            compare(model, SCHEMES, root, approver=FlagApprover(approve), **kwargs)
        stops.append((RunState.load(root).waiting_for, exc.value.hint, (root / "models").exists()))
    first = Interrupt(after=1)
    with pytest.raises(KeyboardInterrupt):
        compare(None, None, root, approver=FlagApprover(["execute", "result"]), progress=first)
    cache_files = sorted((root / "baseline_cache").rglob("baseline.safetensors"))
    cache_mtime = [p.stat().st_mtime_ns for p in cache_files]
    second = Interrupt(after=None)
    doc = compare(None, None, root, approver=FlagApprover(["result"]), progress=second)
    return {"root": root, "stops": stops, "first": first.events, "second": second.events, "doc": doc,
            "cache_files": cache_files, "cache_mtime": cache_mtime}
