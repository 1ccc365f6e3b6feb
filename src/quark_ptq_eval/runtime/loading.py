"""Load a model for evaluation with the loader its config.json calls for, and prove its logits finite.

transformers' Quark integration loads single-level-scale exports (int8, fp8, int4, mxfp4) but
leaves the second-level scales of two-level schemes (nvfp4, int4_fp8) uninitialised: NaN logits.
Quark's own importer loads those correctly but costs ~20 s to import, so it is used only there.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.errors import QpeError, UsageError
from quark_ptq_eval.base.float32_modules import keep_float32_modules_in_model_dtype

if TYPE_CHECKING:
    import torch

TRANSFORMERS = "transformers"
QUARK = "quark"


@dataclass
class LoadedModel:
    path: Path
    model: Any
    tokenizer: Any
    loader: str
    loader_reason: str
    device: str
    load_s: float
    size_bytes: int
    # Weights the model class expects but the loader did not find in the files: it initialised them
    # at random (transformers says so only when asked). A model with any is not the export.
    missing_weights: tuple[str, ...] = ()


def model_size_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def read_config_or_raise(model_dir: Path) -> dict[str, Any]:
    """config.json as a dict; a UsageError when it is missing or not JSON (nothing can be loaded without it)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise UsageError(f"{model_dir} has no config.json: it is not a Hugging Face model directory.")
    try:
        config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
        return config
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{config_path} cannot be read as JSON ({exc}).") from None


def choose_loader(config: dict[str, Any]) -> tuple[str, str]:
    """(loader, reason) from the quantization_config of a model's config.json."""
    qconfig = config.get("quantization_config")
    if not qconfig:
        return TRANSFORMERS, "no quantization_config: an unquantized model"
    if qconfig.get("quant_method") != "quark":
        return TRANSFORMERS, f"quant_method {qconfig.get('quant_method')!r} is handled by transformers"
    if _has_two_level_scales(qconfig):
        return (
            QUARK,
            "Quark export with two-level scales (nvfp4 / int4_fp8 style): transformers leaves them uninitialised",
        )
    return TRANSFORMERS, "Quark export with single-level scales: transformers' Quark integration loads it"


def _has_two_level_scales(qconfig: dict[str, Any]) -> bool:
    configs = [qconfig.get("global_quant_config") or {}]
    for key in ("layer_quant_config", "layer_type_quant_config"):
        configs.extend((qconfig.get(key) or {}).values())
    for layer_config in configs:
        for role in ("weight", "input_tensors", "output_tensors", "bias"):
            spec = (layer_config or {}).get(role)
            # A list of specs quantizes the scales themselves: a second level.
            if isinstance(spec, list) and (len(spec) > 1 or any(s.get("is_scale_quant") for s in spec)):
                return True
            if isinstance(spec, dict) and spec.get("is_scale_quant"):
                return True
    return False


# ``experts.<n>.`` (Mixtral, Qwen-MoE, DeepSeek) and ``experts.mlp.<n>.`` (DBRX)
_EXPERT_TENSOR = re.compile(r"\.experts\.(?:mlp\.)?\d+\.")


def _has_per_expert_tensors(model_dir: Path) -> bool:
    """Quark's MoE preprocessing exports experts as ``...experts.<n>.<proj>`` linears (headers only)."""
    from quark_ptq_eval.base.safetensors_io import read_model_headers

    try:
        return any(_EXPERT_TENSOR.search(name) for name in read_model_headers(model_dir))
    except Exception:  # noqa: BLE001 - unreadable headers: the load itself reports them
        return False


def pick_loader(model_dir: Path, config: dict[str, Any]) -> tuple[str, str]:
    """(loader, reason) for a model directory: its config's, and Quark's importer for per-expert MoE exports."""
    chosen, reason = choose_loader(config)
    if chosen == TRANSFORMERS and reason.startswith("Quark export") and _has_per_expert_tensors(model_dir):
        chosen, reason = QUARK, ("Quark export of per-expert MoE linears: transformers 5 fuses them back into "
                                 "3-D parameters its quantized forward cannot run")
    return chosen, reason


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"  # ROCm builds answer through torch.cuda too


def load_model(
    model_dir: Path, device: str = "auto", trust_remote_code: bool = False, loader: str | None = None,
    allow_missing: bool = False,
) -> LoadedModel:
    """Load ``model_dir`` with the right loader; ``loader`` forces one (tests, fallbacks).

    Refuses a model whose loader left weights newly initialised (scoring it would score random
    weights) unless ``allow_missing`` (the load check, which reports them as a finding)."""
    model_dir = Path(model_dir)
    config = read_config_or_raise(model_dir)
    chosen, reason = pick_loader(model_dir, config)
    if loader is not None:
        chosen, reason = loader, f"forced {loader} loader"
    device = resolve_device(device)
    if (config.get("quantization_config") or {}).get("quant_method") == "quark":
        from quark_ptq_eval.base.first_use import announce_quark_import
        from quark_ptq_eval.base.quark_import import import_quark_torch

        announce_quark_import(f"loading the Quark export {model_dir.name}")  # both loaders import quark.torch
        import_quark_torch()  # now, through our cache of Quark's transformers scan (quark_import.py)
    started = time.perf_counter()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    load = _load_with_quark if chosen == QUARK else _load_with_transformers
    try:
        model, missing = load(model_dir, device, trust_remote_code)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise QpeError(
            f"Could not load {model_dir} with the {chosen} loader: {exc}".rstrip(".") + "."
        ) from exc
    model.eval()
    keep_float32_modules_in_model_dtype(model)  # DeepSeek-V4's float32 norms, as the engine ran them
    if missing and not allow_missing:
        raise QpeError(missing_weights_message(model_dir, chosen, missing),
                       "Validate the export (its load check names the loader and the weights); a Quark export "
                       "of per-expert MoE linears loads with Quark's importer.")
    return LoadedModel(
        model_dir,
        model,
        tokenizer,
        chosen,
        reason,
        device,
        time.perf_counter() - started,
        model_size_bytes(model_dir),
        missing,
    )


def missing_weights_message(model_dir: Path, loader: str, missing: tuple[str, ...]) -> str:
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return (f"The {loader} loader found {len(missing)} weight(s) of {Path(model_dir).name} missing from its files "
            f"and initialised them at random ({shown}): the loaded model is not what its files hold.")


def _load_with_transformers(model_dir: Path, device: str, trust_remote_code: bool) -> tuple[torch.nn.Module, tuple[str, ...]]:
    from transformers import AutoModelForCausalLM

    # (model, loading info) with output_loading_info=True, which transformers' annotation does not say
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype="auto", trust_remote_code=trust_remote_code, output_loading_info=True
    )
    model, info = loaded
    return model.to(device), tuple(sorted(info.get("missing_keys") or ()))


def _load_with_quark(model_dir: Path, device: str, trust_remote_code: bool) -> tuple[torch.nn.Module, tuple[str, ...]]:
    """Quark's importer; it reports nothing about missing weights (the load check's replay sees them)."""
    from quark.torch import import_model_from_safetensors

    def load(attention: str) -> torch.nn.Module:
        model: torch.nn.Module = import_model_from_safetensors(
            None, str(model_dir), trust_remote_code=trust_remote_code, attn_implementation=attention, device=device
        )
        return model

    try:
        return load("sdpa"), ()
    except ValueError as exc:  # gpt-oss, DeepSeek-V4: no SDPA path in transformers, eager is their only one
        if "does not support an attention implementation" not in str(exc):
            raise
    return load("eager"), ()


def require_finite(logits: torch.Tensor, what: str) -> None:
    """Refuse to report a number computed from NaN/inf logits."""
    import torch

    if not bool(torch.isfinite(logits).all()):
        raise QpeError(
            f"{what} produced non-finite logits (NaN or inf): no score is reported from them.",
            "The export may hold uninitialised scales; re-export it, or check that it loads with Quark's "
            "import_model_from_safetensors.",
        )
