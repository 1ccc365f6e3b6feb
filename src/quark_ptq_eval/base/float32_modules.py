"""Modules a family keeps in float32 inside a BF16 model hand their output back in the model's dtype.

transformers 5 keeps some modules of a BF16 checkpoint in float32 (``_keep_in_fp32_modules_strict``).
DeepSeek-V4 keeps its RMSNorms so (``input_layernorm``, ``q_a_norm``, ``kv_norm``, ``norm``...), but
its ``DeepseekV4RMSNorm`` returns ``weight * x.to(input_dtype)``: a float32 weight promotes the
product back to float32, and the BF16 linear that follows refuses it ("expected m1 and m2 to have
the same dtype, but got: float != c10::BFloat16"), in transformers' own forward as in Quark's
calibration. DeepSeek's reference code casts the norm's output to its input's dtype; so does the
hook installed here, on every module holding a float32 parameter of its own in a model whose
weights are otherwise in a lower precision, and only where the output came out float32 from an
input that was not. Nothing is stored: the weights and the export are untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _compute_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype most of the model's floating parameters are held in (None: float32 or none)."""
    import torch

    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    dtype = max(counts, key=lambda d: counts[d]) if counts else None
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def _restore_input_dtype(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    import torch

    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if (first is not None and first.is_floating_point() and first.dtype != torch.float32
            and isinstance(output, torch.Tensor) and output.dtype == torch.float32):
        return output.to(first.dtype)
    return None  # unchanged


def keep_float32_modules_in_model_dtype(model: torch.nn.Module) -> list[str]:
    """Install the hook on the model's float32 modules; return their names (none in a float32 model)."""
    import torch

    if _compute_dtype(model) is None:
        return []
    names = []
    for name, module in model.named_modules():
        if any(p.dtype == torch.float32 for p in module.parameters(recurse=False)):
            module.register_forward_hook(_restore_input_dtype)
            names.append(name)
    return names


def describe(names: list[str]) -> str:
    """One log line naming the modules (the first few), for the engine's and the loaders' logs."""
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"{len(names)} module(s) the model keeps in float32 hand a float32 output back in their input's "
            f"dtype (as the family's reference code does): {shown}")
