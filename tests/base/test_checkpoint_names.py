"""Issue 31: exclusions written in a checkpoint's names applied in the loaded model's names, one side
for one cause of a changed header, and failure hints that name what was asked. No quark import."""

from __future__ import annotations

from pathlib import Path

from quark_ptq_eval.base.legacy_exclusions import legacy_exclusions, loaded_name_exclusions
from quark_ptq_eval.base.safetensors_io import TensorInfo
from quark_ptq_eval.execute.classify import asked_of, classify_failure
from quark_ptq_eval.validate.widening import header_change


def _info(name: str, dtype: str = "BF16", shape: tuple[int, ...] = (4, 4), start: int = 0) -> TensorInfo:
    return TensorInfo(name, dtype, shape, Path("/x.safetensors"), start, start + 32)


def test_a_checkpoint_name_pattern_is_rewritten_to_the_loaded_name():
    raw = {"head.weight": _info("head.weight"), "model.layers.1.ffn.gate.weight": _info("g", start=32),
           "model.layers.1.ffn.experts.0.w1.weight": _info("e", start=64)}
    aligned = {"lm_head.weight": raw["head.weight"], "model.layers.1.mlp.gate.weight": raw["model.layers.1.ffn.gate.weight"],
               "model.layers.1.mlp.experts.0.gate_proj.weight": raw["model.layers.1.ffn.experts.0.w1.weight"]}
    # DeepSeek-V4's template: the router and the head by their checkpoint names; the experts are not excluded
    assert sorted(legacy_exclusions(raw, aligned, ["head", "*ffn.gate*"])) == ["*mlp.gate*", "lm_head"]
    assert legacy_exclusions(raw, aligned, ["lm_head"]) == []  # already in the loaded names: nothing added


def test_deepseek_v4_checkpoint_names_are_predicted_with_transformers_renaming(tmp_path):
    """Without the model (the quark-cli plan), transformers' own renaming rules for the family give the names."""
    import numpy as np
    from safetensors.numpy import save_file

    names = ["head.weight", "model.embed_tokens.weight", "model.layers.0.attn.wq_a.weight",
             "model.layers.0.ffn.gate.weight", "model.layers.0.ffn.shared_experts.w1.weight"]
    save_file({n: np.zeros((4, 4), dtype=np.float32) for n in names}, str(tmp_path / "model.safetensors"))
    added = loaded_name_exclusions(tmp_path, "deepseek_v4", ["*attn*", "embed", "head", "*ffn.gate*"])
    assert "lm_head" in added and "*mlp.gate*" in added
    assert not any("shared_experts" in p for p in added)  # what the template quantizes stays quantized
    assert loaded_name_exclusions(tmp_path, "deepseek_v4", []) == []  # no exclusions asked: none added


def test_a_changed_header_has_one_side_for_one_cause():
    src = _info("lm_head.weight", "F32", (512, 128))
    assert header_change(src, _info("lm_head.weight", "BF16", (512, 128)))[0] == "environment"  # loaded as BF16
    # quantized, whether its codes keep the shape (int8, fp8) or pack it (int4, mxfp4): Quark's side alike
    for dtype, shape in (("I8", (512, 128)), ("F8_E4M3", (512, 128)), ("I32", (128, 64)), ("U8", (512, 64))):
        side, evidence = header_change(src, _info("lm_head.weight", dtype, shape))
        assert side == "quark" and "quantized" in evidence, dtype


def _calibration_traceback(message: str) -> list[str]:
    return ["[quark-ptq-eval] quantizing", "Traceback (most recent call last):",
            '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", line 134, in forward',
            "    return F.linear(input, self.weight, self.bias)", message]


def test_the_failure_hint_names_what_was_asked():
    argv = ["python", "-m", "x", "--quant_scheme", "int8", "--device", "cpu"]
    assert asked_of(argv) == {"scheme": "int8", "algorithm": None}
    dtype = classify_failure(_calibration_traceback(
        "RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16"), 1, asked_of(argv))
    assert dtype["cause"] == "dtype" and "algorithm" not in dtype["proposal"], dtype
    other = _calibration_traceback("RuntimeError: observer found an empty range")
    plain = classify_failure(other, 1, asked_of(argv))["proposal"]
    assert plain.startswith("Retry with another scheme than int8") and "algorithm" not in plain
    awq = classify_failure(other, 1, asked_of([*argv, "--quant_algo", "awq"]))["proposal"]
    assert awq.startswith("Retry without the algorithm awq")
