"""Calibration text checked at the plan step: read, tokenized, measured against the plan's
calibration size, optionally split so evaluation gets a held-out part calibration never sees,
and compared with the evaluation text (overlap makes Tier 1 scores optimistic).

The engine (execute/quark_api_engine.py) joins the documents with blank lines, tokenizes once and
cuts non-overlapping windows of ``seq_len`` (a text shorter than one window is one short sample);
the count here follows the same rule, so the plan says what calibration will really see.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import QuantPlan
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.fsio import atomic_write_text
from quark_ptq_eval.base.plan_records import CalibrationSize, HeldOutSplit, PlannedCalibration

SPLIT_DIR = "calibration_split"  # under the work dir
CALIB_PART, HELDOUT_PART = "calibration.jsonl", "heldout_eval.jsonl"
HELDOUT_SHARE = 0.1  # of the documents, at least one
NGRAM = 13  # words: the contamination window GPT-3's and later test-set overlap studies use
OVERLAP_DOCS = 0.05  # share of evaluation documents found verbatim in the calibration text
OVERLAP_NGRAMS = 0.10  # share of the evaluation text's 13-word sequences found in it
SCAN_CHARS = 20_000_000  # each side's text compared at most (the overlap check stays seconds)
OVERLAP_RULE = (f"the same file, or at least {OVERLAP_DOCS:.0%} of the evaluation documents verbatim in the "
                f"calibration text, or at least {OVERLAP_NGRAMS:.0%} of its {NGRAM}-word sequences there")
OPTIMISTIC = "optimistic: scored on calibration text"


# ---------------------------------------------------------------- the records (the plan's in base/plan_records.py)


@dataclass(frozen=True)
class CalibrationOverlap:
    """How the evaluation text overlaps the calibration text (eval_results.json's ``calibration_overlap``)."""

    kind: str  # same file | same documents | shared n-grams
    share: float
    text: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- reading


def calibration_documents(path: str | Path, text_field: str = "text") -> list[str]:
    """The documents of a local calibration text; one sentence (UsageError) when it has none."""
    from quark_ptq_eval.base.textdata import load_texts, split_plain_text

    try:
        texts = load_texts(path, text_field)
    except UsageError as exc:
        if "field" in exc.message or "column" in exc.message:
            raise UsageError(exc.message, "Choose the field that holds the text with --calib-text-field NAME.") from None
        raise
    if Path(path).suffix == ".txt":
        texts = split_plain_text(texts[0] if texts else "")
    documents = [t for t in (s.strip() for s in texts) if t]
    if not documents:
        raise UsageError(f"The calibration text {path} holds no text.", "Give a file with text to calibrate on.")
    return documents


# ---------------------------------------------------------------- tokens


def _tokenizer(model_dir: Path) -> Callable[[str], int] | None:
    """A callable text -> token count for the model's tokenizer, or None when none loads."""
    file = model_dir / "tokenizer.json"
    try:
        if file.is_file():  # the tokenizers library alone: no transformers import at plan time
            from tokenizers import Tokenizer

            fast = Tokenizer.from_file(str(file))
            return lambda text: len(fast.encode(text).ids)
        if not any((model_dir / f).is_file() for f in ("tokenizer_config.json", "tokenizer.model", "vocab.json")):
            return None  # no tokenizer files: nothing to load (and no transformers import for nothing)
        from transformers import AutoTokenizer

        slow = AutoTokenizer.from_pretrained(str(model_dir))
        return lambda text: len(slow(text).input_ids)
    except Exception:  # noqa: BLE001 - no usable tokenizer: the plan says the size is not counted
        return None


def count_tokens(documents: list[str], model_dir: Path, needed: int, chunk_chars: int = 200_000) -> int | None:
    """Tokens of the documents joined with blank lines (the engine's text), counted until ``needed``
    is reached (a large text is not tokenized to its end); None without a tokenizer."""
    count = _tokenizer(model_dir)
    if count is None:
        return None
    text = "\n\n".join(documents)
    if len(text) <= chunk_chars * 10:
        return count(text)
    total = 0
    for start in range(0, len(text), chunk_chars):
        total += count(text[start : start + chunk_chars])
        if total >= needed:
            break
    return total


def actual_size(tokens: int | None, num_samples: int, seq_len: int) -> CalibrationSize:
    """What calibration really gets from ``tokens`` (the engine's windowing)."""
    if tokens is None:
        return CalibrationSize(None, None, None, False, "not counted: the model has no tokenizer this step could load")
    full = tokens // seq_len
    samples, per = (min(full, num_samples), seq_len) if full else (1, tokens)
    short = full < num_samples
    text = f"{samples} sample{'s' if samples != 1 else ''} of {per} tokens"
    return CalibrationSize(tokens, samples, per, short, text)


def describe_used(plan: QuantPlan) -> str:
    """One line: the calibration the plan's run actually used (manifest, validation report, summary)."""
    calibration = plan.calibration
    source = calibration.source_file or calibration.dataset
    actual, split = calibration.actual, calibration.split
    size = (actual.text if actual else "") or f"{calibration.num_samples} x {calibration.seq_len} tokens (not counted)"
    part = f" (documents 1-{split.calibration_documents} of {split.documents}; the rest held out for " \
           "evaluation)" if split else ""
    asked = f"; the plan asked for {calibration.num_samples} x {calibration.seq_len}" \
        if actual and actual.short else ""
    return f"{size} from {source}{part}{asked}"


def short_message(calibration: PlannedCalibration) -> str | None:
    """Why the plan must be approved by name: the text gives less than the calibration size."""
    actual = calibration.actual
    if actual is None or not actual.short:
        return None
    return (f"The calibration text gives only {actual.text}, not the plan's "
            f"{calibration.num_samples} x {calibration.seq_len} tokens: give more text or lower "
            "--num-calib-samples / --calib-seq-len.")


# ---------------------------------------------------------------- held-out split


def _norm(doc: str) -> str:
    return " ".join(doc.split())


def hold_out(documents: list[str], workdir: Path) -> HeldOutSplit | None:
    """Write the calibration part and the held-out evaluation part (jsonl, field ``text``) under
    the work dir; None when there are too few documents to split. A held-out document that also
    occurs in the calibration part (a duplicate paragraph) is dropped: the parts share none."""
    if len(documents) < 2:
        return None
    keep = len(documents) - max(1, round(len(documents) * HELDOUT_SHARE))
    calib, rest = documents[:keep], documents[keep:]
    seen = {_norm(d) for d in calib}
    heldout = [d for d in rest if _norm(d) not in seen]
    if not heldout:
        return None
    folder = workdir / SPLIT_DIR
    paths = {}
    for name, docs in ((CALIB_PART, calib), (HELDOUT_PART, heldout)):
        paths[name] = atomic_write_text(folder / name, "".join(_jsonl(d) for d in docs))
    return HeldOutSplit(len(documents), len(calib), len(heldout), len(rest) - len(heldout), str(paths[CALIB_PART]),
                        str(paths[HELDOUT_PART]), f"the last {HELDOUT_SHARE:.0%} of the documents")


def _jsonl(doc: str) -> str:
    import json

    return json.dumps({"text": doc}, ensure_ascii=False) + "\n"


def normalized_copy(documents: list[str], workdir: Path) -> Path:
    """The documents as jsonl with field ``text`` (what every engine reads), for a chosen text field."""
    return atomic_write_text(workdir / SPLIT_DIR / CALIB_PART, "".join(_jsonl(d) for d in documents))


# ---------------------------------------------------------------- overlap


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _ngrams(documents: list[str]) -> set[int]:
    grams: set[int] = set()
    budget = SCAN_CHARS
    for doc in documents:
        words = re.findall(r"\w+", doc.lower()[:budget])
        budget -= len(doc)
        grams.update(hash(tuple(words[i : i + NGRAM])) for i in range(len(words) - NGRAM + 1))
        if budget <= 0:
            break
    return grams


def overlap(calibration: PlannedCalibration, eval_path: Path, eval_docs: list[str]) -> CalibrationOverlap | None:
    """How the evaluation text overlaps the plan's calibration text (OVERLAP_RULE), or None."""
    if calibration.source != "local_file" or not calibration.path:
        return None
    calib_path, eval_path = Path(calibration.path), Path(eval_path)
    sources = {calib_path.resolve(), Path(calibration.source_path or calib_path).resolve()}
    if eval_path.resolve() in sources or (eval_path.is_file() and calib_path.is_file()
                                          and _file_digest(eval_path) == _file_digest(calib_path)):
        return CalibrationOverlap("same file", 1.0, f"the evaluation text is the calibration file {calib_path}")
    calib_docs = calibration_documents(calib_path)
    seen = {_norm(d) for d in calib_docs}
    shared_docs = sum(_norm(d) in seen for d in eval_docs) / max(1, len(eval_docs))
    if shared_docs >= OVERLAP_DOCS:
        return CalibrationOverlap("same documents", shared_docs,
                                  f"{shared_docs:.0%} of the evaluation documents are in the calibration text")
    grams = _ngrams(eval_docs)
    shared = len(grams & _ngrams(calib_docs)) / max(1, len(grams))
    if shared >= OVERLAP_NGRAMS:
        return CalibrationOverlap("shared n-grams", shared,
                                  f"{shared:.0%} of the evaluation text's {NGRAM}-word sequences are in the calibration text")
    return None
