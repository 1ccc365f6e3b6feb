"""What the installed Quark supports: schemes, algorithms, KV-cache schemes and per-model templates.

Asked of the installed package, never hard-coded. ``import quark.torch`` costs ~20 s, so the
answer is computed once in a child process and cached per Quark version and install location.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, TypedDict

from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.base.fsio import cache_dir, fill_once, write_json

CATALOG_FORMAT = 3  # bump when dump_catalog() describes more


class TemplateInfo(TypedDict):
    """What Quark's LLMTemplate of one model type holds: its default exclusions, its KV-cache layers
    and the algorithms it has a built-in config for."""

    exclude_layers: list[str]
    kv_layers: list[str]
    algorithms: list[str]


class SchemeInfo(TypedDict, total=False):
    """One scheme as dump_catalog() reads it from the config Quark builds for it (or the ``error`` it raised)."""

    weight_dtypes: list[str]
    activation_dtypes: list[str]
    weight_only: bool
    static_activations: bool
    weight_bits: float | None  # of the first weight dtype, without scales
    error: str


class QuarkCatalog(TypedDict):
    """The catalog as dump_catalog() writes it (and the cache holds it): the installed Quark's
    schemes, each scheme's weight / activation dtypes (``scheme_info``, or its ``error``),
    algorithms, KV-cache schemes and per-model-type templates."""

    quark_version: str
    scheme_info: dict[str, SchemeInfo]
    schemes: list[str]
    algorithms: list[str]
    kv_cache_schemes: list[str]
    templates: dict[str, TemplateInfo]


def quark_version() -> str:
    try:
        return importlib.metadata.version("amd-quark")
    except importlib.metadata.PackageNotFoundError:
        raise QpeError("AMD Quark is not installed.", "Install it with: pip install 'amd-quark[cli]==0.13'.") from None


def _install_key() -> str:
    dist = importlib.metadata.distribution("amd-quark")
    where = str(dist.locate_file(""))
    return hashlib.sha256(f"{CATALOG_FORMAT}|{quark_version()}|{where}".encode()).hexdigest()[:12]


def catalog_path() -> Path:
    return cache_dir() / f"quark-catalog-{quark_version()}-{_install_key()}.json"


def catalog_built() -> bool:
    """Is the catalog cached for this Quark install (so no first-use build is due)?"""
    try:
        return catalog_path().is_file()
    except Exception:  # noqa: BLE001 - Quark absent: the catalog step reports that itself
        return True


def load_catalog() -> QuarkCatalog:
    path = catalog_path()
    catalog: QuarkCatalog = fill_once(path, _build_catalog)  # two commands at once: one builds it
    return catalog


def _build_catalog(path: Path) -> QuarkCatalog:
    from quark_ptq_eval.base.first_use import announce_catalog_build

    announce_catalog_build()  # once per Quark install: say why this first run pauses
    proc = subprocess.run([sys.executable, "-m", "quark_ptq_eval.base.catalog"], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise QpeError(f"Could not query the installed Quark for its supported schemes: {tail[0]}")
    catalog: QuarkCatalog = json.loads(proc.stdout.strip().splitlines()[-1])
    write_json(path, catalog)
    return catalog


def dump_catalog() -> QuarkCatalog:
    """Runs inside the child: import Quark and describe it."""
    from quark_ptq_eval.base.quark_import import import_quark_torch

    import_quark_torch()  # Quark's scan of transformers answered from our cache (quark_import.py)
    from quark.torch import LLMTemplate
    from quark.torch.quantization.config.algo_configs import get_supported_algorithm_types

    templates: dict[str, TemplateInfo] = {}
    for model_type in LLMTemplate.list_available():
        t = LLMTemplate.get(model_type)
        templates[model_type] = {
            "exclude_layers": list(t.exclude_layers_name or []),
            "kv_layers": list(t.kv_layers_name or []),
            # only algorithms with a built-in config for this model type: get_config raises for the rest
            "algorithms": sorted(k for k, v in (t.algo_config or {}).items() if v is not None),
        }
    return {
        "quark_version": quark_version(),
        "scheme_info": {name: _scheme_info(LLMTemplate.get("llama"), name) for name in LLMTemplate.get_supported_schemes()},
        "schemes": list(LLMTemplate.get_supported_schemes()),
        "algorithms": list(get_supported_algorithm_types()),
        "kv_cache_schemes": sorted(LLMTemplate._SUPPORTED_KV_CACHE_SCHEMES),
        "templates": templates,
    }


def _dtypes(spec: Any) -> list[str]:  # a Quark QuantizationSpec, a list of them, or None
    specs = spec if isinstance(spec, list) else [spec] if spec is not None else []
    return [getattr(s.dtype, "value", str(s.dtype)) for s in specs]


def _scheme_info(template: Any, name: str) -> SchemeInfo:  # a Quark LLMTemplate (no stubs)
    """Weight / activation dtypes of a scheme, read from the config Quark builds for it."""
    try:
        g = template.get_config(scheme=name).global_quant_config
    except Exception as exc:  # noqa: BLE001 - a scheme Quark cannot build is reported, not fatal
        return {"error": str(exc)}
    weight, act = _dtypes(g.weight), _dtypes(g.input_tensors)
    specs = g.input_tensors if isinstance(g.input_tensors, list) else [g.input_tensors] if g.input_tensors else []
    return {"weight_dtypes": weight, "activation_dtypes": act, "weight_only": not act,
            "static_activations": any(not getattr(s, "is_dynamic", False) for s in specs),
            "weight_bits": _bits(weight[0]) if weight else None}


def _bits(dtype: str) -> float:
    digits = "".join(c for c in dtype.split("_")[0] if c.isdigit())
    return float(digits) if digits else 16.0


if __name__ == "__main__":
    from quark_ptq_eval.base.process_exit import exit_now

    print(json.dumps(dump_catalog()))
    exit_now(0)  # Quark was imported: skip its teardown
