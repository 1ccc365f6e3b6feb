"""The sequential engine's last step: its parts' tensors written as one export, never held whole.

Each part (a decoder block, the entry and exit) was exported by Quark's exporter on its own. Here their tensors
are written into the shards ``save_pretrained`` writes (its 50 GB default: one ``model.safetensors`` when the
model is smaller, else ``model-0000k-of-0000n.safetensors`` and an index), streamed tensor by tensor from the
parts' files, in safetensors' own layout: tensors ordered by dtype then name, a compact JSON header padded
with spaces to 8 bytes.
 So a model that fits gives the bytes the whole-model engine writes
(tests/execute/test_sequential_engine.py holds it to that).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.safetensors_io import TensorInfo, read_header

MAX_SHARD_BYTES = 50 * 10**9  # transformers 5's save_pretrained default ("50GB": decimal units)
# safetensors writes tensors by dtype (its enum's order, descending), then by name: measured against save_file
# for every dtype torch writes (tests/execute/test_sequential_assemble.py); the sub-byte ones sort last but BOOL.
DTYPE_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E8M0", "F8_E4M3",
               "F8_E5M2", "I8", "U8", "F6_E3M2", "F6_E2M3", "F4", "BOOL")
CHUNK = 64 * 2**20


def part_tensors(path: Path) -> list[TensorInfo]:
    """A part file's tensors (their names are the export's)."""
    return list(read_header(path).tensors.values())


def shard_plan(tensors: list[TensorInfo], max_bytes: int = MAX_SHARD_BYTES) -> list[list[TensorInfo]]:
    """Greedy in model order, as ``split_torch_state_dict_into_shards`` cuts a state dict."""
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_export(out: Path, tensors: list[TensorInfo], max_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """The shards (and the index when there are several), each written to a temporary name and renamed."""
    shards = shard_plan(tensors, max_bytes)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    paths = []
    for name, shard in zip(names, shards, strict=True):
        paths.append(write_safetensors(out / name, shard))
    if len(shards) > 1:
        weight_map = {t.name: name for name, shard in zip(names, shards, strict=True) for t in shard}
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": dict(sorted(weight_map.items()))}
        _atomic_text(out / "model.safetensors.index.json", json.dumps(index, indent=2, sort_keys=True) + "\n")
    return paths


def header_bytes(tensors: list[TensorInfo]) -> tuple[bytes, list[TensorInfo]]:
    """safetensors' header for ``tensors`` (``{"format": "pt"}`` as torch writes it) and their order in the file."""
    ordered = sorted(tensors, key=lambda t: (DTYPE_ORDER.index(t.dtype), t.name))
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in ordered:
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                           "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, ordered


def write_safetensors(path: Path, tensors: list[TensorInfo]) -> Path:
    head, ordered = header_bytes(tensors)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        for t in ordered:
            _copy_bytes(t, f)
        f.truncate()  # a hole at the end still counts in the file's length
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _copy_bytes(info: TensorInfo, dst: Any) -> None:
    """One tensor's bytes, copied in chunks. A chunk of zeros is skipped over, not written (``cp --sparse``): the
    file reads the same, and an all-zero real-size test checkpoint costs no disk (trained weights are never zero
    for 64 MiB, so a real export is written whole)."""
    with open(info.file, "rb") as src:
        src.seek(info.start)
        left = info.nbytes
        while left:
            chunk = src.read(min(CHUNK, left))
            if not chunk:
                raise OSError(f"{info.file} ended {left} bytes early")
            if chunk.count(0) == len(chunk):
                dst.seek(len(chunk), os.SEEK_CUR)
            else:
                dst.write(chunk)
            left -= len(chunk)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
