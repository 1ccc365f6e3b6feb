"""Check 3: ``config.json`` deep-equal to the source after removing ``quantization_config``.

Each difference is reported by its JSON path and triaged: version stamps and keys a newer
transformers renames or re-lays out (``torch_dtype``->``dtype``, ``rope_theta``/``rope_scaling``
->``rope_parameters``) are benign drift. What is left is compared by meaning: both configs as
their transformers config class loads them (Qwen2Config writes ``sliding_window: null`` when
``use_sliding_window`` is false); a difference that vanishes there is benign, the rest is real.
The config classes are imported only then (importing transformers costs seconds).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quark_ptq_eval.validate.report import CheckResult, Finding

QUANT_KEYS = frozenset({"quantization_config"})
VERSION_STAMPS = frozenset({"transformers_version", "_commit_hash", "_name_or_path", "_attn_implementation_autoset"})
LAYER_COUNT_KEYS = frozenset({"num_hidden_layers", "n_layer", "num_layers"})
RENAMED = {"torch_dtype": "dtype"}
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


@dataclass(frozen=True)
class JsonDiff:
    path: str
    kind: str  # changed | type | only_in_source | only_in_output | length
    source: Any = None
    output: Any = None

    def describe(self) -> str:
        if self.kind == "only_in_source":
            return f"is only in the source (value {_short(self.source)})."
        if self.kind == "only_in_output":
            return f"is only in the output (value {_short(self.output)})."
        if self.kind == "length":
            return f"has {self.source} items in the source but {self.output} in the output."
        return f"changed from {_short(self.source)} to {_short(self.output)}."


def json_diff(a: Any, b: Any, path: str = "") -> list[JsonDiff]:
    if type(a) is not type(b):
        return [JsonDiff(path or "<root>", "type", a, b)]
    if isinstance(a, dict):
        out = [JsonDiff(_join(path, k), "only_in_source", a[k]) for k in sorted(a.keys() - b.keys())]
        out += [JsonDiff(_join(path, k), "only_in_output", None, b[k]) for k in sorted(b.keys() - a.keys())]
        for k in sorted(a.keys() & b.keys()):
            out += json_diff(a[k], b[k], _join(path, k))
        return out
    if isinstance(a, list):
        if len(a) != len(b):
            return [JsonDiff(path or "<root>", "length", len(a), len(b))]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in json_diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [JsonDiff(path or "<root>", "changed", a, b)]


def drop_keys(obj: Any, keys: frozenset[str]) -> Any:
    """Remove ``keys`` at any depth (as Quark's helper does for ``quantization_config``)."""
    if isinstance(obj, dict):
        return {k: drop_keys(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [drop_keys(v, keys) for v in obj]
    return obj


def normalize_drift(cfg: Any) -> Any:
    """The same config as a newer transformers would write it, minus version stamps."""
    if not isinstance(cfg, dict):
        return cfg
    cfg = drop_keys(copy.deepcopy(cfg), VERSION_STAMPS)
    for node in [cfg, *(v for v in cfg.values() if isinstance(v, dict) and "model_type" in v)]:
        _normalize_node(node)
    return cfg


def _normalize_node(node: dict[str, Any]) -> None:
    for old, new in RENAMED.items():
        if old in node:
            value = node.pop(old)
            node.setdefault(new, value)
    # Only the layouts transformers writes are re-laid out; anything else stays as it is and is
    # compared literally (a hand-edited config must not crash the comparison).
    if ("rope_parameters" not in node and ("rope_theta" in node or "rope_scaling" in node)
            and isinstance(node.get("rope_scaling"), dict | None)):
        params = dict(node.pop("rope_scaling", None) or {})
        params["rope_type"] = params.pop("type", params.get("rope_type", "default"))
        if "rope_theta" in node:
            params["rope_theta"] = node.pop("rope_theta")
        node["rope_parameters"] = params
    layer_types = node.get("layer_types")
    if isinstance(layer_types, list) and layer_types and all(t == "full_attention" for t in layer_types):
        node.pop("layer_types")  # the derived default newer versions spell out


def triage_json(source: Any, output: Any) -> tuple[list[JsonDiff], list[JsonDiff]]:
    """(real, benign) differences between two JSON documents."""
    raw = json_diff(source, output)
    real = json_diff(normalize_drift(source), normalize_drift(output))
    real_roots = {_root(d.path) for d in real}
    benign = [d for d in raw if _root(d.path) not in real_roots]
    return real, benign


def benign_reason(path: str) -> str:
    root = _root(path)
    if root in VERSION_STAMPS:
        return "version stamp written by the serializing library"
    if root in RENAMED or root in RENAMED.values():
        return "key renamed by newer transformers (torch_dtype -> dtype)"
    if root in ROPE_KEYS:
        return "RoPE settings re-laid out by newer transformers (rope_parameters)"
    if root == "layer_types":
        return "default layer types spelled out by newer transformers"
    return "known metadata drift"


def compare_by_meaning(source: dict[str, Any], output: dict[str, Any], real: list[JsonDiff]) -> tuple[list[JsonDiff], list[JsonDiff], str]:
    """Split ``real`` into (still real, same meaning once both configs are loaded by their class)."""
    loaded = _as_loaded(source, output)
    if loaded is None:
        return real, [], ""
    src, out, name = loaded
    still = {_root(d.path) for d in json_diff(normalize_drift(src), normalize_drift(out))}
    return [d for d in real if _root(d.path) in still], [d for d in real if _root(d.path) not in still], name


def _as_loaded(source: dict[str, Any], output: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str] | None:
    """Both configs through ``CONFIG_MAPPING[model_type].from_dict(...).to_dict()``, or None when
    the model type differs or is unknown, or a config does not load (then raw comparison stands)."""
    model_type = source.get("model_type")
    if not isinstance(model_type, str) or output.get("model_type") != model_type:
        return None
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        cls = CONFIG_MAPPING[model_type]
        return cls.from_dict(copy.deepcopy(source)).to_dict(), cls.from_dict(copy.deepcopy(output)).to_dict(), cls.__name__
    except Exception:  # noqa: BLE001 - a hand-damaged or foreign config: keep the literal comparison
        return None


@dataclass
class HeaderFacts:
    """Header facts that tell who changed a config value: the exporter or the environment."""

    source_layers: int
    output_layers: int


def check_config(source_dir: Path, output_dir: Path, facts: HeaderFacts) -> CheckResult:
    result = CheckResult("config")
    src, out = _load(source_dir / "config.json"), _load(output_dir / "config.json")
    for name, value in (("source", src), ("output", out)):
        if isinstance(value, str):
            result.findings.append(Finding(f"{name} config.json", value, side="environment"))
    if result.findings:
        return result
    source_cfg, output_cfg = drop_keys(src, QUANT_KEYS), drop_keys(out, QUANT_KEYS)
    real, benign = triage_json(source_cfg, output_cfg)
    result.findings += [Finding(d.path, d.describe(), benign=True, evidence=benign_reason(d.path)) for d in benign]
    if real:
        real, same_meaning, config_class = compare_by_meaning(source_cfg, output_cfg, real)
        why = f"normalised by transformers' {config_class} on load: both files mean the same config"
        result.findings += [Finding(d.path, d.describe(), benign=True, evidence=why) for d in same_meaning]
        benign = [*benign, *same_meaning]
    result.findings += [_real_finding(d, facts) for d in real]
    result.stats.update(keys_compared=_count_leaves(source_cfg), differences=len(real) + len(benign),
                        benign=len(benign))
    return result


def _real_finding(d: JsonDiff, ctx: HeaderFacts) -> Finding:
    if _root(d.path) in LAYER_COUNT_KEYS:
        if ctx.output_layers == ctx.source_layers:
            return Finding(d.path, d.describe(), side="quark",
                           evidence=f"the output's own weights hold {ctx.output_layers} layers like the source, "
                                    "so the exported config.json disagrees with its weights")
        return Finding(d.path, d.describe(), side="environment",
                       evidence=f"the output's weights hold {ctx.output_layers} layers, the source's "
                                f"{ctx.source_layers}: --source is not the model that was quantized")
    if _root(d.path) == "dtype":
        return Finding(d.path, d.describe(), side="environment",
                       evidence="the model was loaded in another dtype than the checkpoint's")
    if d.kind in ("only_in_source", "only_in_output"):
        return Finding(d.path, d.describe(), side="environment",
                       evidence="a key added or dropped: a transformers version with another config schema")
    return Finding(d.path, d.describe(), side="quark",
                   evidence="the exporter rewrote config.json with a value the source does not have")


def _load(path: Path) -> dict[str, Any] | str:
    """The parsed JSON object, or a one-sentence reason it cannot be compared."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "is missing."
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        return f"cannot be parsed as JSON ({exc})."
    return data if isinstance(data, dict) else "is not a JSON object."


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def _root(path: str) -> str:
    return path.split(".", 1)[0].split("[", 1)[0]


def _count_leaves(obj: Any) -> int:
    if isinstance(obj, dict):
        return sum(_count_leaves(v) for v in obj.values())
    if isinstance(obj, list):
        return sum(_count_leaves(v) for v in obj)
    return 1


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."
