"""The plan's calibration text, read and tokenized when planning (cheap next to the engine).

Bad text (no such field, empty, not UTF-8) is refused here in one sentence; the plan records
what the text really gives (``calibration.actual``), and when asked it splits off a held-out
part for evaluation (``calibration.split``): the engine is then given only the other part.
"""

from __future__ import annotations

from pathlib import Path

from quark_ptq_eval.base.artifacts import ModelAnalysis
from quark_ptq_eval.base.calibration_text import (
    actual_size,
    calibration_documents,
    count_tokens,
    hold_out,
    normalized_copy,
)
from quark_ptq_eval.base.plan_records import PlannedCalibration
from quark_ptq_eval.base.textdata import load_texts
from quark_ptq_eval.plan.request import PlanRequest


def check_calibration_text(calibration: PlannedCalibration, req: PlanRequest, analysis: ModelAnalysis, workdir: Path,
                           size_why: str) -> tuple[str, str]:
    """Read, split (when asked) and count the local calibration text; returns the "calibration
    size" decision's (reason, value). ``calibration`` is updated in place."""
    num, seq = calibration.num_samples, calibration.seq_len
    if calibration.seq_len_reason:
        size_why = f"{size_why}; sequence length {calibration.seq_len_reason}"
    asked = f"{num} x {seq} tokens"
    if calibration.source != "local_file" or calibration.path is None:
        return size_why, asked
    field = req.calib_text_field or "text"
    documents = calibration_documents(calibration.path, field)
    engine_text = _engine_input(calibration, calibration.path, documents, field, req.hold_out_eval, workdir)
    tokens = count_tokens(engine_text, Path(analysis.model["model_path"]), num * seq)
    actual = actual_size(tokens, num, seq)
    calibration.actual = actual
    if tokens is None:
        return f"{size_why}; {actual.text}", asked
    if actual.short:
        return (f"the text holds only {tokens} tokens, less than {num} x {seq}: calibration sees "
                f"{actual.text} (needs approval by name)"), f"{actual.text} (asked: {asked})"
    return f"{size_why}; the text holds enough ({tokens:,}+ tokens counted)", asked


def _engine_input(calibration: PlannedCalibration, source: str, documents: list[str], field: str, split_wanted: bool,
                  workdir: Path) -> list[str]:
    """Point ``calibration.path`` at what the engine must read (``source``, the text given, or a part or copy of
    it); return that text's documents."""
    split = hold_out(documents, workdir) if split_wanted else None
    if split is not None:
        calibration.source_path, calibration.path, calibration.split = source, split.calibration_path, split
        calibration.text_field = field
        return documents[: split.calibration_documents]
    if field != "text":  # every engine reads the field "text": give it a copy that has it
        calibration.source_path, calibration.path = source, str(normalized_copy(documents, workdir))
        calibration.text_field = field
        return documents
    return load_texts(source)  # exactly the engine's input (a .txt file is one text)


def source_note(calibration: PlannedCalibration) -> str:
    """What the "calibration" decision adds: the field read, the part held out for evaluation."""
    notes = []
    if (calibration.text_field or "text") != "text":
        notes.append(f"field {calibration.text_field!r}")
    split = calibration.split
    if split:
        notes.append(f"documents 1-{split.calibration_documents} of {split.documents}; "
                     f"{split.heldout_documents} held out for Tier 1 ({split.rule}), never calibrated on")
    return f" ({'; '.join(notes)})" if notes else ""
