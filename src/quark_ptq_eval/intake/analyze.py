"""Read a model's config.json and safetensors headers (never tensor payloads) and describe it.

The linear-layer count is exact when the headers are local (2-D ``*.weight`` tensors that are
not embeddings or norms) and a formula over the config otherwise; the analysis says which.
"""

from __future__ import annotations

import fnmatch
import math
import re
import time
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.artifacts import ModelAnalysis
from quark_ptq_eval.base.catalog import QuarkCatalog
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.fsio import read_json
from quark_ptq_eval.base.safetensors_io import read_model_headers, weight_files
from quark_ptq_eval.intake.formats import CONVERT_BIN, FORMATS, REFUSED, describe_source, is_packed

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
NON_LINEAR_HINTS = ("embed", "norm", "wte", "wpe", "rotary")


def resolve_model(model: str, offline: bool) -> tuple[Path | None, str]:
    """(local directory or None, source) for a model argument; refuses what cannot work."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"The model path {path} is a file; give the model's directory.")
        if not any(path.iterdir()):
            raise UsageError(f"The model directory {path} is empty.", "Point to a directory with config.json and safetensors.")
        if not (path / "config.json").is_file():
            raise UsageError(f"The model directory {path} has no config.json.", "Point to a Hugging Face model directory.")
        from quark_ptq_eval.intake.model_files import check_model_files

        check_model_files(path)  # every file it holds approved (links, special files, pickles) before anything runs
        return path.resolve(), "local"
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise UsageError(f"The model directory {path} does not exist.", "Check the path.")
    if HUB_ID.match(model):
        if offline:
            raise UsageError(
                f"{model} is not a local directory and offline mode is on, so it cannot be fetched from the Hub.",
                "Download it first (huggingface-cli download) and pass the local directory.",
            )
        return None, "huggingface_id"
    raise UsageError(f"The model {model} is neither an existing directory nor a Hugging Face repo id (org/name).")


def _hub_config(model: str) -> dict[str, Any]:
    try:
        from huggingface_hub import hf_hub_download

        config: dict[str, Any] = read_json(hf_hub_download(model, "config.json"), "config.json")
        return config
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - hub errors come in many types
        raise UsageError(f"Could not fetch config.json of {model} from the Hugging Face Hub ({type(exc).__name__}).",
                         "Check the repo id, your network and HF_TOKEN, or pass a local directory.") from None


def _load_config(model: str, path: Path | None) -> dict[str, Any]:
    config = read_json(path / "config.json", "config.json") if path else _hub_config(model)
    if not isinstance(config, dict):
        raise UsageError("config.json is not a JSON object.", "Check the model files.")
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise UsageError("config.json has no model_type, so the architecture is unknown.",
                         "Add the model_type of the architecture to config.json.")
    _check_config_types(config)
    return config


INT_KEYS = ("num_hidden_layers", "n_layer", "hidden_size", "n_embd", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "num_experts", "num_local_experts", "n_routed_experts",
            "moe_intermediate_size")


def _check_config_types(config: dict[str, Any]) -> None:
    """Refuse config values of the wrong type (naming the field) instead of crashing or guessing."""
    arch = config.get("architectures")
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        raise UsageError(f"config.json field architectures must be a list of class names, not {_brief(arch)}.",
                         "Fix config.json.")
    text_cfg = config.get("text_config")
    if text_cfg is not None and not isinstance(text_cfg, dict):
        raise UsageError(f"config.json field text_config must be an object, not {_brief(text_cfg)}.",
                         "Fix config.json.")
    for where, node in (("", config), ("text_config.", text_cfg or {})):
        for key in INT_KEYS:
            v = node.get(key)
            if v is not None and (type(v) is not int or v < 0):
                raise UsageError(f"config.json field {where}{key} must be a non-negative integer, not {_brief(v)}.",
                                 "Fix config.json.")


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _int(cfg: dict[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _module_of(tensor_name: str) -> str:
    return tensor_name.rsplit(".", 1)[0]


def _count_linears_from_headers(tensors: dict[str, Any]) -> tuple[list[str], int, int]:
    """(linear module names, bytes, fused expert tensors). transformers 5 holds MoE experts as
    fused 3-D tensors (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); Quark's
    preprocessing turns each into per-expert linears, counted here as ``experts.<e>.<proj>``."""
    linears, fused = [], 0
    for n, t in tensors.items():
        if any(h in n for h in NON_LINEAR_HINTS):
            continue
        if (n.endswith(".weight") or is_packed(n)) and len(t.shape) == 2:  # a GPTQ qweight is its linear's
            linears.append(_module_of(n))
        elif len(t.shape) == 3 and ".experts." in n:
            fused += 1
            module, proj = n.rsplit(".", 1)
            projs = ("gate_proj", "up_proj") if "gate_up" in proj else (proj.removesuffix("_weight"),)
            linears += [f"{module}.{e}.{p}" for e in range(t.shape[0]) for p in projs]
    return sorted(linears), sum(t.nbytes for t in tensors.values()), fused


def _count_linears_from_config(text_cfg: dict[str, Any], tied: bool) -> int:
    layers = _int(text_cfg, "num_hidden_layers", "n_layer") or 0
    experts = _int(text_cfg, "num_experts", "num_local_experts", "n_routed_experts") or 0
    mlp = 3 * max(experts, 1)
    return layers * (4 + mlp) + (0 if tied else 1)


def _config_size_bytes(text_cfg: dict[str, Any]) -> int | None:
    h, layers, vocab = (_int(text_cfg, "hidden_size", "n_embd"), _int(text_cfg, "num_hidden_layers", "n_layer"),
                        _int(text_cfg, "vocab_size"))
    if not (h and layers and vocab):
        return None
    inter = _int(text_cfg, "intermediate_size") or 4 * h
    return 2 * (layers * (4 * h * h + 3 * h * inter) + 2 * vocab * h)  # bf16


def _risks(cfg: dict[str, Any], text_cfg: dict[str, Any], template: bool, model_type: str, has_weights: bool,
           source_format: dict[str, Any]) -> list[dict[str, Any]]:
    risks = []

    def add(sev: str, msg: str, hint: str) -> None:
        risks.append({"severity": sev, "message": msg, "recovery_hint": hint})

    if not template:
        add("high", f"The installed Quark has no LLM template for model_type {model_type!r}.",
            "Register a template with Quark (`quark-cli register-template -h`) and run quark-cli with --template_file, "
            "or pick a supported model.")
    if cfg.get("auto_map"):
        add("high", "The model ships custom code (auto_map); loading it executes code from the model repository.",
            "Review the code; pass --trust-remote-code only if you trust it. Nothing runs it otherwise.")
    fmt = FORMATS[source_format["name"]]
    if fmt.reading == REFUSED:
        add("high", f"The weights are {source_format.get('summary') or fmt.summary} "
                    f"({source_format.get('quant_method') or 'unknown method'}).",
            fmt.refusal[0].upper() + fmt.refusal[1:] + ".")
    elif fmt.risk:
        add("low", fmt.risk, "Nothing to do: the plan shows how the source is read and what the staging costs.")
    if any(k in text_cfg for k in MOE_KEYS):
        add("medium", "Mixture-of-experts model: experts need calibration coverage and more memory.",
            "Use more calibration samples; consider excluding or overriding '*experts*' / routers.")
    if "vision_config" in cfg or "text_config" in cfg:
        add("medium", "Multimodal model: only the language model is quantized.",
            "Check the template's exclusions cover the vision tower.")
    if not has_weights and fmt.reading != CONVERT_BIN:
        add("medium", "No local safetensors headers: the linear count and size are estimated from config.json.",
            "Download the model locally for an exact analysis.")
    return risks


def analyze_model(model: str, *, offline: bool, catalog: QuarkCatalog, trust_remote_code: bool = False) -> ModelAnalysis:
    path, source = resolve_model(model, offline)
    cfg = _load_config(model, path)
    text_cfg: dict[str, Any] = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    model_type = cfg["model_type"]
    tmpl = catalog["templates"].get(model_type) or catalog["templates"].get(text_cfg.get("model_type", ""))
    excludes = list(tmpl["exclude_layers"]) if tmpl else []
    tied = bool(cfg.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", False)))

    has_weights = path is not None and bool(weight_files(path))
    tensors = None
    size: dict[str, Any]
    if path is not None and has_weights:
        tensors = read_model_headers(path)
        linears, nbytes, fused = _count_linears_from_headers(tensors)
        excluded = [m for m in linears if any(fnmatch.fnmatchcase(m, p) for p in excludes)]
        count, method = len(linears), "safetensors_header"
        size = {"bytes": nbytes, "method": "safetensors_header", "params": sum(math.prod(t.shape) for t in tensors.values())}
    else:
        count, method, excluded, fused = _count_linears_from_config(text_cfg, tied), "config_formula", [], 0
        size = {"bytes": _config_size_bytes(text_cfg) or 0, "method": "config_formula_bf16"}
    source_format = describe_source(cfg, tensors if has_weights else None, path, excludes)
    if source_format.get("params"):  # true counts: an FP8 byte is one parameter, scales are none
        size.update(params=source_format["params"], read_as_bytes=source_format["read_as_bytes"])
    elif FORMATS[source_format["name"]].reading == CONVERT_BIN and path is not None:
        size.update(bytes=sum(f.stat().st_size for f in path.glob("pytorch_model*.bin")), method="pytorch_bin_files")
    risks = _risks(cfg, text_cfg, tmpl is not None, model_type, has_weights, source_format)
    if fused:
        risks.append({"severity": "low", "message": f"{fused} fused 3-D expert tensors (transformers 5 MoE layout).",
                      "recovery_hint": "Nothing to do: both engines split them into per-expert linears "
                                       "(Quark's preprocess_for_quantization) so the experts are quantized."})
    complete = has_weights and tmpl is not None
    return ModelAnalysis(
        analysis_status="complete" if complete else "partial",
        model={"model_path": str(path or model), "model_source": source, "model_type": model_type,
               "architectures": list(cfg.get("architectures") or []), "trust_remote_code": trust_remote_code,
               "has_custom_code": bool(cfg.get("auto_map")),
               "transformers_version": str(cfg.get("transformers_version", "")),
               "torch_dtype": str(cfg.get("dtype", cfg.get("torch_dtype", "")))},
        architecture={"num_hidden_layers": _int(text_cfg, "num_hidden_layers", "n_layer"),
                      "hidden_size": _int(text_cfg, "hidden_size", "n_embd"),
                      "intermediate_size": _int(text_cfg, "intermediate_size"),
                      "num_attention_heads": _int(text_cfg, "num_attention_heads"),
                      "num_key_value_heads": _int(text_cfg, "num_key_value_heads"),
                      "vocab_size": _int(text_cfg, "vocab_size"), "tie_word_embeddings": tied,
                      "is_moe": any(k in text_cfg for k in MOE_KEYS),
                      "is_multimodal": "vision_config" in cfg or "text_config" in cfg,
                      "is_prequantized": bool(cfg.get("quantization_config"))},
        template={"available": tmpl is not None, "exclude_layers": excludes,
                  "kv_layers": tmpl["kv_layers"] if tmpl else [], "algorithms": tmpl["algorithms"] if tmpl else []},
        quantization_targets={"linear_layer_count": count, "linear_count_method": method,
                              "exclude_defaults": excludes, "excluded_by_default": excluded,
                              "quantized_by_default": count - len(excluded),
                              "has_non_linear_experts": fused > 0, "fused_expert_tensors": fused},
        size=size,
        risks=risks,
        source_format=source_format,
        analyzed_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def describe(analysis: ModelAnalysis) -> list[tuple[str, str]]:
    """The analysis as the rows of the table intake shows: (what, its value as text)."""
    a, t = analysis.architecture, analysis.quantization_targets
    return [
        ("model", analysis.model["model_path"]), ("model_type", analysis.model_type),
        ("architectures", ", ".join(analysis.model["architectures"]) or "-"),
        ("layers / hidden", f"{a['num_hidden_layers']} / {a['hidden_size']}"),
        ("MoE / multimodal / pre-quantized", f"{a['is_moe']} / {a['is_multimodal']} / {a['is_prequantized']}"),
        ("source format", (analysis.source_format or {}).get("summary", "-")),
        ("Quark template", "yes" if analysis.template["available"] else "NO"),
        ("default exclusions", ", ".join(analysis.template["exclude_layers"]) or "(none)"),
        ("quantizable linears", f"{t['linear_layer_count']} ({t['linear_count_method']})"),
        ("size", _size_text(analysis)),
        ("status", analysis.analysis_status),
    ]




def _size_text(analysis: ModelAnalysis) -> str:
    """Bytes on disk; for a pre-quantized source also its true parameter count and its size read as BF16."""
    size, fmt = analysis.size, analysis.source_format or {}
    text = f"{size['bytes'] / 2**20:.1f} MiB ({size['method']})"
    if fmt.get("prequantized_tensors") and size.get("params"):
        text += f"; {size['params']:,} parameters, {size['read_as_bytes'] / 2**20:.1f} MiB read as BF16"
    return text
