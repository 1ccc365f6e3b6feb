"""Small, exact, defensive reading of safetensors checkpoints: headers and byte ranges only.

Nothing here imports torch or loads tensor payloads. Every malformed or hostile input
(bad length field, non-JSON header, overlapping offsets, unknown dtypes, index entries that
escape the model directory, symlink loops) is refused with one :class:`UnsafeInputError`
sentence, without reading past the file or allocating a claimed size.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UnsafeInputError

# Bytes per element; sub-byte types are packed by Quark into U8/I32 containers.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "F4": 1, "F6_E2M3": 1, "F6_E3M2": 1, "C64": 8,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors reference implementation's own cap
MAX_JSON_DEPTH = 8
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset in ``file``
    end: int
    transposed: bool = False  # a fused-expert slice stored [in, out] for a linear's [out, in] (checkpoint_names)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    file: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int


class TruncatedFileError(UnsafeInputError):
    """A safetensors file whose header is whole and sound but whose data stops short (a partial download or copy):
    ``header`` holds every tensor it declares, ``data_end`` the absolute offset where its bytes stop."""

    def __init__(self, message: str, header: SafetensorsHeader, data_end: int):
        super().__init__(message)
        self.header, self.data_end = header, data_end


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Parse and check one safetensors header; never reads tensor payloads."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO planted as a shard must not hang; only regular files are read.
        with open(path, "rb", opener=_nonblocking) as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeInputError(f"{path} is not a regular file; refusing to read it as safetensors.")
            size = st.st_size
            if size < 8:
                raise UnsafeInputError(f"{path} is not a safetensors file: it is only {size} bytes long.")
            n = int.from_bytes(fh.read(8), "little")
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise UnsafeInputError(
                    f"{path} is corrupt: its header claims {n} bytes but the file holds {size - 8} after the length field."
                )
            raw = fh.read(n)
    except OSError as exc:
        raise UnsafeInputError(f"{path} cannot be read: {exc.strerror or exc}.") from None
    header = _parse_json_header(path, raw)
    data_start = 8 + n
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict):
        raise UnsafeInputError(f"{path} is corrupt: __metadata__ is not an object.")
    tensors = {name: _tensor_info(path, name, entry, data_start) for name, entry in header.items()}
    parsed = SafetensorsHeader(path, tensors, {str(k): str(v) for k, v in metadata.items()}, data_start)
    if (short := _check_layout(path, tensors, size - data_start, data_start)) is not None:
        raise TruncatedFileError(short, parsed, size)
    return parsed


def _nonblocking(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NONBLOCK)


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"{}[]")


def _parse_json_header(path: Path, raw: bytes) -> dict[str, Any]:
    # Depth is bounded before json.loads so a deeply nested header cannot exhaust the stack.
    depth = 0
    for b in raw.translate(None, _NOT_BRACKETS):  # only brackets matter: skip the rest in C
        if b in (0x7B, 0x5B):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise UnsafeInputError(f"{path} is corrupt: its header is nested deeper than any safetensors header.")
        elif b in (0x7D, 0x5D):
            depth -= 1
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise UnsafeInputError(f"{path} is corrupt: its header is not valid JSON.") from None
    if not isinstance(header, dict):
        raise UnsafeInputError(f"{path} is corrupt: its header is not a JSON object.")
    return header


def _tensor_info(path: Path, name: str, entry: object, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise UnsafeInputError(f"{path} is corrupt: the entry for tensor {name!r} is not an object.")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise UnsafeInputError(f"{path} uses an unknown dtype {dtype!r} for tensor {name!r}.")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise UnsafeInputError(f"{path} is corrupt: tensor {name!r} has an invalid shape {shape!r}.")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise UnsafeInputError(f"{path} is corrupt: tensor {name!r} has invalid data_offsets {offsets!r}.")
    begin, end = offsets
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end < begin or end - begin != expected:
        raise UnsafeInputError(
            f"{path} is corrupt: tensor {name!r} spans {end - begin} bytes but its shape and dtype need {expected}."
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + begin, data_start + end)


def _check_layout(path: Path, tensors: dict[str, TensorInfo], data_len: int, data_start: int) -> str | None:
    """Refuses overlapping tensors; returns the sentence for data that stops short (the caller decides)."""
    pos = data_start
    for t in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if t.start < pos:
            raise UnsafeInputError(f"{path} is corrupt: tensor {t.name!r} overlaps another tensor's bytes.")
        pos = t.end
    if pos - data_start > data_len:
        return f"{path} is truncated: its tensors need {pos - data_start} bytes of data but only {data_len} are present."
    return None


def _contained(root: Path, candidate: Path, what: str) -> Path:
    """Resolve ``candidate`` and refuse it unless it stays inside ``root``."""
    try:
        resolved = candidate.resolve(strict=True)
    except FileNotFoundError:
        raise UnsafeInputError(f"{what} {candidate} does not exist.") from None
    except (RuntimeError, OSError) as exc:  # symlink loops raise here
        raise UnsafeInputError(f"{what} {candidate} cannot be resolved ({exc}).") from None
    if not (resolved.is_relative_to(root) or _in_hub_cache_blobs(root, resolved)):
        raise UnsafeInputError(f"{what} {candidate} points outside the model directory {root}; refusing to follow it.")
    return resolved


def _in_hub_cache_blobs(root: Path, resolved: Path) -> bool:
    """A Hugging Face cache snapshot (``models--org--name/snapshots/REV``) links its files to
    the same repository's ``blobs/``: that one place outside the model dir is allowed."""
    repo = root.parent.parent
    return (root.parent.name == "snapshots" and repo.name.startswith("models--")
            and resolved.parent == repo / "blobs")


def weight_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The safetensors shards of a model directory, through its index when it has one."""
    root = Path(model_dir).resolve()
    index = root / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, RecursionError):
            raise UnsafeInputError(f"{index} is not a valid safetensors index.") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UnsafeInputError(f"{index} has no valid weight_map.")
        names = sorted(set(weight_map.values()))
        for name in names:
            if os.path.isabs(name) or ".." in Path(name).parts:
                raise UnsafeInputError(f"{index} names shard {name!r} outside the model directory; refusing to follow it.")
        return [_contained(root, root / name, "Shard") for name in names]
    return [_contained(root, p, "Shard") for p in sorted(root.glob("*.safetensors"))]


def read_model_headers(model_dir: str | os.PathLike[str],
                       truncated: dict[Path, TruncatedFileError] | None = None) -> dict[str, TensorInfo]:
    """All tensors of a model directory keyed by name (duplicates across shards are refused). With ``truncated``,
    a shard whose data stops short is kept by its header and recorded there instead of refused."""
    tensors: dict[str, TensorInfo] = {}
    for shard in weight_files(model_dir):
        try:
            header = read_header(shard)
        except TruncatedFileError as exc:
            if truncated is None:
                raise
            truncated[shard] = exc
            header = exc.header
        for name, info in header.tensors.items():
            if name in tensors:
                raise UnsafeInputError(f"Tensor {name!r} appears in both {tensors[name].file} and {shard}.")
            tensors[name] = info
    return tensors


def with_data(tensors: dict[str, TensorInfo], truncated: dict[Path, TruncatedFileError]) -> dict[str, TensorInfo]:
    """``tensors`` less every module with a tensor past a truncated shard's last byte (a module is judged whole or
    not at all: its weight without its scale decodes to nothing)."""
    if not truncated:
        return tensors
    ends = {path: exc.data_end for path, exc in truncated.items()}  # both paths as weight_files resolved them
    cut = {n.rpartition(".")[0] for n, t in tensors.items() if t.end > ends.get(t.file, t.end)}
    return {n: t for n, t in tensors.items() if n.rpartition(".")[0] not in cut}


def canonical_name(name: str) -> str:
    """``model.layers.12.mlp.up_proj.weight`` -> ``model.layers.*.mlp.up_proj.weight``."""
    return ".".join("*" if seg.isdigit() else seg for seg in name.split("."))
