"""Where scan results live: a final JSON per key, and a journal of per-layer results while it runs.

The key is the model's bytes (config + weights), the scheme, the exclusions, the calibration
tokens and the scan method version: change any of them and the scan starts afresh. The journal
(one JSON line per measured layer, flushed and fsynced as it comes) lets an interrupted scan
resume where it stopped instead of measuring every layer again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.fsio import cache_dir, read_json, write_json

# Bump when what a scan measures changes: old entries then stop matching.
# 2: the engine's preparation (MoE experts per expert), expert units, pinned routing, quantized share.
METHOD_VERSION = "2"

def tokens_digest(windows: list[list[int]]) -> str:
    """What the scan actually measures on: the token windows, not the file they came from."""
    return hashlib.sha256(json.dumps(windows).encode()).hexdigest()[:16]


def scan_key(model: str, scheme: str, exclude: list[str] | None, data: str, device: str,
             layer_config: dict[str, str] | None = None, expert_units: str = "group") -> str:
    spec: dict[str, Any] = {"model": model, "scheme": scheme, "exclude": exclude, "data": data, "device": device,
            "method": METHOD_VERSION, "expert_units": expert_units}
    if layer_config:  # only when set, so that the keys of scans without overrides stay as they were
        spec["layer_config"] = layer_config
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


class ScanCache:
    """The final result and the in-progress journal of one scan key."""

    def __init__(self, key: str, root: Path | None = None):
        self.key = key
        self.dir = (root or cache_dir()) / "sensitivity"
        self.final = self.dir / f"{key}.json"
        self.journal = self.dir / f"{key}.partial.jsonl"

    def load_final(self) -> dict[str, Any] | None:
        if not self.final.exists():
            return None
        try:
            entry: dict[str, Any] = read_json(self.final, "sensitivity cache entry")
            return entry
        except Exception:  # noqa: BLE001 - a damaged entry is re-measured, never trusted
            return None

    def load_journal(self) -> dict[str, dict[str, Any]]:
        """Layers already measured by an earlier, interrupted scan (a torn last line is dropped)."""
        done: dict[str, dict[str, Any]] = {}
        if not self.journal.exists():
            return done
        for line in self.journal.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "layer" in row:
                done[row["layer"]] = row
        return done

    def append(self, row: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.journal, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def save_final(self, result: dict[str, Any]) -> None:
        write_json(self.final, result)
        self.journal.unlink(missing_ok=True)
