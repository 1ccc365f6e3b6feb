"""MX formats on CPU in fake-quant mode: the QDQ path Quark itself takes there, not its HIP kernel.

The engine never runs a fake-quantized forward after calibration: it freezes and exports, and
Quark's weight quantizers go through ``ScaledFakeQuantize`` (observer + the hw-emulation
``scaled_fake_quantize`` op, which has a CPU build). The scan does run such forwards, and for a
dynamic OCP-MXFP4 quantizer Quark 0.13 picks ``mxfp4_dynamic_fake_quantize``: for a bf16/fp16
input that calls ``kernel_ext.qdq_mxfp4``, which on a CPU raises "qdq_mxfp4 is only implemented
in CUDA devices!". For every other input dtype the same function falls back to the quantizer's
own ``fake_quantize`` (observe, then ``scaled_fake_quantize``). On a CPU the scan routes every
such quantizer to that fallback: the same emulation the engine's weights go through, the same
numbers the HIP kernel computes on a GPU (both round to the "even" MX scale). With that, every
scheme of Quark 0.13's 28 runs here on a CPU (tiny Qwen3-MoE, bf16); what still cannot run is a
group size that does not divide a quantized linear, refused before anything loads, as the plan does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def use_cpu_emulation(model: Any) -> int:
    """Point each dynamic MXFP4 quantizer of ``model`` at Quark's CPU QDQ path; returns how many."""
    from quark.torch.kernel import mxfp4_dynamic_fake_quantize

    moved = 0
    for module in model.modules():
        if getattr(module, "fake_quantize_func", None) is mxfp4_dynamic_fake_quantize:
            module.fake_quantize_func = module.fake_quantize
            module.fake_quantize_func_kwargs = {}
            moved += 1
    return moved


def check_scheme_runs(model_dir: Path, scheme: str, exclude: list[str] | None,
                      layer_config: dict[str, str] | None) -> None:
    """Refuse, before anything loads, a scheme Quark cannot fake-quantize on this model: one whose groups
    do not divide a linear it quantizes (Quark's observer would fail there, as the engine's would)."""
    from quark_ptq_eval.base.catalog import load_catalog
    from quark_ptq_eval.base.fsio import read_json
    from quark_ptq_eval.plan.scheme_fit import SchemeChoice, fit_to_model

    catalog = load_catalog()
    model_type = str((read_json(Path(model_dir) / "config.json", "model config") or {}).get("model_type"))
    template = (catalog.get("templates") or {}).get(model_type)
    template_excludes = template.get("exclude_layers") if template else None
    excludes = list(exclude) if exclude is not None else list(template_excludes or [])
    fit_to_model(str(model_dir), SchemeChoice(scheme, "asked for explicitly"), dict(layer_config or {}), excludes,
                 list(catalog.get("schemes") or []))
