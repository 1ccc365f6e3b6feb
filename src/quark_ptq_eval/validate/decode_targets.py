"""What the decode check decodes: every weight of the export with a ``weight_scale``, paired with its
source tensor and its one-level weight spec from ``quantization_config``; and, named with the reason,
those it cannot decode (two-level scales, a 3-D weight, a qscheme it does not read, no source tensor).
Headers and config only: nothing is read from the files here."""

from __future__ import annotations

from typing import Any

from quark_ptq_eval.base.safetensors_io import TensorInfo
from quark_ptq_eval.base.schemes import as_spec_list
from quark_ptq_eval.validate.decode_blocks import DecodeTarget
from quark_ptq_eval.validate.expectations import module_config


def find_targets(output: dict[str, TensorInfo], source: dict[str, TensorInfo],
                 qconfig: dict[str, Any]) -> tuple[list[DecodeTarget], list[tuple[str, str]]]:
    """Every weight with a ``weight_scale`` in the export, with what decodes it; and those that cannot be."""
    reorder = ((qconfig.get("export") or {}).get("pack_method") or "reorder") == "reorder"
    targets, unchecked = [], []
    for name in sorted(output):
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is None or f"{module}.weight_scale" not in output:
            continue
        config = module_config(qconfig, module)
        specs = as_spec_list(config.weight if config else None)
        why = _cannot_decode(name, specs, output, source)
        if why:
            unchecked.append((name, why))
            continue
        targets.append(DecodeTarget(module, output[name], output[f"{module}.weight_scale"],
                              output.get(f"{module}.weight_zero_point"), source[name], specs[0], reorder))
    return targets, unchecked


def _cannot_decode(name: str, specs: list[dict[str, Any]], output: dict[str, TensorInfo],
                   source: dict[str, TensorInfo]) -> str | None:
    if len(specs) != 1:
        return "two-level scales" if len(specs) > 1 else "no weight spec in quantization_config"
    if name not in source:
        return "no source tensor of that name"
    if len(source[name].shape) != 2:
        return f"a {len(source[name].shape)}-D weight"
    if specs[0].get("qscheme") not in ("per_tensor", "per_channel", "per_group"):
        return f"qscheme {specs[0].get('qscheme')}"
    if f"{name[: -len('.weight')]}.weight_scale_2" in output:
        return "two-level scales"
    return None
