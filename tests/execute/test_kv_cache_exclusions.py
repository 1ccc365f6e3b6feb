"""A block kept unquantized beside an FP8 KV cache: Quark 0.13 shares one config object among every k/v projection
and clears its weight for the excluded one, so every layer's k/v weights came out unquantized (the remedies' "keep
block N" variant was rejected on the MI300X path). The engine gives each projection its own config
(execute/quark_api_parts.kv_configs_per_module): on a real Quark export of the tiny model."""

from __future__ import annotations

from quark_ptq_eval.base.safetensors_io import read_model_headers


def test_a_kept_block_leaves_the_other_layers_k_and_v_quantized_under_an_fp8_kv_cache(quantized):
    export = quantized("int8", exclude=["lm_head", "model.layers.0.*"], kv="fp8")
    headers = read_model_headers(export)
    for proj in ("k_proj", "v_proj"):
        kept, other = f"model.layers.0.self_attn.{proj}", f"model.layers.1.self_attn.{proj}"
        assert headers[f"{kept}.weight"].dtype != "I8" and f"{kept}.output_scale" in headers  # excluded, KV kept
        assert headers[f"{other}.weight"].dtype == "I8" and f"{other}.output_scale" in headers
