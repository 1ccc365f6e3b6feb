"""Loaders for the local lm-eval tasks: read the jsonl next to this file (no Hub, no cwd dependence)."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _rows(name: str) -> list[dict]:
    with (HERE / name).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _as_dataset(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_docstring_mc(**_: object):
    return _as_dataset(_rows("docstring_mc.jsonl"))


def load_docstring_text(**_: object):
    return _as_dataset(_rows("docstring_text.jsonl"))
