"""Deployment targets: the plan follows where the model will be served, not only this host."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml

from quark_ptq_eval.base import contracts
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.intake import analyze_model
from quark_ptq_eval.plan import PlanRequest, make_plan
from quark_ptq_eval.plan.targets import TARGETS

LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256}


def header_only_llama(out: Path, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                      num_attention_heads: int, num_key_value_heads: int, vocab_size: int) -> Path:
    """A Llama checkpoint whose safetensors file holds a real header and a sparse (never written)
    payload: intake reads the exact tensor list and sizes; no weights exist on disk."""
    h, kv = hidden_size, num_key_value_heads * (hidden_size // num_attention_heads)
    shapes = {"model.embed_tokens.weight": [vocab_size, h], "model.norm.weight": [h], "lm_head.weight": [vocab_size, h]}
    for i in range(num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": [h, h], p + "self_attn.k_proj.weight": [kv, h],
                   p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, h],
                   p + "mlp.gate_proj.weight": [intermediate_size, h], p + "mlp.up_proj.weight": [intermediate_size, h],
                   p + "mlp.down_proj.weight": [h, intermediate_size], p + "input_layernorm.weight": [h],
                   p + "post_attention_layernorm.weight": [h]}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)  # sparse: the payload takes no disk space
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": intermediate_size, "num_hidden_layers": num_hidden_layers,
              "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
              "vocab_size": vocab_size, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config))
    return out


def cpu_env(host_memory_gb: float = 64.0) -> dict:
    return {"environment": {"os": "Linux", "python": "3.11", "containerized": False},
            "hardware": {"accelerator": "cpu", "gpu_arch": None, "gpu_count": 0, "host_memory_gb": host_memory_gb}}


@pytest.fixture(scope="module")
def tiny_analysis(tiny_llama, catalog):
    return analyze_model(str(tiny_llama), offline=True, catalog=catalog)


@pytest.fixture(scope="module")
def llama8b_analysis(tmp_path_factory, catalog):
    model = header_only_llama(tmp_path_factory.mktemp("llama8b") / "llama-8b", **LLAMA_8B)
    return analyze_model(str(model), offline=True, catalog=catalog)


@pytest.fixture
def plan(catalog, tmp_path, corpus):
    def make(analysis, goal="", target=None, env=None, **request):
        req = PlanRequest(goal=goal, target=target, calib_data=str(corpus), **request)
        return make_plan(analysis, env or cpu_env(), req, catalog, tmp_path / "a.json", tmp_path / "out")
    return make


def decision(plan_, name):
    return next(d for d in plan_.decisions if d["decision"] == name)


def test_the_goal_names_the_target_fp8_with_an_fp8_kv_cache_on_mi300x(plan, tiny_analysis):
    p = plan(tiny_analysis, "fp8 for MI300X, accuracy first")
    assert (p.global_scheme, p.kv_cache_scheme, p.algorithm) == ("fp8", "fp8", None)
    assert p.target["name"] == "mi300x" and p.target["arch"] == "gfx942" and p.target["warnings"] == []
    for name in ("target", "global_scheme", "kv_cache_scheme"):
        reason = decision(p, name)["reason"]
        assert "MI300X" in reason and "gfx942" in reason, reason
    assert "detected cpu" not in decision(p, "global_scheme")["reason"]
    assert contracts.schema_errors("quant_plan", p.to_dict()) == []


# (target, goal) -> scheme, KV-cache scheme: at least five targets, for the demo model and an 8 B shape
MATRIX = [
    ("mi300x", "", "fp8", "fp8"),
    ("mi300x", "accuracy first", "ptpc_fp8", "fp8"),
    ("mi300x", "smallest model", "int4_wo_128", "fp8"),
    ("mi355x", "", "mxfp4", "fp8"),
    ("mi355x", "accuracy first", "fp8", "fp8"),
    ("h100", "", "fp8", "fp8"),
    ("h200", "fastest", "fp8", "fp8"),
    ("b200", "", "nvfp4", "fp8"),
    ("a100", "", "int8", "fp8"),
    ("cpu", "", "int8", None),
    ("cpu", "accuracy first", "int8", None),
]


@pytest.mark.parametrize("model", ["tiny", "8b"])
@pytest.mark.parametrize("target, goal, scheme, kv", MATRIX)
def test_target_times_priority_decides_scheme_and_kv_cache(plan, tiny_analysis, llama8b_analysis, catalog, model,
                                                          target, goal, scheme, kv):
    p = plan(tiny_analysis if model == "tiny" else llama8b_analysis, goal, target=target)
    assert (p.global_scheme, p.kv_cache_scheme) == (scheme, kv)
    assert p.global_scheme in catalog["schemes"]
    label, arch = TARGETS[target].label, TARGETS[target].arch
    for name in ("global_scheme", "kv_cache_scheme", "serving fit"):
        assert label in decision(p, name)["reason"], decision(p, name)
    assert arch in decision(p, "global_scheme")["reason"]
    if goal.startswith("accuracy") and scheme == "int8":
        assert p.algorithm is None  # SmoothQuant at Quark's alpha 1 is measured by --remedies, never added by rule
        assert "--remedies" in decision(p, "algorithm")["reason"]


def test_a_format_the_target_cannot_run_natively_is_allowed_but_warned(plan, tiny_analysis):
    p = plan(tiny_analysis, "nvfp4 for MI300X")
    assert p.global_scheme == "nvfp4"
    warnings = [d["reason"] for d in p.decisions if d["decision"] == "warning"]
    assert warnings and "no native support on MI300X" in warnings[0] and "gfx942" in warnings[0]
    assert p.target["warnings"] == warnings
    assert not plan(tiny_analysis, "nvfp4", target="b200").target["warnings"]  # Blackwell runs it natively


def test_a_memory_budget_picks_the_most_accurate_scheme_that_fits(plan, llama8b_analysis):
    p = plan(llama8b_analysis, "must fit one MI300X with 32k context")
    assert p.global_scheme == "ptpc_fp8" and p.kv_cache_scheme == "fp8"
    fit = p.target["serving_fit"]
    assert fit["context"] == 32768 and fit["fits_budget"] and fit["devices_needed"] == 1
    assert "meets your budget" in decision(p, "global_scheme")["reason"]
    tight = plan(llama8b_analysis, "must fit one L40S with 128k context, batch 8")
    assert tight.global_scheme == "int4_wo_128"  # the smallest it serves, said so
    assert "no scheme meets your budget" in decision(tight, "global_scheme")["reason"]
    assert tight.target["serving_fit"]["devices_needed"] > 1


def test_an_unknown_target_is_refused_with_the_known_ones(plan, tiny_analysis):
    with pytest.raises(UsageError, match="Unknown deployment target 'tpu-v5'"):
        plan(tiny_analysis, target="tpu-v5")


def test_without_a_target_the_plan_speaks_of_this_host(plan, tiny_analysis):
    p = plan(tiny_analysis)
    assert p.target["name"] is None and p.global_scheme == "int8" and p.kv_cache_scheme is None
    assert "this host" in decision(p, "kv_cache_scheme")["reason"]


def test_cli_run_plan_only_reads_the_target_from_the_goal(cli, tiny_llama, corpus, tmp_path):
    wd = tmp_path / "work"
    res = cli("run", tiny_llama, "-o", tmp_path / "out", "--workdir", wd, "--goal", "fp8 for MI300X, accuracy first",
              "--calib-data", corpus, "--offline", "--yes", "--execution-mode", "plan_only")
    assert res.rc == 0, res.err
    saved = json.loads((wd / "quant_plan.json").read_text())
    assert (saved["global_scheme"], saved["kv_cache_scheme"]) == ("fp8", "fp8")
    assert saved["target"]["name"] == "mi300x"
    argv = yaml.safe_load((wd / "run_manifest.yaml").read_text())["command"]["argv"]
    assert argv[argv.index("--kv_cache_dtype") + 1] == "fp8"
    assert not (tmp_path / "out").exists()


def test_the_plan_predicts_the_decode_speed_up_from_the_bytes_moved_per_generated_token(plan, llama8b_analysis):
    """fp8 weights and an fp8 KV cache on MI300X, at the speed tier's GPU workload (batch 64, mean context
    1024 + 512): (BF16 weights + 64 x 1536 x BF16 KV) / (fp8 export + 64 x 1536 x fp8 KV), both per token."""
    from quark_ptq_eval.base.sizes import kv_bytes_per_token_of

    p = plan(llama8b_analysis, "", target="mi300x")
    predicted, fit = p.target["decode_speedup"], p.target["serving_fit"]
    baseline = (llama8b_analysis.size["params"] * 2 + 64 * 1536 * kv_bytes_per_token_of(LLAMA_8B, None)) / 64
    quantized = (fit["weights_bytes"] + 64 * 1536 * kv_bytes_per_token_of(LLAMA_8B, "fp8")) / 64
    assert (predicted["batch"], predicted["mean_context"], predicted["native"]) == (64, 1536, True)
    assert predicted["speedup"] == pytest.approx(baseline / quantized) and 1.5 < predicted["speedup"] < 2.1
    assert decision(p, "expected decode speed-up")["value"] == f"{predicted['speedup']:.2f}x"
    nvfp4 = plan(llama8b_analysis, "nvfp4 for MI300X").target["decode_speedup"]  # no native FP4 on gfx942
    assert nvfp4["native"] is False and "an upper bound" in nvfp4["text"]


def test_docs_speed_md_states_the_measurement_the_plan_sizes_for_mi300x_and_h200(plan, llama8b_analysis, tmp_path):
    """The speed tier's workload and exact commands on MI300X and H200, rendered from real plans of an 8 B Llama:
    docs/speed.md says exactly that (QPE_UPDATE_DOCS=1 rewrites its generated part)."""
    import os

    from bench.docgen.speed_targets_doc import GOALS, current_part, render, replace_part

    source = Path(llama8b_analysis.model["model_path"])
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text((source / "config.json").read_text())
    plans = {name: plan(llama8b_analysis, goal).as_json() for name, goal in GOALS.items()}
    assert {name: p["target"]["name"] for name, p in plans.items()} == {name: name for name in GOALS}
    part = render(plans, export, source, tmp_path / "work")
    doc = Path(__file__).resolve().parents[2] / "docs" / "speed.md"
    if os.environ.get("QPE_UPDATE_DOCS"):
        doc.write_text(replace_part(doc.read_text(encoding="utf-8"), part), encoding="utf-8")
    assert current_part(doc.read_text(encoding="utf-8")) == part, "docs/speed.md is stale: QPE_UPDATE_DOCS=1"
    for words in ("--kv-cache-dtype fp8", "--max-model-len 32768", "--random-input-len 1024",
                  "--random-output-len 1024", "--max-concurrency 64", "--num-prompts 320", "### MI300X", "### H200"):
        assert words in part, words


def test_a_70b_plan_on_this_host_states_the_streamed_tier1_memory_instead_of_a_warning(plan, catalog,
                                                                                          tmp_path_factory):
    """Llama-3-70B's shape (header-only, sparse) on a 24 GiB host: in memory Tier 1 would hold ~265 GiB, so the
    plan states the streamed memory (one block of each model at a time) and warns of nothing about evaluation."""
    model = header_only_llama(tmp_path_factory.mktemp("llama70b") / "llama-70b", hidden_size=8192,
                              intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                              num_key_value_heads=8, vocab_size=128256)
    analysis = analyze_model(str(model), offline=True, catalog=catalog)
    made = plan(analysis, scheme="ptpc_fp8", env=cpu_env(24.0))
    names = [d["decision"] for d in made.decisions]
    assert "warning: evaluation RAM" not in names
    row = decision(made, "host memory (evaluate)")
    assert "streamed one decoder block at a time" in row["reason"] and "in memory it would need ~2" in row["reason"]
    streamed_gib = float(row["value"].strip("~").split()[0])
    assert 4 < streamed_gib < 10, row  # start-up, two blocks (~2.4 GiB), the 2 GiB lm_head bound, windows
