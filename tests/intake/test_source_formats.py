"""Models as they ship: FP8 block releases, ``pytorch_model.bin``-only sources, refused formats.

The FP8 releases are made here from the families' BF16 instances by tests/fp8_release.py, in the
release format exactly (F8_E4M3 weights, 128x128 ``weight_scale_inv`` blocks, quantization_config).
Real runs (marked slow): the releases of deepseek_v3, the trained qwen3 and minimax_m2 -> mxfp4 and
-> int8 with calibration, each validated and with Tier 1 against the dequantized release; the
.bin-only llama -> int8; their engines in this process (the recipe's in-process runner).
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import pytest

from quark_ptq_eval.base.gates import FlagApprover
from quark_ptq_eval.base.plan_records import DeviceStrategy
from quark_ptq_eval.base.safetensors_io import read_model_headers
from quark_ptq_eval.intake import analyze_model
from tests.fixtures.families import build_family
from tests.fixtures.fp8_release import to_bin_only, to_fp8_release
from tests.fixtures.mxfp4_release import to_mxfp4_release


@pytest.fixture(scope="module")
def release(tmp_path_factory, tiny_model):
    """``release("deepseek_v3")``: (BF16 instance, its FP8 block release); "qwen3" is the trained demo model."""
    root = tmp_path_factory.mktemp("releases")
    made: dict[str, tuple[Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in made:
            bf16 = tiny_model("qwen3") if family == "qwen3" else build_family(family, root / family, tiny_model())
            made[family] = bf16, to_fp8_release(bf16, root / f"{family}-fp8")
        return made[family]

    return get


@pytest.fixture(scope="module")
def eval_text(tmp_path_factory, corpus) -> Path:
    """A short held-out text for Tier 1 (the corpus' last paragraphs: a few windows of 64 tokens)."""
    path = tmp_path_factory.mktemp("evaltext") / "held_out.txt"
    path.write_text("\n".join(corpus.read_text().splitlines()[-12:]) + "\n")
    return path


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3", "minimax_m2"])
def test_intake_names_the_fp8_release_and_counts_it_from_its_headers(release, catalog, family):
    bf16, fp8 = release(family)
    a = analyze_model(str(fp8), offline=True, catalog=catalog)
    fmt = a.source_format
    assert (fmt["name"], fmt["reading"], fmt["weight_block_size"]) == ("fp8_block", "stage_bf16", [128, 128])
    same = analyze_model(str(bf16), offline=True, catalog=catalog)
    assert fmt["params"] == same.size["params"]  # an FP8 byte is one parameter; scales are none
    assert fmt["quantizable_params"] == same.source_format["quantizable_params"]
    as_read = sum(t.nbytes for t in read_model_headers(fp8).values() if t.dtype != "F8_E4M3"
                  and not t.name.endswith("_scale_inv"))
    as_read += sum(2 * math.prod(t.shape) for t in read_model_headers(fp8).values() if t.dtype == "F8_E4M3")
    assert fmt["read_as_bytes"] == as_read  # FP8 weights read as BF16, scales dropped, the rest as stored
    text = " ".join(r["message"] + r["recovery_hint"] for r in a.risks)
    assert "normal starting point" in text and "Start from the unquantized" not in text
    a.write(fp8.parent / f"{family}-analysis")  # the extended schema accepts it


def _block_dequant(q, s):
    """The release's definition, block by block: each 128x128 tile times its one scale."""
    import torch

    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            out[tile] = q[tile].to(torch.float32) * s[i, j]
    return out.to(torch.bfloat16)


def test_the_staged_copy_is_the_release_dequantized_exactly(release, tmp_path):
    import torch
    from safetensors.torch import load_file

    from quark_ptq_eval.execute.staging import dequantize_fp8_checkpoint

    bf16, fp8 = release("deepseek_v3")  # MLA and experts: blocks cut partially (80x128, 192x64)
    dequantize_fp8_checkpoint(fp8, tmp_path)
    src, staged, orig = (load_file(d / "model.safetensors") for d in (fp8, tmp_path, bf16))
    assert set(staged) == set(orig)  # scales consumed, every tensor of the BF16 model back
    for name, t in staged.items():
        assert name in orig and t.shape == orig[name].shape
        if name + "_scale_inv" in src:
            assert t.dtype == torch.bfloat16 and torch.equal(t, _block_dequant(src[name], src[name + "_scale_inv"]))
            assert (t.float() - orig[name].float()).abs().max() <= orig[name].float().abs().max() / 8  # FP8 rounding
        else:
            assert torch.equal(t, src[name]) and t.dtype == src[name].dtype  # untouched (the F32 bias stays F32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3", "minimax_m2"])
def test_file2file_is_refused_by_the_plan_step_on_a_cpu_host_with_the_staging_alternative(release, catalog,
                                                                                         tmp_path, family):
    from quark_ptq_eval.base.errors import UsageError
    from quark_ptq_eval.plan.source_reading import decide

    _, fp8 = release(family)
    a = analyze_model(str(fp8), offline=True, catalog=catalog)
    with pytest.raises(UsageError) as exc:
        decide(a, "file2file", DeviceStrategy("cpu", False), tmp_path)
    assert "Triton kernel that needs a GPU" in exc.value.message
    assert "Leave out --engine" in exc.value.hint and "exact BF16 staging copy" in exc.value.hint
    assert "128x128 block x its weight_scale_inv" in exc.value.hint
    assert not any(tmp_path.iterdir())  # nothing created


def test_file2file_on_an_fp8_release_is_refused_at_the_plan_on_a_cpu_host(cli, release, corpus, tmp_path):
    _, fp8 = release("minimax_m2")
    wd, out = tmp_path / "work", tmp_path / "out"
    res = cli("run", fp8, "-o", out, "--workdir", wd, "--scheme", "ptpc_fp8", "--engine", "file2file",
              "--calib-data", corpus, "--offline", "--yes")
    assert res.rc == 2, res.err
    assert "Triton kernel that needs a GPU" in res.err and "BF16 staging copy" in res.err, res.err
    assert "Traceback" not in res.err and "KeyError" not in res.err
    assert not out.exists() and not (wd / "source-bf16").exists()  # nothing created before the gate
    # without --engine the same plan reads the release through the staging copy, its disk cost shown
    wd = tmp_path / "work2"  # a fresh run: the first one's options (--engine file2file) are not carried over
    res = cli("run", fp8, "-o", out, "--workdir", wd, "--scheme", "ptpc_fp8", "--calib-data", corpus,
              "--offline", "--yes", "--execution-mode", "plan_only")
    assert res.rc == 0, res.err
    plan = json.loads((wd / "quant_plan.json").read_text())
    assert plan["source_reading"]["mode"] == "stage_bf16" and plan["source_reading"]["disk_bytes"] > 0
    assert "source reading" in res.err and not (wd / "source-bf16").exists()


def test_refused_formats_say_what_to_start_from(release, catalog, tmp_path):
    from quark_ptq_eval.base.errors import UsageError
    from quark_ptq_eval.plan.source_reading import decide

    bf16, _ = release("qwen3")
    for qc, words in (({"quant_method": "gptq", "bits": 4}, "compounds"), ({"quant_method": "awq"}, "compounds"),
                      ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "compounds")):
        model = tmp_path / qc["quant_method"]
        model.mkdir()
        shutil.copy2(bf16 / "model.safetensors", model / "model.safetensors")  # a link out of the dir is refused
        config = json.loads((bf16 / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        a = analyze_model(str(model), offline=True, catalog=catalog)
        assert a.source_format["name"] == "int4" and a.risks[0]["severity"] == "high"
        with pytest.raises(UsageError) as exc:
            decide(a, "quark-api", DeviceStrategy("cpu", False), tmp_path)
        assert words in exc.value.hint and "BF16" in exc.value.hint


def test_an_engine_that_exits_0_without_output_fails_with_its_own_error_line(tmp_path):
    from quark_ptq_eval.execute.classify import classify_failure
    from quark_ptq_eval.execute.inspect_output import inspect_output
    from quark_ptq_eval.execute.step import _no_output_why

    tail = ["[quark-ptq-eval] quantizing shard by shard on cpu",
            "[QUARK-ERROR]: FP8 model dequantization requires a CUDA device (Triton kernel), but got device='cpu'.",
            "[quark-ptq-eval] done in 0.1s; peak RSS 1.10 GiB"]
    facts = inspect_output(tmp_path / "never-written")
    assert facts["ok"] is False  # no KeyError on a missing output
    why = _no_output_why(facts, tail)
    assert why.startswith("exit code 0 but the output directory does not exist") and "requires a CUDA device" in why
    assert classify_failure(tail, 0)["cause"] == "environment"


def _traceback(path: str, func: str, error: str) -> list[str]:
    return ["Traceback (most recent call last):",
            '  File "/venv/lib/python3.12/site-packages/quark_ptq_eval/execute/quark_api_engine.py", line 80, in main',
            "    model = AutoModelForCausalLM.from_pretrained(",
            f'  File "/venv/lib/python3.12/site-packages/{path}", line 195, in {func}', "    ...", error]


def test_failures_are_classified_by_the_failing_frame():
    from importlib.metadata import version

    from quark_ptq_eval.execute.classify import classify_failure

    load = classify_failure(_traceback("transformers/quantizers/quantizer_finegrained_fp8.py", "update_tp_plan",
                                       "AttributeError: 'NoneType' object has no attribute 'get'"), 1)
    assert load["cause"] == "load" and f"transformers {version('transformers')}" in load["evidence"][0]
    assert "quantizer_finegrained_fp8.py:195" in load["evidence"][0] and "calibration samples" not in load["proposal"]
    quark = classify_failure(_traceback("quark/torch/quantization/observer/observer.py", "forward",
                                        "RuntimeError: shape mismatch"), 1)
    assert quark["cause"] == "quark" and "amd-quark" in quark["evidence"][0]
    oom = classify_failure(_traceback("quark/torch/quantization/api.py", "quantize", "torch.OutOfMemoryError: x"), 1)
    assert oom["cause"] == "memory"  # what failed matters more than where


def test_a_lossless_widening_is_benign_and_a_changed_value_is_not(tmp_path):
    import torch
    from safetensors.torch import save_file

    from quark_ptq_eval.base.safetensors_io import read_header
    from quark_ptq_eval.validate.byte_identity import compare_tensors

    bias = torch.randn(64).to(torch.bfloat16)
    save_file({"m.e_score_correction_bias": bias}, tmp_path / "src.safetensors")
    save_file({"m.e_score_correction_bias": bias.float()}, tmp_path / "same.safetensors")
    save_file({"m.e_score_correction_bias": bias.float() + 1e-3}, tmp_path / "changed.safetensors")
    src = read_header(tmp_path / "src.safetensors").tensors
    same = compare_tensors(src, read_header(tmp_path / "same.safetensors").tensors, list(src))
    assert same.status == "benign" and "lossless widening" in same.findings[0].message
    changed = compare_tensors(src, read_header(tmp_path / "changed.safetensors").tensors, list(src))
    assert changed.status == "fail"


def test_output_size_comes_from_the_release_headers(release, catalog, tmp_path):
    from quark_ptq_eval.plan import resources

    _, fp8 = release("deepseek_v3")
    a = analyze_model(str(fp8), offline=True, catalog=catalog)
    info = catalog["scheme_info"]["mxfp4"]
    excluded = a.template["exclude_layers"]
    # count by hand: every quantizable linear at 4.25 bits, every other tensor as BF16 once read, scales gone
    count = 0.0
    for name, t in read_model_headers(fp8).items():
        if name.endswith("_scale_inv"):
            continue
        module = name.rpartition(".")[0]
        linear = (len(t.shape) == 2 and name.endswith(".weight") and "embed" not in name and "norm" not in name
                  and not any(__import__("fnmatch").fnmatchcase(module, p) for p in excluded))
        count += math.prod(t.shape) * (4.25 / 8 if linear else (2 if t.dtype == "F8_E4M3" else t.nbytes / math.prod(t.shape)))
    assert abs(resources.output_bytes(a, "mxfp4", info) / count - 1) < 0.10


# Every release run's engine runs in this process (execute/in_process.py, as the family matrix's cells do):
# ``import quark.torch`` and a child's start are paid once for the file, not once per run (~15 s each). The
# engine in a child process is what tests/flows/test_pipeline.py and tests/reliability/ run.
@functools.cache
def _engine_in_process():
    from quark_ptq_eval.execute.in_process import InProcessRunner

    return InProcessRunner()


def _run_release(model: Path, tmp_path: Path, scheme: str, corpus: Path, eval_text: Path | None) -> dict:
    """The recipe of ``api.run`` (the same options, built the same way), its engine in this process."""
    from quark_ptq_eval.base.ui import Reporter
    from quark_ptq_eval.evaluate import BASELINE_FROM_SOURCE
    from quark_ptq_eval.flows.recipe.pipeline import Recipe
    from quark_ptq_eval.flows.recipe.run_options import run_options

    wd, out = tmp_path / "work", tmp_path / "out"
    tier = "ppl" if eval_text else "skip"
    eval_options = {"eval_data": str(eval_text), "seq_len": 64, "baseline": BASELINE_FROM_SOURCE} if eval_text else {}
    options = run_options(model, out, dict(eval_tier=tier, eval_options=eval_options, offline=True, scheme=scheme,
                                           calib_data=str(corpus), num_calib_samples=8, calib_seq_len=64))
    recipe = Recipe(wd, FlagApprover(all_gates=True), Reporter(quiet=True), engine_runner=_engine_in_process())
    summary = recipe.run(options)
    assert "(in this process)" in (wd / "logs" / "engine.log").read_text()
    report = json.loads((wd / "validation_report.json").read_text())
    return {"summary": summary, "report": report, "wd": wd, "out": out,
            "plan": json.loads((wd / "quant_plan.json").read_text())}


def _layout_stats(report: dict) -> dict:
    return report["checks"]["layout"]["stats"]


@pytest.fixture(scope="module")
def release_run(release, corpus, eval_text, tmp_path_factory):
    """``release_run("minimax_m2", "int8")``: the FP8 release run through the whole recipe once (then reused)."""
    runs: dict[tuple[str, str], dict] = {}

    def get(family: str, scheme: str) -> dict:
        if (family, scheme) not in runs:
            _, fp8 = release(family)
            runs[family, scheme] = _run_release(fp8, tmp_path_factory.mktemp(f"{family}-{scheme}"), scheme, corpus,
                                                eval_text)
        return runs[family, scheme]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3", "minimax_m2"])
@pytest.mark.parametrize("scheme", ["mxfp4", "int8"])
def test_an_fp8_release_is_quantized_validated_and_evaluated_on_this_cpu(release, release_run, family, scheme):
    _, fp8 = release(family)
    r = release_run(family, scheme)
    staged = r["wd"] / "source-bf16"
    assert r["summary"]["status"] == "done"  # what the CLI exits 0 on
    assert r["plan"]["source_reading"]["mode"] == "stage_bf16" and (staged / ".staged-complete").is_file()
    assert r["plan"]["calibration"] and "8 samples of 64 tokens" in r["summary"]["calibration"]
    assert r["summary"]["validation"] == "success", r["report"]  # no benign finding either (minimax_m2's router)
    assert r["report"]["source_model_dir"] == str(staged)  # validated against the dequantized release
    layout = _layout_stats(r["report"])
    assert layout["quantized_share"] == layout["expected_share"] > 0.3
    results = json.loads((r["wd"] / "eval_results.json").read_text())
    assert results["source_model"] == results["settings"]["baseline"] == str(staged)  # Tier 1's baseline: the release
    ppl = results["quantized"]["perplexity"]["perplexity"], results["baseline"]["perplexity"]["perplexity"]
    assert all(math.isfinite(p) and p > 1 for p in ppl) and results["verdict"] in ("healthy", "watch", "hurt")
    assert r["summary"]["evaluation"]["tier"] == "ppl"
    assert any(staged.glob("*.safetensors")) and (fp8 / "model.safetensors").is_file()  # the release is kept


@pytest.mark.slow
def test_a_router_the_template_excludes_by_its_legacy_name_is_held_byte_identical(release_run, tmp_path,
                                                                                  scale_in_file):
    """Quark's minimax_m2 template excludes ``*block_sparse_moe.gate*``; transformers 5 loads the block as
    ``mlp``: the router stays excluded under the export's name, so a changed router fails (it was a
    benign "left in BF16" finding before, and a corrupted router passed)."""
    from quark_ptq_eval.validate.runner import validate_model

    r = release_run("minimax_m2", "int8")
    assert "*block_sparse_moe.gate*" in r["plan"]["exclude_layers"] and "*mlp.gate*" in r["report"]["exclude_patterns"]
    planted = tmp_path / "planted"
    shutil.copytree(r["out"], planted)
    scale_in_file(planted, "model.layers.1.mlp.gate.weight", 1.5)
    report = validate_model(r["wd"] / "source-bf16", planted, r["plan"])
    assert report.status == "failed"
    assert [f.subject for _, f in report.failures] == ["model.layers.1.mlp.gate.weight"]
    assert report.check("md5").status == "fail"


@pytest.mark.slow
def test_a_bin_only_source_is_converted_and_validated_against_the_copy(tiny_llama, corpus, tmp_path):
    model = to_bin_only(tiny_llama, tmp_path / "bin-only")
    r = _run_release(model, tmp_path, "int8", corpus, None)
    converted = r["wd"] / "source-safetensors"
    assert r["summary"]["status"] == "done" and r["plan"]["source_reading"]["mode"] == "convert_bin"
    assert r["summary"]["validation"] == "success", r["report"]
    assert r["report"]["source_model_dir"] == str(converted) and (converted / "model.safetensors").is_file()
    assert _layout_stats(r["report"])["quantized_share"] > 0.3


# ---- gpt-oss MXFP4 releases ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_oss_release(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny BF16 gpt-oss from GptOssConfig, its MXFP4 release in gpt-oss's own layout)."""
    bf16 = tiny_model("gpt_oss")
    return bf16, to_mxfp4_release(bf16, tmp_path_factory.mktemp("gpt-oss") / "gpt_oss-mxfp4")


def test_an_mxfp4_release_is_staged_exactly_as_transformers_dequantizes_it(gpt_oss_release, catalog, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from quark_ptq_eval.execute.staging import dequantize_mxfp4_checkpoint

    bf16, mx = gpt_oss_release
    src, orig = load_file(mx / "model.safetensors"), load_file(bf16 / "model.safetensors")
    blocks = [n.removesuffix("_blocks") for n in src if n.endswith("_blocks")]
    assert len(blocks) == 4 and src[blocks[0] + "_blocks"].dtype == torch.uint8
    for name in blocks:  # the test's conversion round-trips through transformers' own dequantization
        theirs = convert_moe_packed_tensors(src[name + "_blocks"].clone(), src[name + "_scales"].clone())
        err = (theirs.float() - orig[name].float()).norm() / orig[name].float().norm()
        assert theirs.shape == orig[name].shape and err < 0.2, (name, err)  # MXFP4 rounding (~11 % here)
    dequantize_mxfp4_checkpoint(mx, tmp_path)
    staged = load_file(tmp_path / "model.safetensors")
    assert set(staged) == set(orig)  # blocks + scales -> the BF16 tensor, under the model's own names
    for name, t in staged.items():
        if name in blocks:
            theirs = convert_moe_packed_tensors(src[name + "_blocks"].clone(), src[name + "_scales"].clone())
            assert t.dtype == torch.bfloat16 and torch.equal(t, theirs), name
        else:
            assert torch.equal(t, src[name]) and t.dtype == src[name].dtype
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    a, same = (analyze_model(str(d), offline=True, catalog=catalog) for d in (mx, bf16))
    fmt = a.source_format
    assert (fmt["name"], fmt["reading"]) == ("mxfp4", "stage_bf16")
    assert fmt["params"] == same.size["params"]  # two parameters a byte of blocks, scales none
    assert fmt["quantizable_params"] == same.source_format["quantizable_params"]
    assert fmt["read_as_bytes"] == sum(t.nbytes for t in read_model_headers(bf16).values())


def test_file2file_on_an_mxfp4_release_is_refused_with_the_staging_alternative(gpt_oss_release, catalog, tmp_path):
    from functools import partial

    from quark_ptq_eval.base.errors import UsageError
    from quark_ptq_eval.plan.source_reading import decide, engine_reads_source

    file2file_can_read = partial(engine_reads_source, "file2file")  # what the file2file entry declares it reads

    a = analyze_model(str(gpt_oss_release[1]), offline=True, catalog=catalog)
    for device in ("cpu", "cuda"):  # Quark 0.13 does not read the gpt-oss layout on any device
        with pytest.raises(UsageError) as exc:
            decide(a, "file2file", DeviceStrategy(device, False), tmp_path)
        assert "DeepSeek-V4 MXFP4 layout only" in exc.value.message and "staging copy" in exc.value.hint
        assert not file2file_can_read(a, device)
    reading = decide(a, "quark-api", DeviceStrategy("cpu", False), tmp_path)
    assert reading.mode == "stage_bf16" and reading.disk_bytes == a.source_format["read_as_bytes"]
    assert "E2M1" in reading.reason and not any(tmp_path.iterdir())  # planned, nothing created


@pytest.mark.slow
def test_an_mxfp4_release_is_quantized_validated_and_evaluated_on_this_cpu(gpt_oss_release, corpus, eval_text,
                                                                          tmp_path):
    r = _run_release(gpt_oss_release[1], tmp_path, "int8", corpus, eval_text)
    staged = r["wd"] / "source-bf16"
    assert r["summary"]["status"] == "done" and r["plan"]["source_reading"]["mode"] == "stage_bf16"
    assert r["summary"]["validation"] == "success", r["report"]
    assert r["report"]["source_model_dir"] == str(staged)
    layout = _layout_stats(r["report"])
    assert layout["quantized_share"] == layout["expected_share"] > 0.3
    results = json.loads((r["wd"] / "eval_results.json").read_text())
    assert results["settings"]["baseline"] == str(staged)
    assert math.isfinite(results["quantized"]["perplexity"]["perplexity"])


# ---- packed and scaled sources: counts, sizes and labels from the real layout ---------------------
def test_a_gptq_release_is_counted_from_its_packed_layout_before_it_is_refused(tiny_model, catalog, tmp_path):
    from quark_ptq_eval.intake.analyze import describe
    from tests.fixtures.packed_release import to_gptq_release

    bf16 = tiny_model("llama")
    gptq = to_gptq_release(bf16, tmp_path / "gptq")
    assert any(n.endswith(".qweight") and t.dtype == "I32" for n, t in read_model_headers(gptq).items())
    a, same = (analyze_model(str(d), offline=True, catalog=catalog) for d in (gptq, bf16))
    fmt, targets = a.source_format, a.quantization_targets
    assert fmt["name"] == "int4" and fmt["reading"] == "refused" and a.risks[0]["severity"] == "high"
    assert targets["linear_layer_count"] == same.quantization_targets["linear_layer_count"] == 15  # 14 + lm_head
    assert targets["quantized_by_default"] == same.quantization_targets["quantized_by_default"]
    assert fmt["params"] == same.source_format["params"]  # eight 4-bit codes an int32; scales, zeros, g_idx none
    assert fmt["quantizable_params"] == same.source_format["quantizable_params"]
    assert fmt["read_as_bytes"] == 2 * fmt["params"]  # read as BF16: the F16 rest as stored, codes widened
    size = dict(describe(a))["size"]
    assert f"{fmt['params']:,} parameters" in size and size.startswith(f"{a.size['bytes'] / 2**20:.1f} MiB")


def test_scale_labels_come_from_the_real_dtypes(tiny_model, release, catalog, tmp_path):
    from quark_ptq_eval.plan.source_reading import decide
    from tests.fixtures.packed_release import to_ct_fp8_release

    ct = to_ct_fp8_release(tiny_model("llama"), tmp_path / "ct-fp8")
    assert {t.dtype for n, t in read_model_headers(ct).items() if n.endswith("weight_scale")} == {"BF16"}
    a = analyze_model(str(ct), offline=True, catalog=catalog)
    assert a.source_format["name"] == "fp8_tensor"
    assert a.source_format["summary"] == "FP8 (E4M3) weights with a per-channel BF16 scale"
    reading = decide(a, "quark-api", DeviceStrategy("cpu", False), tmp_path / "wd")
    assert reading.reason.startswith("FP8 (E4M3) weights with a per-channel BF16 scale: ") and "F32" not in reading.reason
    block = analyze_model(str(release("qwen3")[1]), offline=True, catalog=catalog).source_format
    assert block["summary"].startswith("FP8 (E4M3) weights with one F32 scale per block")  # the releases' own F32


def test_an_mxfp4_plan_names_its_own_format_and_its_experts_are_fitted(gpt_oss_release, release, catalog):
    from quark_ptq_eval.plan import resources
    from quark_ptq_eval.plan.scheme_fit import SchemeChoice, fit_to_model, linear_shapes, misfits

    bf16, mx = gpt_oss_release
    a = analyze_model(str(mx), offline=True, catalog=catalog)
    basis = resources.output_basis(a)
    assert "MXFP4 layers left out" in basis and "FP8" not in basis
    assert "FP8 layers left out" in resources.output_basis(analyze_model(str(release("qwen3")[1]), offline=True,
                                                                         catalog=catalog))
    # every expert matrix of the 4-D blocks, (out, in) as Quark splits them: the BF16 model's, read transposed
    config = json.loads((bf16 / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    excludes = a.template["exclude_layers"]
    shapes = linear_shapes(str(mx), excludes)
    assert shapes == linear_shapes(str(bf16), excludes)
    experts = {m: s for m, s in shapes.items() if ".experts." in m}
    assert len(experts) == 3 * config["num_local_experts"] * config["num_hidden_layers"]
    assert {s for m, s in experts.items() if m.endswith(("gate_proj", "up_proj"))} == {(inter, hidden)}
    assert {s for m, s in experts.items() if m.endswith("down_proj")} == {(hidden, inter)}
    wide = {"weight": {"dtype": "int4", "qscheme": "per_group", "group_size": inter}}  # divides down_proj's in only
    assert {b.module.rpartition(".")[2] for b in misfits(wide, experts)} == {"gate_proj", "up_proj"}
    known = list(catalog["schemes"])
    assert fit_to_model(str(mx), SchemeChoice("int4_wo_128"), {}, excludes, known)[0] == "int4_wo_128"
