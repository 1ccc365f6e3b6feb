"""Expectations derived from Quark quantization specs, and config/tokenizer triage, on small inputs."""

from __future__ import annotations

import json

from quark_ptq_eval.base.schemes import dtype_bits
from quark_ptq_eval.validate.configdiff import json_diff, triage_json
from quark_ptq_eval.validate.expectations import activation_expectations, module_config, weight_expectations
from quark_ptq_eval.validate.tokenizer_content import differing_aspects, tokenizer_content


def spec(dtype, qscheme, **kw):
    return {"dtype": dtype, "qscheme": qscheme, "is_dynamic": False, "is_scale_quant": False, **kw}


def by_suffix(expectations):
    return {e.suffix: e for e in expectations}


def test_dtype_bits_come_from_the_dtype_name():
    assert [dtype_bits(d) for d in ("int8", "uint4", "fp8_e4m3", "fp4", "fp6_e2m3", "mx6", None)] == [
        8, 4, 8, 4, 6, None, None]


def test_per_group_uint4_packs_weight_and_zero_points():
    e = by_suffix(weight_expectations(spec("uint4", "per_group", group_size=32, ch_axis=-1), (64, 128)))
    assert e["weight"].nbytes() == 64 * 128 // 2 and "I32" in e["weight"].containers
    assert e["weight_scale"].count == 64 * 4 and e["weight_scale"].bits is None  # a float scale
    assert e["weight_zero_point"].count == 256 and e["weight_zero_point"].nbytes() == 128


def test_a_scale_quantizing_second_level_stores_first_level_scales_in_its_dtype():
    weight = [spec("fp4", "per_group", group_size=16, ch_axis=-1, scale_format="float32"),
              spec("fp8_e4m3", "per_tensor", is_scale_quant=True)]
    e = by_suffix(weight_expectations(weight, (32, 64)))
    assert set(e) == {"weight", "weight_scale", "weight_scale_2"}
    assert e["weight_scale"].containers >= {"F8_E4M3"} and e["weight_scale"].nbytes() == 32 * 4
    assert e["weight_scale_2"].count == 1


def test_dynamic_activations_store_nothing_and_static_ones_a_scale():
    assert activation_expectations("input", {**spec("fp8_e4m3", "per_tensor"), "is_dynamic": True}) == []
    e = by_suffix(activation_expectations("input", spec("int8", "per_tensor")))
    assert set(e) == {"input_scale", "input_zero_point"}


def test_layer_overrides_win_over_the_global_config():
    qconfig = {"global_quant_config": {"weight": spec("int8", "per_tensor")},
               "layer_quant_config": {"*down_proj": {"weight": spec("fp8_e4m3", "per_tensor")}}}
    assert module_config(qconfig, "model.layers.3.mlp.down_proj").source == "layer_quant_config['*down_proj']"
    assert module_config(qconfig, "model.layers.3.mlp.up_proj").source == "global_quant_config"


def test_json_diff_names_each_path():
    diffs = json_diff({"a": {"b": [1, 2]}, "c": 1}, {"a": {"b": [1, 3]}, "d": 2})
    assert [(d.path, d.kind) for d in diffs] == [("c", "only_in_source"), ("d", "only_in_output"),
                                                 ("a.b[1]", "changed")]


def test_drift_triage_separates_renames_and_stamps_from_real_changes():
    source = {"torch_dtype": "bfloat16", "rope_theta": 1e4, "rope_scaling": None, "transformers_version": "4.50",
              "hidden_size": 64}
    output = {"dtype": "bfloat16", "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"},
              "transformers_version": "5.1", "hidden_size": 64}
    real, benign = triage_json(source, output)
    assert real == [] and {d.path for d in benign} == {"torch_dtype", "dtype", "rope_theta", "rope_scaling",
                                                       "rope_parameters", "transformers_version"}
    real, _ = triage_json(source, {**output, "dtype": "float16"})
    assert [d.path for d in real] == ["dtype"]


def test_tokenizer_content_ignores_packaging(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    model = {"type": "BPE", "vocab": {"x": 0, "y": 1, "xy": 2}}
    (a / "tokenizer.json").write_text(json.dumps({"model": {**model, "merges": ["x y"]}, "added_tokens": []}))
    (b / "tokenizer.json").write_text(json.dumps({"model": {**model, "merges": [["x", "y"]]}, "added_tokens": []},
                                                 indent=2))
    (a / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "x"}}))
    (b / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x"}))
    assert differing_aspects(tokenizer_content(a), tokenizer_content(b)) == []
    (b / "tokenizer_config.json").write_text(json.dumps({"eos_token": "y"}))
    assert differing_aspects(tokenizer_content(a), tokenizer_content(b)) == [
        "special token id eos_token", "special token eos_token"]  # "y" is another token, with another id


def test_stored_shapes_follow_quarks_packing():
    """Shapes read off real Quark 0.13 exports of a [128, 256] weight (see expectations.py)."""
    def shapes(weight):
        return {e.suffix: e.shape for e in weight_expectations(weight, (128, 256))}

    assert shapes(spec("int8", "per_tensor")) == {"weight": (128, 256), "weight_scale": (), "weight_zero_point": ()}
    assert shapes(spec("uint4", "per_group", group_size=128, ch_axis=-1)) == {
        "weight": (256, 16), "weight_scale": (2, 128), "weight_zero_point": (2, 16)}  # transposed, 8 per int32
    assert shapes(spec("int4", "per_channel", ch_axis=0)) == {
        "weight": (128, 32), "weight_scale": (128,), "weight_zero_point": (16,)}
    assert shapes(spec("fp4", "per_group", group_size=32, ch_axis=-1, scale_format="e8m0")) == {
        "weight": (128, 128), "weight_scale": (128, 8)}
    e = by_suffix(weight_expectations(spec("fp4", "per_group", group_size=32, ch_axis=-1, scale_format="e8m0"),
                                      (128, 256)))
    assert e["weight"].containers == {"U8"} and e["weight_scale"].containers == {"U8", "F8_E8M0"}
    assert by_suffix(weight_expectations(spec("int8", "per_tensor"), (4, 4)))["weight"].containers == {"I8"}
