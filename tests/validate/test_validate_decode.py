"""The decode check on real Quark exports: healthy ones pass with their worst error against the bound;
each planted fault (decode_faults.py, in Quark's own packing) fails naming the tensor and rows."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from quark_ptq_eval.validate.decode import decode_export
from tests.fixtures.decode_faults import PLANTERS, ROW, ZEROED, applicable
from tests.validate.test_validate import read_tensors, write_tensors

# (scheme, algorithm): the formats the issue names; q_proj (after a norm) and v_proj (a fold's prev linear)
EXPORTS = (("int8", None), ("fp8", None), ("int4_wo_32", None), ("mxfp4", None), ("int4_wo_128", "awq"),
           ("int4_wo_128", "gptq"))
MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")
ROWS_NAMED = {"negate_row": str(ROW), "zero_rows": f"{ZEROED[0]}-{ZEROED[-1]}", "zero_point_step": str(ROW),
              "mx_exponent": str(ROW)}


@pytest.fixture(scope="module")
def exports(quantized):
    return {key: quantized(key[0], algorithm=key[1]) for key in EXPORTS}


def _planted(tmp: Path, export: Path, fault: str, module: str) -> tuple[Path, str]:
    out = Path(shutil.copytree(export, tmp / f"{export.name}-{fault}-{module.rsplit('.', 1)[-1]}"))
    tensors = read_tensors(export)
    what = PLANTERS[fault](tensors, module)
    write_tensors(out / "model.safetensors", tensors)
    return out, what


def test_healthy_exports_decode_within_their_bound(tiny_llama, exports):
    for (scheme, algo), export in exports.items():
        result = decode_export(tiny_llama, export)
        assert result.status == "pass", (scheme, algo, [f.line() for f in result.findings])
        assert result.stats["checked"] == result.stats["quantized_weights"] == 14
        limit = 4.0 if algo == "gptq" else 0.501
        assert 0 < result.stats["worst_steps"] <= limit
        if algo != "gptq":  # round-to-nearest is exact: some element sits at (or within float noise of) a tie
            assert result.stats["worst_steps"] >= 0.49
        print(f"{scheme} {algo or 'rtn'}: worst {result.stats['worst_steps']} step, bound {result.stats['bound']}")


def test_every_planted_fault_fails_naming_tensor_and_rows(tiny_llama, exports, tmp_path):
    caught, planted = 0, 0
    for (scheme, algo), export in exports.items():
        tensors = read_tensors(export)
        for module in MODULES:
            for fault in applicable(tensors, module):
                out, what = _planted(tmp_path, export, fault, module)
                result = decode_export(tiny_llama, out)
                planted += 1
                lines = [f.line() for f in result.findings if not f.benign]
                assert lines, f"{scheme}/{algo}: {what} passed the decode check"
                caught += 1
                text = "\n".join(lines)
                if fault != "scale_25" or algo != "awq":
                    assert f"{module}.weight" in text, (what, text)
                assert re.search(r"output rows \(", text), (what, text)  # the rows are always named
                per_row = fault != "zero_point_step" or tensors[f"{module}.weight_zero_point"][0] == "I32"
                if fault in ROWS_NAMED and algo is None and per_row:  # a per-tensor zero point shifts every row
                    assert re.search(rf"\({ROWS_NAMED[fault]}\)", text), (what, text)
                shutil.rmtree(out)
    print(f"decode faults: {caught}/{planted} caught")
    assert planted >= 50


def test_a_planted_fault_fails_validate_with_exit_4(tiny_llama, quantized, cli, tmp_path):
    out, _ = _planted(tmp_path, quantized("int8"), "negate_row", "model.layers.0.self_attn.q_proj")
    result = cli("validate", "--source", tiny_llama, "--quantized", out, "--no-load-check", "--workdir", tmp_path)
    assert result.rc == 4, result.err
    assert "[decode]" in result.err and "model.layers.0.self_attn.q_proj.weight" in result.err
    assert "output rows (5)" in result.err
    assert "QUARK-INFO" not in result.out + result.err


def test_fused_expert_slices_stored_transposed_decode_and_a_fault_in_one_fails(tiny_model, quantized, cli, tmp_path):
    """gpt-oss stores its experts fused, ``[E, in, out]``: each expert's slice is transposed against the
    linear Quark exports (``[out, in]``). Decoded in its stored orientation, the healthy export passes
    with every expert checked; a row negated in one expert's codes fails ``validate`` with exit 4."""
    source, export = tiny_model("gpt_oss"), quantized("int8", arch="gpt_oss")
    healthy = decode_export(source, export)
    assert healthy.status == "pass", [f.line() for f in healthy.findings]
    assert healthy.stats["checked"] == healthy.stats["quantized_weights"] > 16  # 16 expert slices among them
    assert not [n for n in healthy.notes if n.startswith("not checked")], healthy.notes
    module = "model.layers.0.mlp.experts.1.down_proj"
    out, _ = _planted(tmp_path, export, "negate_row", module)
    result = cli("validate", "--source", source, "--quantized", out, "--no-load-check", "--workdir", tmp_path / "wd")
    assert result.rc == 4, result.err
    assert f"{module}.weight" in result.err and f"output rows ({ROW})" in result.err, result.err
