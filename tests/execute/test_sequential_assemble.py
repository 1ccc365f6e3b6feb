"""The sequential engine's writer (execute/engines/assemble.py) against safetensors' own: the same bytes for every
dtype torch writes, shards and an index a loader reads back, and an all-zero tensor written as a hole."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from quark_ptq_eval.execute.engines.assemble import (
    header_bytes,
    part_tensors,
    write_export,
    write_safetensors,
)

DTYPES = (torch.float64, torch.int64, torch.uint64, torch.float32, torch.int32, torch.uint32, torch.bfloat16,
          torch.float16, torch.uint16, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.float8_e8m0fnu)


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate(DTYPES):
        values = torch.randint(0, 7, (3, 5), generator=g)
        out[f"m.{chr(ord('z') - i)}.w{i}"] = values.to(dtype)
    out["m.scalar"] = torch.tensor(1.5)
    return out


def test_one_file_is_safetensors_own_bytes_for_every_dtype(tmp_path):
    tensors = sample()
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    ours = write_safetensors(tmp_path / "ours.safetensors", part_tensors(tmp_path / "ref.safetensors"))
    assert ours.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    head, ordered = header_bytes(part_tensors(tmp_path / "ref.safetensors"))
    assert len(head) % 8 == 0 and [t.name for t in ordered][-1].endswith("w12")  # BOOL sorts last


def test_several_shards_get_an_index_and_read_back_the_same_tensors(tmp_path):
    tensors = {f"model.layers.{i}.w": torch.full((64,), float(i)) for i in range(6)}
    save_file(tensors, tmp_path / "parts.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    out.mkdir()
    ordered = sorted(part_tensors(tmp_path / "parts.safetensors"), key=lambda t: int(t.name.split(".")[2]))
    paths = write_export(out, ordered, max_bytes=2 * 64 * 4)
    assert [p.name for p in paths] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.0.w"] == paths[0].name and index["weight_map"]["model.layers.5.w"] == paths[2].name
    assert index["metadata"]["total_size"] == 6 * 64 * 4
    loaded = {k: v for p in paths for k, v in load_file(p).items()}
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_an_all_zero_tensor_is_written_as_a_hole(tmp_path):
    big = torch.zeros(96 * 2**20, dtype=torch.uint8)  # more than one 64 MiB chunk
    save_file({"z": big, "s": torch.ones(4)}, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    ours = write_safetensors(tmp_path / "ours.safetensors", part_tensors(tmp_path / "ref.safetensors"))
    assert ours.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert ours.stat().st_blocks * 512 < 40 * 2**20  # the 64 MiB zero chunk took no disk
