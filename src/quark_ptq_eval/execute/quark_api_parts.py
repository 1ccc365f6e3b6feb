"""The pieces of Quark's public API that the quark-api engine child (execute/quark_api_engine.py)
and the sensitivity scan both run, so that the scan measures the model the engine quantizes:
calibration windows over local text, the MoE preparation quark-cli does, the template's config and
its exclusions in the loaded model's names."""

from __future__ import annotations

from os import PathLike
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


def calibration_batches(tokenizer: PreTrainedTokenizerBase, texts: list[str], seq_len: int, num: int,
                        batch_size: int, device: str | torch.device) -> list[torch.Tensor]:
    """Non-overlapping token windows of ``seq_len`` over the joined local text."""
    import torch

    windows = calibration_windows(tokenizer, texts, seq_len, num)
    print(f"[quark-ptq-eval] calibration: {len(windows)} samples x {len(windows[0])} tokens", flush=True)
    return [torch.stack(windows[i : i + batch_size]).to(device) for i in range(0, len(windows), batch_size)]


def calibration_windows(tokenizer: PreTrainedTokenizerBase, texts: list[str], seq_len: int,
                        num: int) -> list[torch.Tensor]:
    """The engine's calibration windows, quietly (the load check re-observes activation scales on them)."""
    ids = tokenizer("\n\n".join(texts), return_tensors="pt").input_ids[0]
    windows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)][:num]
    return windows or [ids]  # text shorter than one window: calibrate on what there is


def prepare_for_quantization(model: torch.nn.Module) -> None:
    """As quark-cli does: fused 3-D expert parameters (transformers 5 MoE) become per-expert
    nn.Linear through Quark's module-replacement registry; without it experts stay in BF16.
    Modules kept in float32 return the model's dtype (base/float32_modules.py), or calibration
    stops at the first BF16 linear they feed. The sensitivity scan calls this too, so that it
    measures the model this engine quantizes."""
    from quark.torch.utils.llm.model_preparation import preprocess_for_quantization

    from quark_ptq_eval.base.float32_modules import describe, keep_float32_modules_in_model_dtype

    preprocess_for_quantization(model)
    if kept := keep_float32_modules_in_model_dtype(model):  # DeepSeek-V4's float32 norms in a BF16 model
        print(f"[quark-ptq-eval] {describe(kept)}", flush=True)


def template_config(model_type: str, scheme: str, *, algorithm: list[str] | None = None,
                    kv_cache_scheme: str | None = None, layer_config: dict[str, str] | None = None,
                    exclude_layers: list[str] | None = None) -> Any:  # a quark.torch Config (no stubs)
    """Quark's config for ``scheme`` from the model type's template (its exclusions unless given)."""
    from quark.torch import LLMTemplate

    kv_configs_per_module()
    return LLMTemplate.get(model_type).get_config(scheme=scheme, algorithm=algorithm, kv_cache_scheme=kv_cache_scheme,
                                                  layer_config=layer_config or {}, exclude_layers=exclude_layers)


def kv_configs_per_module() -> None:
    """Quark 0.13's ``setup_kv_cache_config`` gives every k/v projection the one config object of its KV-cache
    pattern and then clears that object's weight for an excluded projection: excluding one layer's k_proj (a
    block kept unquantized) left every layer's k/v weights unquantized. Each projection gets its own copy."""
    import copy
    from fnmatch import fnmatch

    from quark.torch.quantization import model_transformation as transformation

    if getattr(transformation.setup_kv_cache_config, "per_module", False):
        return

    def setup(config: Any, named_modules: dict[str, Any], module_configs: dict[str, Any]) -> None:
        for name, module in named_modules.items():
            if not transformation._is_quantizable_layer(module):
                continue
            for pattern, shared in config.kv_cache_quant_config.items():  # the last pattern matching wins, as in Quark
                if fnmatch(name, pattern):
                    own = module_configs[name] = copy.copy(shared)
                    if any(fnmatch(name, excluded) for excluded in config.exclude):
                        own.input_tensors, own.weight = None, None

    setup.per_module = True  # type: ignore[attr-defined]
    transformation.setup_kv_cache_config = setup


def loaded_exclusions(model: torch.nn.Module, model_dir: str | PathLike[str],
                      exclude_layers: list[str] | None) -> list[str] | None:
    """The exclusions (given, else the template's), plus each module they name under the checkpoint's
    tensor names (DeepSeek-V4's ``head``) named under the loaded model's (``lm_head``): Quark matches
    patterns against the loaded names only (base/legacy_exclusions.py). None: the template's, unchanged."""
    from quark.torch import LLMTemplate

    from quark_ptq_eval.base.legacy_exclusions import loaded_name_exclusions

    model_type = str(model.config.model_type)  # type: ignore[union-attr]  # a transformers model's config
    if exclude_layers is not None:
        given = list(exclude_layers)
    else:
        template = LLMTemplate.get(model_type).exclude_layers_name or []
        given = [template] if isinstance(template, str) else list(template)
    added = loaded_name_exclusions(model_dir, model_type, given, model.state_dict().keys())
    if not added:
        return exclude_layers
    print(f"[quark-ptq-eval] exclusions in the loaded model's names: {', '.join(added)} added for "
          f"{', '.join(given)} (the checkpoint's names)", flush=True)
    return [*given, *added]
