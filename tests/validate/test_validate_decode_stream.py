"""The decode check streams each weight a tile at a time (validate/decode_blocks.py): its memory
follows the tile, not the tensor, whatever the layout (transposed int4 words, fp4 pairs, a fused
expert's [in, out] slice) and however many workers run; cutting a weight into tiles changes no
verdict; and a zero scale is judged (healthy over all-zero source rows, a finding over rows that
are not), its numpy warnings never printed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import quark_ptq_eval.validate.decode_blocks as blocks
import quark_ptq_eval.validate.decode_weights as weights
from quark_ptq_eval.base.safetensors_io import read_model_headers
from quark_ptq_eval.validate.decode import decode_export
from quark_ptq_eval.validate.decode_targets import find_targets
from tests.fixtures.decode_faults import PLANTERS
from tests.validate.test_validate import read_tensors, write_tensors

MODULE = "model.layers.0.self_attn.q_proj"
ROW = 7


def _targets(export: Path, source: Path):
    qconfig = json.loads((export / "config.json").read_text())["quantization_config"]
    return find_targets(read_model_headers(export), read_model_headers(source), qconfig)[0]


def _comparisons(export: Path, source: Path) -> dict:
    return {t.weight.name: weights.compare(t, 0.3, rtn_reference=True) for t in _targets(export, source)}


def test_tiles_of_a_few_elements_give_the_same_verdicts(tiny_llama, quantized, tmp_path, monkeypatch):
    """Every format, healthy and with a row negated, decoded whole and in tiles of 96 elements (32
    columns where a transposed tensor is read by groups): the same worst element of every row, the
    same rows and groups over, the same findings; the per-row sums agree to float64 rounding."""
    cases = []
    for scheme in ("int8", "fp8", "int4_wo_32", "mxfp4"):
        export = quantized(scheme)
        planted = Path(shutil.copytree(export, tmp_path / scheme))
        tensors = read_tensors(export)
        PLANTERS["negate_row"](tensors, MODULE)
        write_tensors(planted / "model.safetensors", tensors)
        cases += [export, planted]
    whole = {p: (_comparisons(p, tiny_llama), decode_export(tiny_llama, p)) for p in cases}
    monkeypatch.setattr(blocks, "TILE_ELEMENTS", 96)
    monkeypatch.setattr(blocks, "COLUMN_TILE", 32)
    monkeypatch.setattr(weights, "CHUNK_ELEMENTS", 40)
    for path, (before, report) in whole.items():
        after = _comparisons(path, tiny_llama)
        for name, a in before.items():
            b = after[name]
            assert np.array_equal(a.worst_steps, b.worst_steps) and np.array_equal(a.worst_col, b.worst_col), name
            assert a.over == b.over, name
            for x, y in ((a.gain, b.gain), (a.rel_error, b.rel_error), (a.rtn_error, b.rtn_error)):
                np.testing.assert_allclose(x, y, rtol=1e-12)
        tiled = decode_export(tiny_llama, path)
        assert [f.line() for f in tiled.findings] == [f.line() for f in report.findings], path.name
        assert tiled.status == report.status == ("fail" if path.parent == tmp_path else "pass"), path.name


def _with_zero_scale(export: Path, source: Path, tmp_path: Path, zero_source_row: bool) -> tuple[Path, Path]:
    """An int4 per-group export whose ``MODULE`` row ``ROW`` has scale 0 (and, if asked, a source whose row is 0)."""
    out = Path(shutil.copytree(export, tmp_path / f"export-{zero_source_row}"))
    tensors = read_tensors(export)
    dtype, shape, data = tensors[f"{MODULE}.weight_scale"]  # F32 [groups, out]
    scale = np.frombuffer(data, np.float32).reshape(shape).copy()
    scale[:, ROW] = 0.0
    tensors[f"{MODULE}.weight_scale"] = (dtype, shape, scale.tobytes())
    write_tensors(out / "model.safetensors", tensors)
    src = source
    if zero_source_row:
        src = Path(shutil.copytree(source, tmp_path / "source-zero-row"))
        st = read_tensors(source)
        dtype, shape, data = st[f"{MODULE}.weight"]
        w = np.frombuffer(data, np.float32).reshape(shape).copy()  # the tiny model is float32
        w[ROW] = 0.0
        st[f"{MODULE}.weight"] = (dtype, shape, w.tobytes())
        write_tensors(src / "model.safetensors", st)
    return src, out


def test_a_zero_scale_is_healthy_over_zero_rows_and_a_finding_over_others_never_a_warning(
        tiny_llama, quantized, tmp_path, cli):
    export = quantized("int4_wo_128")
    assert read_tensors(export)[f"{MODULE}.weight_scale"][0] == "F32"
    src, out = _with_zero_scale(export, tiny_llama, tmp_path, zero_source_row=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        healthy = decode_export(src, out)
        src2, out2 = _with_zero_scale(export, tiny_llama, tmp_path, zero_source_row=False)
        broken = decode_export(src2, out2)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    assert healthy.status == "pass", [f.line() for f in healthy.findings]
    lines = [f.line() for f in broken.findings]
    assert len(lines) == 1 and "zero scale" in lines[0] and f"output rows ({ROW})" in lines[0], lines
    assert f"{MODULE}.weight" in lines[0] and "divide by zero" in lines[0], lines
    result = cli("validate", "--source", src2, "--quantized", out2, "--no-load-check", "--workdir", tmp_path / "wd")
    assert result.rc == 4, result.err
    assert "zero scale" in result.err and "RuntimeWarning" not in result.out + result.err, result.err


MEMORY_CHILD = r"""
import json, resource, sys
from pathlib import Path
import numpy as np
from quark_ptq_eval.validate.decode import decode_export

root, workers = Path(sys.argv[1]), int(sys.argv[2])
warm = decode_export(root / "small-source", root / "small-export", workers=1)  # imports, tables, thread start-up
assert warm.status == "pass", [f.line() for f in warm.findings]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
result = decode_export(root / "source", root / "export", workers=workers)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"status": result.status, "checked": result.stats["checked"], "growth": after - before,
                  "findings": [f.line() for f in result.findings]}))
"""


def _sparse(path: Path, tensors: list[tuple[str, str, list[int]]], values: dict[str, bytes]) -> None:
    """A safetensors file whose payloads are holes (read as zeros) but for ``values``."""
    header, offset, size = {}, 0, {"BF16": 2, "F8_E4M3": 1, "F32": 4, "I32": 4}
    for name, dtype, shape in tensors:
        n = int(np.prod(shape)) * size[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        fh.truncate(8 + len(raw) + offset)
        for name, data in values.items():
            fh.seek(8 + len(raw) + header[name]["data_offsets"][0])
            fh.write(data)


def _sparse_pair(root: Path, rows: int, cols: int, linears: int) -> None:
    """A source of ``linears`` BF16 [rows, cols] weights and its export: fp8 per tensor (codes
    [out, in]) and int4 per group of 128 (Quark's transposed words [in, out / 8], scales [groups, out])."""
    src, out, fills = [], [], {}
    fp8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "group_size": None}
    int4 = {"dtype": "int4", "qscheme": "per_group", "group_size": 128, "symmetric": True}
    layers = {}
    for i in range(linears):
        name = f"model.layers.{i}.mlp.up_proj"
        src.append((f"{name}.weight", "BF16", [rows, cols]))
        if i % 2:
            layers[name] = {"weight": int4}
            out += [(f"{name}.weight", "I32", [cols, rows // 8]), (f"{name}.weight_scale", "F32", [cols // 128, rows]),
                    (f"{name}.weight_zero_point", "I32", [cols // 128, rows // 8])]
            fills[f"{name}.weight_scale"] = np.full((cols // 128, rows), 0.01, np.float32).tobytes()
        else:
            out += [(f"{name}.weight", "F8_E4M3", [rows, cols]), (f"{name}.weight_scale", "F32", [])]
            fills[f"{name}.weight_scale"] = np.float32(0.01).tobytes()
    qconfig = {"quant_method": "quark", "global_quant_config": {"weight": fp8}, "layer_quant_config": layers,
               "exclude": [], "export": {"pack_method": "reorder"}}
    for d, tensors, values, config in ((root / "source", src, {}, {}),
                                       (root / "export", out, fills, {"quantization_config": qconfig})):
        d.mkdir(parents=True)
        _sparse(d / "model.safetensors", tensors, values)
        (d / "config.json").write_text(json.dumps({"model_type": "llama", **config}))


@pytest.mark.parametrize("workers", [1, 4])
def test_a_decode_worker_holds_a_tile_not_its_tensor(tmp_path, workers):
    """Four 256 MiB BF16 weights (fp8 and int4 per group, sparse files): the decode check's peak RSS,
    measured in a child from a warm start, grows by at most a few tiles per worker, where holding one
    tensor and its codes (as the check did) would take 384 MiB per worker."""
    rows, cols = 8192, 16384
    _sparse_pair(tmp_path, rows, cols, 4)
    _sparse_pair(tmp_path / "small", 256, 256, 2)
    for name in ("source", "export"):
        (tmp_path / f"small-{name}").symlink_to(tmp_path / "small" / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(blocks.__file__).parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(tmp_path), str(workers)], capture_output=True,
                          text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["status"] == "pass" and got["checked"] == 4, got
    tile = blocks.TILE_ELEMENTS * 3  # bytes: a tile's BF16 source and its codes
    bound = workers * 2 * tile + (32 << 20)
    tensor = rows * cols * 3
    print(f"workers {workers}: peak RSS grew {got['growth'] / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB; "
          f"one tensor and its codes: {tensor / 2**20:.0f} MiB)")
    assert got["growth"] < bound < tensor
