"""The load check never gets the validator killed by the host: where the whole source or export would not fit the
RAM free now, it says so (with the memory it would need) before anything loads, and the other checks stand."""

from __future__ import annotations

import json
from pathlib import Path

from quark_ptq_eval.validate.load_stream import stream_bytes
from quark_ptq_eval.validate.loadcheck import load_check_alone, load_mode, memory_refusal
from quark_ptq_eval.validate.registry import CheckInputs
from tests.plan.test_plan_targets import header_only_llama


def llama70b_pair(root: Path) -> tuple[Path, Path]:
    """Llama-3-70B's shape, header-only (sparse: no disk), and a copy that says it is a Quark FP8 export."""
    source = header_only_llama(root / "llama-70b", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                               num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    export = header_only_llama(root / "llama-70b-fp8", hidden_size=8192, intermediate_size=28672,
                               num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                               vocab_size=128256)  # written again, never copied: a copy would fill the disk
    config = json.loads((export / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "quark", "global_quant_config": {}, "exclude": ["lm_head"]}
    (export / "config.json").write_text(json.dumps(config))
    return source, export


def test_the_load_check_of_a_70b_streams_where_the_whole_model_does_not_fit(tmp_path):
    """20 GiB free (this host's): the whole 70 B would need ~170 GiB, one part at a time a few GiB: it streams."""
    source, export = llama70b_pair(tmp_path)
    ctx = CheckInputs(source, export, None, load_check=True)
    ctx.read_headers()
    streamed, refused = load_mode(ctx, available=20 * 2**30)
    assert streamed and refused is None
    needed = stream_bytes(ctx) / 2**30
    # the largest part: the embeddings (or lm_head) of a 128 k vocabulary, 2.0 GiB in BF16, twice (its float32
    # emulation), the export's own beside it, and start-up (a decoder block is 1.6 GiB): under the 8 GiB
    assert 6 < needed < 8, needed


def test_the_load_check_of_a_70b_says_what_it_needs_instead_of_being_killed(tmp_path):
    """Less free than even one part at a time needs: it says so, with the memory, before anything loads; the whole
    model asked for on this host: refused with its own figure."""
    source, export = llama70b_pair(tmp_path)
    ctx = CheckInputs(source, export, None, load_check=True)
    ctx.read_headers()
    streamed, refused = load_mode(ctx, available=6 * 2**30)
    assert streamed and refused and refused.startswith("not run: even one decoder block at a time it needs about")
    assert "the other checks' results stand" in refused
    result = load_check_alone(source, export, stream_blocks=False)
    assert result.skipped_reason and result.skipped_reason.startswith("not run: it loads the whole source")
    needed = float(result.skipped_reason.split("about ")[1].split(" GiB")[0])
    assert 160 < needed < 200  # 141 GB of BF16 weights (131 GiB) x 1.25 + start-up
    assert "the other checks' results stand" in result.skipped_reason and not result.findings


def test_the_memory_rule_lets_a_model_that_fits_load(tmp_path):
    source, export = llama70b_pair(tmp_path)
    ctx = CheckInputs(source, export, None, load_check=True)
    ctx.read_headers()
    assert memory_refusal(ctx, available=400 * 2**30) is None
    assert load_mode(ctx, available=400 * 2**30) == (False, None)
