"""The typed sections of quant_plan.json (base/artifacts.py ``QuantPlan``): each writes exactly the keys the
plan has always written, in the same order, and leaves out the same absent ones, so a plan's file (and the digest
an approval is bound to) does not change; keys of older plans are read in ``from_dict`` and nowhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CalibrationSize:
    """What calibration really gets from the text (the engine's windowing): the plan's ``calibration.actual``."""

    tokens: int | None  # counted (up to what the plan needs); None: no tokenizer loaded
    samples: int | None
    tokens_per_sample: int | None
    short: bool  # fewer samples than the plan asked for
    text: str  # in words, e.g. "8 samples of 512 tokens"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> CalibrationSize:
        return cls(row.get("tokens"), row.get("samples"), row.get("tokens_per_sample"), bool(row.get("short")),
                   str(row.get("text") or ""))


@dataclass(frozen=True)
class HeldOutSplit:
    """The text split in two (the plan's ``calibration.split``): calibration reads the first part,
    Tier 1 scores on the held-out rest."""

    documents: int
    calibration_documents: int
    heldout_documents: int
    dropped_duplicates: int  # held-out documents also in the calibration part, dropped
    calibration_path: str
    heldout_path: str
    rule: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> HeldOutSplit:
        return cls(**{f.name: row[f.name] for f in dataclasses.fields(cls)})


# Written only when set (the plan step adds them as it reads the text); the others always, null included.
_CALIBRATION_OPTIONAL = ("seq_len_reason", "source_path", "split", "text_field", "actual")


@dataclass
class PlannedCalibration:
    """The plan's ``calibration``: where the text comes from and how much of it calibration reads. Plain, not frozen:
    the plan step fills it in as it reads and sizes the text."""

    source: str  # local_file | hub_dataset
    dataset: str | None  # the Hub dataset (source hub_dataset)
    path: str | None  # what the engine reads (the calibration part, or a normalized copy, of a local text)
    num_samples: int
    seq_len: int
    batch_size: int
    seq_len_reason: str | None = None  # why the asked sequence length was shortened to the model's context
    source_path: str | None = None  # the text as given, when ``path`` is a part or a copy of it
    split: HeldOutSplit | None = None
    text_field: str | None = None  # the field read, when the text was copied to the engine's field "text"
    actual: CalibrationSize | None = None  # what the text really gives (a local text, counted at plan time)

    @property
    def source_file(self) -> str | None:
        """The calibration text as the user gave it (before any split or copy); None for a Hub dataset."""
        return self.source_path or self.path

    @property
    def described(self) -> str:
        """The text or the dataset, as the plan's "calibration" row names it."""
        return self.source_file or self.dataset or ""

    @property
    def tokens(self) -> int:
        """Tokens calibration reads as planned (samples x sequence length)."""
        return self.num_samples * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in _CALIBRATION_OPTIONAL:
                continue
            data[f.name] = value.to_dict() if isinstance(value, (HeldOutSplit, CalibrationSize)) else value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlannedCalibration:
        """Exact for a plan's section; a hand-written plan's partial one (``validate --plan FILE``) reads its
        missing sizes as 0 and its missing source as a Hub dataset."""
        split, actual = data.get("split"), data.get("actual")
        return cls(str(data.get("source") or "hub_dataset"), data.get("dataset"), data.get("path"),
                   int(data.get("num_samples") or 0), int(data.get("seq_len") or 0), int(data.get("batch_size") or 0),
                   data.get("seq_len_reason"), data.get("source_path"),
                   HeldOutSplit.from_dict(split) if split else None, data.get("text_field"),
                   CalibrationSize.from_dict(actual) if actual else None)


@dataclass(frozen=True)
class PlanEngine:
    """The plan's ``engine``: which engine of the registry (plan/engines/) runs the plan, and why."""

    name: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanEngine:
        return cls(str(data["name"]), str(data["reason"]))


@dataclass(frozen=True)
class DeviceStrategy:
    """The plan's ``device_strategy``: the torch device the engine runs on, whether it spreads the model over the
    host's GPUs, and how many GPUs the host has."""

    device: str  # cpu | cuda
    multi_device: bool
    gpu_count: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceStrategy:
        """Exact for a plan's section; a hand-edited one without ``gpu_count`` reads it as 0."""
        return cls(str(data["device"]), bool(data["multi_device"]), int(data.get("gpu_count") or 0))


@dataclass(frozen=True)
class SourceReading:
    """The plan's ``source_reading`` (plan/source_reading.py): how the engine reads the source, and the staged copy
    (BF16, or safetensors converted from .bin) made after the execution gate when it cannot read it as it is."""

    format: str  # the source format (intake/formats.py)
    source_dir: str  # what validation, the load check and Tier 1's baseline read
    engine_reads: str  # what the engine reads
    disk_bytes: int  # the staged copy's size on disk (0: none)
    mode: str  # direct | file2file_native | stage_bf16 | convert_bin
    reason: str

    @property
    def staged(self) -> bool:
        """Whether a copy of the source is made before the engine runs."""
        return self.mode != "direct"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SourceReading | None:
        """None for a plan written before the plan recorded it (``{}``)."""
        if not data:
            return None
        return cls(str(data["format"]), str(data["source_dir"]), str(data["engine_reads"]), int(data["disk_bytes"]),
                   str(data["mode"]), str(data["reason"]))
