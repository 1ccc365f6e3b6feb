"""What a plan's scheme name means, as the spec Quark writes into an export's ``quantization_config``.

The table is asked of the installed Quark once (``LLMTemplate.get_config(scheme).to_dict()``,
the very dicts its exporter serialises), in a child process, and cached per Quark version and
install location like the capability catalog: the validator itself never imports quark.
The small readers of a spec (its dtype's bits, integer or not, one spec or a list) sit here too:
the plan's scheme fit and the validator read specs alike.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.fsio import cache_dir, fill_once, write_json

TABLE_FORMAT = 2  # 2: the KV-cache layer patterns of every template
# The fields of a QTensorConfig that decide what is stored; observers and rounding only shape values.
MEANING_KEYS = ("dtype", "qscheme", "ch_axis", "group_size", "block_size", "symmetric", "is_dynamic",
                "scale_type", "zero_point_type", "scale_format", "mx_element_dtype", "is_scale_quant")
ROLES = ("weight", "input_tensors", "output_tensors")
EMBEDDING_MARKERS = ("embed", "wte", "wpe")
_BITS = re.compile(r"^(?:u?int|fp|float|bfloat)(\d+)")


def _cache_path() -> Path | None:
    try:
        dist = importlib.metadata.distribution("amd-quark")
    except importlib.metadata.PackageNotFoundError:
        return None
    key = hashlib.sha256(f"{TABLE_FORMAT}|{dist.version}|{dist.locate_file('')}".encode()).hexdigest()[:12]
    return cache_dir() / f"quark-scheme-specs-{dist.version}-{key}.json"


def load_scheme_table() -> dict[str, Any] | None:
    """``{"schemes": {name: layer config}, "kv_cache": {name: output spec}, "kv_layers": {model_type: patterns}}``,
    or None without Quark."""
    path = _cache_path()
    if path is None:
        return None
    table: dict[str, Any] | None = fill_once(path, _build_scheme_table)  # two commands at once: one builds it
    return table


def _build_scheme_table(path: Path) -> dict[str, Any] | None:
    proc = subprocess.run([sys.executable, "-m", "quark_ptq_eval.base.schemes"], capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    table: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    write_json(path, table)
    return table


def dump_scheme_table() -> dict[str, Any]:
    """Runs inside the child: serialise each scheme's global layer config as the exporter does."""
    from quark_ptq_eval.base.quark_import import import_quark_torch

    import_quark_torch()  # Quark's scan of transformers answered from our cache (quark_import.py)
    from quark.torch import LLMTemplate

    template = LLMTemplate.get("llama")
    schemes: dict[str, Any] = {}
    for name in LLMTemplate.get_supported_schemes():
        try:
            schemes[name] = template.get_config(scheme=name).to_dict()["global_quant_config"]
        except Exception:  # noqa: BLE001 - a scheme Quark cannot build is absent from the table
            continue
    kv: dict[str, Any] = {}
    for name in sorted(LLMTemplate._SUPPORTED_KV_CACHE_SCHEMES):
        try:
            entries = template.get_config(scheme="int8", kv_cache_scheme=name).to_dict()["kv_cache_quant_config"]
        except Exception:  # noqa: BLE001
            continue
        kv[name] = next((e.get("output_tensors") for e in entries.values()), None)
    # the patterns each template's KV-cache scheme quantizes (k_proj/v_proj, MLA's kv_b_proj, fused qkv ...)
    kv_layers = {t: list(LLMTemplate.get(t).kv_layers_name or []) for t in LLMTemplate.list_available()}
    return {"format": TABLE_FORMAT, "schemes": schemes, "kv_cache": kv, "kv_layers": kv_layers}


def dtype_bits(quark_dtype: str | None) -> int | None:
    """``int4`` -> 4, ``fp8_e4m3`` -> 8, ``fp4`` -> 4; None for block formats we cannot size."""
    m = _BITS.match(quark_dtype or "")
    return int(m.group(1)) if m else None


def is_integer(quark_dtype: str | None) -> bool:
    return quark_dtype is not None and quark_dtype.startswith(("int", "uint"))


def as_spec_list(spec: Any) -> list[dict[str, Any]]:
    if spec is None:
        return []
    specs = spec if isinstance(spec, list) else [spec]
    return [s for s in specs if isinstance(s, dict)]


def is_embedding(module: str) -> bool:
    last = module.rsplit(".", 1)[-1].lower()
    return any(marker in last for marker in EMBEDDING_MARKERS)


def meaning(spec: Any) -> list[dict[str, Any]] | None:
    """The storage-deciding fields of a spec (or spec list), comparable across exports."""
    if spec is None:
        return None
    specs = spec if isinstance(spec, list) else [spec]
    return [{k: s.get(k) for k in MEANING_KEYS} for s in specs if isinstance(s, dict)]


def describe(spec: Any) -> str:
    """``int4 per_group g128`` style text for messages; ``none`` for an absent spec."""
    parts = []
    for s in meaning(spec) or []:
        text = f"{s['dtype']} {s['qscheme']}"
        if s.get("group_size") not in (None, 0, -1):
            text += f" group {s['group_size']}"
        if s.get("is_dynamic"):
            text += " dynamic"
        parts.append(text)
    return " + ".join(parts) or "none"


if __name__ == "__main__":
    from quark_ptq_eval.base.process_exit import exit_now

    print(json.dumps(dump_scheme_table()))
    exit_now(0)
