"""The load check one part at a time (validate/load_stream.py) against the whole-model load check, on the models
Tier 1's streaming is held to (tests/evaluate/ppl/test_stream_tier1.py: a trained 8-block tiny Llama in BF16 with outlier
channels, a tiny qwen3_moe), and a fault planted in an export still fails, named.

Both paths run the same transformers classes on the same probe, and load the export through the same loader's
conversions; the streamed one only never holds more than one part. Their verdicts must be the same: the same modules
replayed and emulated, the same findings, every module's loader and quantization error equal to float rounding."""

from __future__ import annotations

from pathlib import Path

import pytest

from quark_ptq_eval.validate.loadcheck import load_check_alone
from tests.evaluate.ppl.test_stream_tier1 import export, llama8_traits  # noqa: F401 - the shared fixture
from tests.validate.test_validate_plan import plan_for


def plan(scheme: str, corpus: Path) -> dict:
    """The plan test_stream_tier1's engine ran (8 windows of 128 tokens): the static scales are re-observed."""
    return plan_for(scheme, calibration={"path": str(corpus), "num_samples": 8, "seq_len": 128, "text_field": "text"})

pytestmark = pytest.mark.slow


def assert_same_verdict(whole, streamed) -> None:
    assert [f.subject for f in streamed.findings] == [f.subject for f in whole.findings]
    a, b = whole.stats, streamed.stats
    for key in ("modules_replayed", "modules_emulated", "probe_tokens", "loader", "static_scales_checked",
                "static_scales_off"):
        assert a.get(key) == b.get(key), (key, a.get(key), b.get(key))
    assert abs(a["greedy_agreement"] - b["greedy_agreement"]) <= 1e-9
    assert b["max_loader_error"] == pytest.approx(a["max_loader_error"], rel=1e-3, abs=1e-6)
    q_whole = {q["module"]: q["error"] for q in a["quantization_error"]}
    q_streamed = {q["module"]: q["error"] for q in b["quantization_error"]}
    assert q_streamed.keys() == q_whole.keys()
    for module, error in q_whole.items():
        assert q_streamed[module] == pytest.approx(error, rel=1e-4, abs=1e-7), module


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_the_streamed_load_check_equals_the_whole_model_one_on_a_trained_llama(scheme, llama8_traits,  # noqa: F811
                                                                                shared_assets, corpus):
    exported = export(shared_assets, corpus, llama8_traits, scheme)
    whole = load_check_alone(llama8_traits, exported, plan(scheme, corpus), stream_blocks=False)
    streamed = load_check_alone(llama8_traits, exported, plan(scheme, corpus), stream_blocks=True)
    assert not whole.findings and not whole.skipped_reason, whole.findings
    assert_same_verdict(whole, streamed)
    assert whole.stats["static_scales_checked"] > 0  # int8 and fp8 here have static input scales: re-observed
    assert streamed.stats["streamed_blocks"] == 8 and "streamed_blocks" not in whole.stats
    assert any("one part at a time" in n and "8 decoder blocks" in n for n in streamed.notes), streamed.notes


def test_the_streamed_load_check_equals_the_whole_model_one_on_a_tiny_moe(tiny_model, shared_assets, corpus):
    source = tiny_model("qwen3_moe")
    exported = export(shared_assets, corpus, source, "int8")
    whole = load_check_alone(source, exported, plan("int8", corpus), stream_blocks=False)
    streamed = load_check_alone(source, exported, plan("int8", corpus), stream_blocks=True)
    assert not whole.findings, whole.findings
    assert_same_verdict(whole, streamed)
    assert streamed.stats.get("experts") == whole.stats.get("experts")


def test_a_loader_that_misreads_a_scale_in_block_6_fails_the_streamed_check_named(llama8_traits, shared_assets,  # noqa: F811
                                                                                   corpus, monkeypatch):
    """The files are right and the loader is wrong: block 6's down_proj reads its weight scale 4x as the streamer
    loads the export's block 6 (what a loader bug in scale handling does). The streamed check names that module."""
    from quark_ptq_eval.runtime import blocks

    exported = export(shared_assets, corpus, llama8_traits, "int8")
    module = "model.layers.6.mlp.down_proj"
    real = blocks.load

    def misreading(streamed, part):
        real(streamed, part)
        if streamed.path == exported and part == "6":
            target = streamed.model.get_submodule(module)
            scales = [t for n, t in [*target.named_parameters(), *target.named_buffers()]
                      if n in ("weight_quantizer.scale", "weight_scale")]
            assert scales, "the loaded module holds its weight scale under another name"
            for scale in scales:
                scale.data.mul_(4)

    monkeypatch.setattr(blocks, "load", misreading)
    load = load_check_alone(llama8_traits, exported, stream_blocks=True)
    assert load.stats.get("worst_loader_module") == module, (load.notes, [f.line() for f in load.findings])
    assert 2.5 < load.stats["max_loader_error"] < 3.5  # (4 s - s) / s
    assert [f.subject for f in load.failures] == [module]


def test_a_static_input_scale_planted_in_block_5_fails_the_streamed_check_as_clipping(llama8_traits,  # noqa: F811
                                                                                      shared_assets, corpus,
                                                                                      copy_model, scale_in_file):
    """The streamed check re-observes the static scales on the calibration windows as they pass each block: an
    input_scale x0.25 planted into a real int8 export's file is named, as the whole-model check names it."""
    out = copy_model(export(shared_assets, corpus, llama8_traits, "int8"), "input-scale-down")
    name = "model.layers.5.mlp.up_proj.input_scale"
    scale_in_file(out, name, 0.25)
    load = load_check_alone(llama8_traits, out, plan("int8", corpus), stream_blocks=True)
    assert [f.subject for f in load.failures] == [name], [f.line() for f in load.findings]
    assert "it clips activations the calibration text reaches" in load.failures[0].message
    assert load.stats["static_scales_off"] == 1


def test_over_its_budget_the_streamed_check_replays_first_and_last_block_and_names_a_loader_fault_there(
        llama8_traits, shared_assets, corpus, monkeypatch):  # noqa: F811
    """A budget the first block alone overruns: blocks 0 and 7 are replayed, on the same hidden states on both
    sides (the skipped blocks skipped on both), the loader held to the emulation as before, and the report names
    the blocks and how to replay all. A loader that misreads block 7's scale is still named."""
    from quark_ptq_eval.runtime import blocks

    exported = export(shared_assets, corpus, llama8_traits, "int8")
    healthy = load_check_alone(llama8_traits, exported, plan("int8", corpus), stream_blocks=True, load_budget_s=1e-6)
    assert not healthy.findings, [f.line() for f in healthy.findings]
    assert healthy.stats["blocks_replayed"] == 2 and healthy.stats["max_loader_error"] < 0.03
    replayed = {q["module"].split(".")[2] for q in healthy.stats["quantization_error"] if ".layers." in q["module"]}
    assert replayed == {"0", "7"}, replayed
    assert any("replayed 2 of 8 decoder blocks (0, 7)" in n and "--load-check-minutes 0" in n for n in healthy.notes)
    module, real = "model.layers.7.mlp.down_proj", blocks.load

    def misreading(streamed, part):
        real(streamed, part)
        if streamed.path == exported and part == "7":
            for name, t in [*streamed.model.get_submodule(module).named_parameters(),
                            *streamed.model.get_submodule(module).named_buffers()]:
                if name in ("weight_quantizer.scale", "weight_scale"):
                    t.data.mul_(4)

    monkeypatch.setattr(blocks, "load", misreading)
    faulty = load_check_alone(llama8_traits, exported, stream_blocks=True, load_budget_s=1e-6)
    assert [f.subject for f in faulty.failures] == [module], [f.line() for f in faulty.findings]


def test_the_block_sample_is_every_block_within_budget_else_evenly_spaced_first_and_last_included():
    from quark_ptq_eval.validate.load_sample import BlockSample, sample

    assert sample(80, 600, 5.0) == list(range(80))  # 400 s: all
    assert sample(80, 0, 100.0) == list(range(80))  # no budget: all
    assert sample(126, 600, 100.0) == [0, 25, 50, 75, 100, 125]
    assert sample(8, 1e-6, 1.0) == [0, 7]
    assert sample(126, 300, 86.0, 2 * 20.0) == [0, 62, 125]  # the 405 B run: entry and exit ~20 s each
    chosen = BlockSample(8, 1e-6)
    taken = [i for i in range(8) if chosen.take(i) and (chosen.timed(i, 1.0) or True)]
    assert taken == [0, 7] and chosen.skipped == [1, 2, 3, 4, 5, 6]
    assert "replayed 2 of 8 decoder blocks (0, 7)" in (chosen.note() or "")
