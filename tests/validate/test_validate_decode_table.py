"""The decode check's table path (validate/decode_table.py: a 16-bit source under one scale, each source bit
pattern decoded once) gives the general path's verdicts, on real Quark exports of a trained BF16 Llama with
outlier channels, healthy and with each fault the format can carry planted."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import quark_ptq_eval.validate.decode_weights as weights
from quark_ptq_eval.validate.decode import decode_export
from tests.fixtures.decode_faults import PLANTERS, applicable
from tests.validate.test_validate import read_tensors, write_tensors
from tests.validate.test_validate_decode_stream import _targets

MODULES = ("model.layers.0.mlp.up_proj", "model.layers.1.self_attn.o_proj")


def _general(monkeypatch: pytest.MonkeyPatch):
    """The general path alone: no weight gets a table."""
    monkeypatch.setattr(weights, "table_for", lambda *_: None)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_the_table_path_gives_the_general_paths_verdicts(scheme, tiny_model, quantized, tmp_path, monkeypatch):
    source, export = tiny_model("llama-traits"), quantized(scheme, arch="llama-traits")
    cases = [export]
    tensors = read_tensors(export)
    for module in MODULES:
        for fault in applicable(tensors, module):
            planted = tmp_path / f"{fault}-{module}"
            shutil.copytree(export, planted)
            changed = read_tensors(export)
            PLANTERS[fault](changed, module)
            write_tensors(planted / "model.safetensors", changed)
            cases.append(planted)
    targets = _targets(export, source)
    assert all(weights.table_for(t, weights.TileReader(t)) is not None for t in targets)  # every weight: a table
    fast = {case: (decode_export(source, case), {t.weight.name: weights.compare(t, 0.501)
                                                 for t in _targets(case, source)}) for case in cases}
    _general(monkeypatch)
    for case, (report, rows) in fast.items():
        general = decode_export(source, case)
        assert [f.line() for f in report.findings] == [f.line() for f in general.findings], case.name
        assert report.status == general.status == ("pass" if case == export else "fail"), case.name
        for t in _targets(case, source):
            slow = weights.compare(t, 0.501)
            assert rows[t.weight.name].over == slow.over, (case.name, t.weight.name)
            # the table's error is exact; the general path's may be its upper bound: never more
            assert np.all(rows[t.weight.name].worst_steps <= slow.worst_steps + 1e-6), (case.name, t.weight.name)
    assert len(cases) > 4  # faults were planted into both modules


def test_a_table_is_not_used_where_the_source_is_float32_or_scales_vary(tiny_llama, quantized):
    for scheme in ("int8", "int4_wo_128"):  # a float32 source; and per-group scales besides
        for t in _targets(Path(quantized(scheme)), Path(tiny_llama)):
            assert weights.table_for(t, weights.TileReader(t)) is None, t.weight.name
