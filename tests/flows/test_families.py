"""A CI slice of the family x scheme matrix (``make matrix`` runs all of it, bench/docgen/matrix.py).

Tiny random instances of real transformers architectures, built offline from their config
classes, go through the recipe's steps: one dense family, one MoE with fused 3-D experts, one
with tied embeddings, one with fused QKV projections. Plus the config check by meaning and the
plan's up-front refusal of a known family limit.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from bench.docgen.matrix import Setup, build_release, cell_dir, export_dir, matrix_params, run_cell
from quark_ptq_eval.base.errors import QpeError, UsageError
from quark_ptq_eval.base.safetensors_io import read_model_headers
from quark_ptq_eval.validate.configdiff import HeaderFacts, check_config
from tests.fixtures.families import build_family


@pytest.fixture(scope="module")
def setup(tmp_path_factory, corpus, catalog) -> Setup:
    from quark_ptq_eval.context.preflight import detect_env
    from quark_ptq_eval.flows.demo import build_tiny_model

    work = tmp_path_factory.mktemp("matrix")
    tokenizer = build_tiny_model(work / "tokenizer", corpus, train_steps=1)  # only its tokenizer is used
    env = detect_env()
    env["hardware"] = {**env["hardware"], "accelerator": "cpu", "gpu_arch": None}
    return Setup(work, corpus, tokenizer, catalog, env, 4, 2)


def _family(setup: Setup, model_type: str) -> Path:
    model_dir = setup.work / "models" / model_type
    if not (model_dir / "config.json").exists():
        build_family(model_type, model_dir, setup.tokenizer)
    return model_dir


# dense / MoE with fused experts / tied embeddings / fused QKV and gate-up projections
SLICE = [("mistral", "int4_wo_32"), ("qwen3_moe", "fp8"), ("gemma2", "fp8"), ("phi3", "int8")]


@pytest.mark.parametrize(("family", "column"), SLICE)
def test_family_goes_through_the_recipe_with_the_promised_share_quantized(setup, family, column):
    model_dir = _family(setup, family)
    cell = run_cell(setup, family, model_dir, column)
    assert cell.outcome == "green", f"{cell.stage} ({cell.cause}): {cell.message}"
    assert cell.share_measured is not None and cell.share_measured >= cell.share_promised - 0.005
    assert cell.ppl is not None and cell.ppl_base is not None
    # issue 22: the healthy export decodes to its source within the bound, the figures in the matrix's table
    assert cell.decode_status == "pass" and cell.decode_checked > 0, cell
    assert 0 < cell.decode_worst <= cell.decode_bound < 0.51
    # issue 24: the cell was a run of the recipe, its engine in this process
    work = cell_dir(setup, family, column) / "work"
    assert json.loads((work / "run_summary.json").read_text())["validation"] == "success"
    assert "(in this process)" in (work / "logs" / "engine.log").read_text()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3"])
def test_the_fp8_release_column_goes_through_the_recipe_via_the_staged_copy(setup, family):
    """Issue 21: the family's instance as a DeepSeek FP8 block release, through the recipe: the plan reads
    it through a dequantized BF16 copy, which validation (load and decode checks) and Tier 1's baseline use."""
    release, why = build_release(setup, family, _family(setup, family))
    assert release is not None, why
    assert json.loads((release / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    cell = run_cell(setup, family, release, "fp8_release")
    assert cell.outcome == "green", f"{cell.stage} ({cell.cause}): {cell.message}"
    work = cell_dir(setup, family, "fp8_release") / "work"
    staged = work / "source-bf16"
    assert json.loads((work / "quant_plan.json").read_text())["source_reading"]["mode"] == "stage_bf16"
    assert json.loads((work / "validation_report.json").read_text())["source_model_dir"] == str(staged)
    assert str(staged) in (work / "eval_results.json").read_text()  # Tier 1's baseline: the release, dequantized
    assert cell.decode_status == "pass" and cell.decode_checked > 0 and cell.decode_worst <= cell.decode_bound
    assert cell.share_measured >= cell.share_promised - 0.005 > 0.3


def _payload(info) -> bytes:
    with open(info.file, "rb") as f:
        f.seek(info.start)
        return f.read(info.nbytes)


def test_a_bf16_deepseek_v4_quantizes_and_keeps_its_lm_head_byte_identical(setup):
    """Issue 31: DeepSeek-V4 in BF16, the dtype its releases use, with the norms transformers keeps in float32:
    int8 through the recipe calibrates (the float32 norms hand BF16 to the linears they feed), the template's
    ``head`` exclusion reaches Quark as the loaded ``lm_head``, validation succeeds, lm_head is the source's bytes."""
    model_dir = _family(setup, "deepseek_v4")
    src = read_model_headers(model_dir)
    assert src["head.weight"].dtype == "BF16" and src["model.layers.0.attn.q_norm.weight"].dtype == "F32"
    cell = run_cell(setup, "deepseek_v4", model_dir, "int8")
    assert cell.outcome == "green", f"{cell.stage} ({cell.cause}): {cell.message}"
    work = cell_dir(setup, "deepseek_v4", "int8") / "work"
    assert json.loads((work / "run_summary.json").read_text())["validation"] == "success"
    out = read_model_headers(export_dir(setup, "deepseek_v4", "int8"))
    assert [n for n in out if n.startswith("lm_head.")] == ["lm_head.weight"]  # no scale: not quantized
    assert _payload(out["lm_head.weight"]) == _payload(src["head.weight"])
    assert out["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == "I8"  # what the template quantizes is
    log = (work / "logs" / "engine.log").read_text()
    assert "lm_head" in log.split("exclusions in the loaded model's names:")[1].splitlines()[0]
    assert "keeps in float32 hand a float32 output back" in log


def test_an_engine_that_raises_in_process_fails_as_a_child_would(tmp_path):
    """The in-process runner's contract is the child process's: exit 1, the traceback in the log's tail
    (the failure classifier reads its frames), the exception kept; the environment as it was."""
    import os

    from quark_ptq_eval.execute.classify import classify_failure
    from quark_ptq_eval.execute.in_process import InProcessRunner

    runner = InProcessRunner()
    argv = [sys.executable, "-m", "quark_ptq_eval.execute.quark_api_engine", "--model_dir", str(tmp_path / "none"),
            "--output_dir", str(tmp_path / "out"), "--quant_scheme", "int8", "--calib_data", str(tmp_path / "t.txt")]
    result = runner(argv, {"QPE_IN_PROCESS_PROBE": "1"}, tmp_path / "engine.log", tmp_path)
    assert result.returncode == 1 and not result.interrupted
    assert runner.last_error is not None and "Traceback (most recent call last):" in result.tail
    assert classify_failure(result.tail, result.returncode)["cause"] == "load"  # the failing frame: transformers
    assert "QPE_IN_PROCESS_PROBE" not in os.environ
    assert runner(argv[:3], {}, tmp_path / "engine.log", tmp_path).returncode == 2  # argparse's exit
    assert "(in this process)" in (tmp_path / "engine.log").read_text()


def test_the_slice_has_the_structures_it_claims(setup):
    """Guards the slice itself: the families still have fused experts, tied embeddings, fused QKV."""
    from transformers import AutoModelForCausalLM

    # transformers 5 fuses the experts on load (save_pretrained writes them back per expert):
    # the fused 3-D parameters are what the engine receives, so that is what the slice must hold.
    moe = AutoModelForCausalLM.from_pretrained(_family(setup, "qwen3_moe"))
    assert any(p.ndim == 3 and "experts" in n for n, p in moe.named_parameters()), "fused 3-D experts expected"
    assert json.loads((_family(setup, "gemma2") / "config.json").read_text())["tie_word_embeddings"] is True
    assert not any(n.startswith("lm_head") for n in read_model_headers(_family(setup, "gemma2")))
    assert any("qkv_proj" in n for n in read_model_headers(_family(setup, "phi3")))


def test_moe_experts_are_quantized_in_the_export(setup):
    """Fused experts come out per expert and quantized, not as BF16 3-D tensors (issue 11)."""
    out = export_dir(setup, "qwen3_moe", "fp8")
    if not out.exists():
        run_cell(setup, "qwen3_moe", _family(setup, "qwen3_moe"), "fp8")
    headers = read_model_headers(out)
    experts = {n: t for n, t in headers.items() if ".experts." in n and n.endswith("proj.weight")}
    assert experts and all(t.dtype == "F8_E4M3" for t in experts.values())
    assert not any(len(headers[n].shape) == 3 for n in matrix_params(headers))  # no fused 3-D expert left


def test_per_expert_dbrx_export_is_loaded_by_quarks_importer_with_its_experts(setup, monkeypatch):
    """DBRX's export names its experts ``experts.mlp.<n>.w1``: transformers' fused class finds none of
    them and initialises them at random. That export once went green (docs/families.md): Tier 1
    scored random experts and the old load check's greedy agreement could not tell."""
    from quark_ptq_eval.runtime import loading
    from quark_ptq_eval.validate import validate_model

    model_dir = _family(setup, "dbrx")
    cell = run_cell(setup, "dbrx", model_dir, "fp8")  # validation with the load check, then Tier 1
    assert cell.outcome == "green", f"{cell.stage} ({cell.cause}): {cell.message}"
    assert cell.loader == "quark"
    out = export_dir(setup, "dbrx", "fp8")
    with pytest.raises(QpeError, match="initialised them at random"):  # Tier 1 refuses such a load
        loading.load_model(out, device="cpu", loader=loading.TRANSFORMERS)
    monkeypatch.setattr(loading, "_has_per_expert_tensors", lambda model_dir: False)  # the old loader choice
    load = next(c for c in validate_model(model_dir, out, load_check=True).checks if c.name == "load")
    assert load.status == "fail" and load.stats["loader"] == "transformers"
    subjects = [f.subject for f in load.findings]
    assert subjects[0] == "weights" and "transformer.blocks.0.ffn.experts" in subjects[1:], subjects


def test_an_awq_export_whose_norms_were_rewritten_passes_the_load_check_layer_by_layer(setup):
    """AWQ folds its scales into the norm before each scaled linear: alone, OPT's fc1 was 155 % away from
    the source's fc1 on the source's input (bench_load_check.py); its decoder layer as a whole is within
    rounding (fc1 and fc2 exchange a folded scale and share no module below the layer)."""
    import torch
    from safetensors.torch import load_file

    from quark_ptq_eval.validate import validate_model

    model_dir = _family(setup, "opt")
    cell = run_cell(setup, "opt", model_dir, "awq")
    assert cell.outcome == "green", f"{cell.stage} ({cell.cause}): {cell.message}"
    out = export_dir(setup, "opt", "awq")
    src, exp = load_file(model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    norms = [n for n in src if "layer_norm" in n]
    assert any(not torch.equal(src[n], exp[n]) for n in norms)  # the premise: AWQ rewrote norms before linears
    load = next(c for c in validate_model(model_dir, out, load_check=True).checks if c.name == "load")
    assert load.status == "pass" and any("decoder layer(s) replayed whole" in n for n in load.notes)
    # every unit, the composites included, is held to the emulation of the export's files (none to the source)
    assert load.stats["modules_emulated"] == load.stats["modules_replayed"] > 0 and "worst_module" not in load.stats
    assert load.stats["worst_loader_module"].startswith("model.decoder.layers.")


def _wide_moe(setup: Setup) -> Path:
    """qwen3_moe with 32 experts, one per token: the probe leaves several experts without a token, as
    DeepSeek-V3's 256 (top-8) do at full size."""
    from tests.fixtures.families import with_experts

    base, wide = _family(setup, "qwen3_moe"), setup.work / "models" / "qwen3_moe_wide"
    if not (wide / "config.json").exists():
        with_experts(base, wide, experts=32, per_token=1, seed=1)
    return wide


def _experts_the_probe_routes(model_dir: Path, module: str) -> set[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quark_ptq_eval.validate.loadcheck import MAX_PROBE_TOKENS, PROBE

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = AutoTokenizer.from_pretrained(model_dir)(PROBE, return_tensors="pt").input_ids[:, :MAX_PROBE_TOKENS]
    routed: set[int] = set()
    model.get_submodule(module).register_forward_pre_hook(lambda _, args: routed.update(args[1].flatten().tolist()))
    model(ids)
    return routed


def test_a_fault_in_an_expert_no_probe_token_reaches_still_fails(setup, copy_model, scale_in_file):
    """Replaying the MoE block follows the router: an expert no probe token is sent to is never run, and a
    scale read 4x there passed. The experts module is replayed again with every expert routed a token.
    (Weight-only int4: no activation scale for calibration to miss, see the next test.)"""
    from quark_ptq_eval.validate import validate_model
    from quark_ptq_eval.validate.loadcheck import load_check_alone

    model_dir = _wide_moe(setup)
    cell = run_cell(setup, "qwen3_moe_wide", model_dir, "int4_wo_32")
    assert cell.outcome == "green", f"{cell.stage} ({cell.cause}): {cell.message}"
    experts = "model.layers.0.mlp.experts"
    unrouted = sorted(set(range(32)) - _experts_the_probe_routes(model_dir, experts))
    assert unrouted  # the premise: the probe leaves experts without a token
    out = copy_model(export_dir(setup, "qwen3_moe_wide", "int4_wo_32"), "unrouted-expert-x4")
    scale_in_file(out, f"{experts}.{unrouted[0]}.down_proj.weight_scale", 4)
    report = validate_model(model_dir, out, load_check=True)  # the decode check names the expert first
    assert f"{experts}.{unrouted[0]}.down_proj.weight" in "\n".join(f.subject for f in report.check("decode").failures)
    load = load_check_alone(model_dir, out)  # and a loader reading it 4x is caught by the replay too
    assert load.status == "fail", load.notes
    assert load.stats["experts_routed_by_probe"] < load.stats["experts"] == 64  # two layers of 32
    assert [f.subject for f in load.findings if not f.benign] == [f"{experts} (expert {unrouted[0]})"]  # the block passed


def test_experts_calibration_never_reached_fail_validation(setup):
    """Static fp8 activations: an expert no calibration token was routed to keeps Quark's unobserved scale,
    1.0. The wide MoE's calibration misses some experts; the export must not go green."""
    from quark_ptq_eval.validate import validate_model

    model_dir = _wide_moe(setup)
    cell = run_cell(setup, "qwen3_moe_wide", model_dir, "fp8")
    assert (cell.outcome, cell.stage) == ("failed", "validate") and "calibration data" in cell.message, cell
    out = export_dir(setup, "qwen3_moe_wide", "fp8")
    check = validate_model(model_dir, out).check("calibration")
    unset = [f.subject for f in check.failures]
    assert unset and all(".mlp.experts." in n and n.endswith(".input_scale") for n in unset)
    assert check.stats["uncalibrated"] < check.stats["activation_scales"]  # attention and the other experts were


def _qwen2_pair(setup: Setup, tmp_path: Path) -> tuple[Path, Path]:
    src = _family(setup, "qwen2")
    out = tmp_path / "out"
    shutil.copytree(src, out)
    return src, out


def _edit(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_config_normalised_by_its_class_is_benign_drift(setup, tmp_path):
    src, out = _qwen2_pair(setup, tmp_path)
    _edit(src, sliding_window=4096, use_sliding_window=False)  # as Qwen2 checkpoints ship
    _edit(out, sliding_window=None)  # as Qwen2Config writes it back
    result = check_config(src, out, HeaderFacts(2, 2))
    assert result.status != "fail"
    assert [f.subject for f in result.findings if f.benign] == ["sliding_window"]


def test_a_real_config_change_still_fails_next_to_normalisation(setup, tmp_path):
    src, out = _qwen2_pair(setup, tmp_path)
    _edit(src, sliding_window=4096, use_sliding_window=False)
    _edit(out, sliding_window=None, rms_norm_eps=1e-3)
    result = check_config(src, out, HeaderFacts(2, 2))
    assert result.status == "fail"
    assert [f.subject for f in result.failures] == ["rms_norm_eps"]


def test_plan_refuses_a_known_family_limit_up_front(tiny_llama, copy_model, catalog, corpus):
    from quark_ptq_eval.flows import api

    model = copy_model(tiny_llama)
    _edit(model, model_type="mllama")
    analysis = api.analyze_model(model, offline=True)
    with pytest.raises(UsageError) as info:
        api.plan_quantization(analysis, model.parent / "q", scheme="fp8", calib_data=str(corpus), offline=True,
                              device="cpu", engine="quark-api")
    assert "known recipe limit" in info.value.message and "quark-cli" in info.value.hint
