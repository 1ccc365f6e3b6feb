"""Local text for calibration and evaluation: .txt, .jsonl, .parquet or a saved `datasets` dir."""

from __future__ import annotations

import json
import re
from pathlib import Path

from quark_ptq_eval.base.errors import UsageError

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")


def check_text_source(path: str | Path, what: str = "text file") -> Path:
    """Refuse a path that cannot be read as text, before anything runs."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"The {what} {p} does not exist.")
    if p.is_dir():
        if not (p / "dataset_info.json").exists() and not (p / "dataset_dict.json").exists():
            raise UsageError(f"The {what} {p} is a directory but not a saved `datasets` dataset.")
    elif p.suffix not in TEXT_SUFFIXES:
        raise UsageError(f"The {what} {p} must be .txt, .jsonl or .parquet (or a saved `datasets` directory).")
    return p.resolve()


def split_plain_text(text: str) -> list[str]:
    """Blank-line separated paragraphs when the file has them, else one document per line."""
    blank_line = re.compile(r"\n[ \t]*\n")
    parts = blank_line.split(text) if blank_line.search(text.strip()) else text.splitlines()
    return [p.strip() for p in parts if p.strip()]


def load_texts(path: str | Path, column: str = "text") -> list[str]:
    """Documents of a local text source, in file order; a file that is not UTF-8 is refused in one sentence."""
    p = check_text_source(path)
    try:
        return _load_texts(p, column)
    except UnicodeDecodeError as exc:
        raise UsageError(f"{p} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}).",
                         "Convert it to UTF-8 (e.g. iconv -t UTF-8) and re-run.") from None


def _load_texts(p: Path, column: str) -> list[str]:
    if p.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["test"] if "test" in ds else next(iter(ds.values()))
        if column not in ds.column_names:
            raise UsageError(f"{p} has no column {column!r} (columns: {', '.join(ds.column_names)}).")
        return [t for t in ds[column] if t]
    if p.suffix == ".txt":
        return [p.read_text(encoding="utf-8")]
    if p.suffix == ".jsonl":
        texts = []
        with p.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise UsageError(f"{p} line {n} is not valid JSON.") from None
                if not isinstance(row, dict) or not isinstance(row.get(column), str):
                    fields = ", ".join(map(str, row)) if isinstance(row, dict) else f"a JSON {type(row).__name__}"
                    raise UsageError(f"{p} line {n} has no string field {column!r} (its fields: {fields or 'none'}).")
                texts.append(row[column])
        return texts
    import pyarrow.parquet as pq

    table = pq.read_table(p)
    if column not in table.column_names:
        raise UsageError(f"{p} has no column {column!r} (columns: {', '.join(table.column_names)}).")
    return [t for t in table.column(column).to_pylist() if t]
