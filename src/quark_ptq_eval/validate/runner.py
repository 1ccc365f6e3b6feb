"""``validate_model``: the four checks, cheapest first, over a source and its quantized output."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import UnsafeInputError, UsageError
from ..safetensors_io import TensorInfo, read_model_headers
from .auxfiles import check_aux
from .configdiff import ConfigContext, check_config
from .layout import LayoutInputs, check_layout, layer_count
from .md5check import Progress, check_md5, excluded_candidates, sample
from .report import CheckResult, Finding, ValidationReport

DEFAULT_EXCLUDE = ["lm_head"]


def validate_model(source: Path | None, quantized: Path, plan: dict | None = None, *, max_samples: int | None = None,
                   seed: int = 0, workers: int | None = None, progress: Progress | None = None) -> ValidationReport:
    """Validate ``quantized`` against ``source`` (and ``plan`` when given); never raises on a mismatch.

    ``progress(check, done, total)`` is called as checks finish and as MD5 bytes are hashed.
    Raises :class:`UsageError` only for unusable arguments (a directory that does not exist).
    """
    t0 = time.perf_counter()
    source, quantized = _existing_dir(source, "source model"), _existing_dir(quantized, "quantized model")
    if max_samples is not None and max_samples < 1:
        raise UsageError(f"--max-samples must be at least 1, not {max_samples}.")
    notify = progress or (lambda check, done, total: None)
    src_cfg, out_cfg = _config(source), _config(quantized)
    qconfig = out_cfg.get("quantization_config") if isinstance(out_cfg.get("quantization_config"), dict) else None
    exclude, origin = _exclusions(plan, qconfig)

    headers: dict[str, dict[str, TensorInfo] | str] = {}
    layout = _timed(lambda: _layout(source, quantized, qconfig, exclude, plan, headers))
    notify("layout", 1, 4)
    aux = _timed(lambda: check_aux(source, quantized))
    notify("aux", 2, 4)
    ctx = ConfigContext(*(layer_count(h) if isinstance(h, dict) else 0 for h in (headers["source"], headers["output"])))
    config = _timed(lambda: check_config(source, quantized, ctx))
    notify("config", 3, 4)
    md5 = _timed(lambda: _md5(headers, exclude, bool(src_cfg.get("tie_word_embeddings")),
                              max_samples, seed, workers, progress))
    notify("md5", 4, 4)
    return ValidationReport(source, quantized, [layout, aux, config, md5], exclude_patterns=exclude,
                            exclusions_from=origin, seconds=time.perf_counter() - t0)


def _existing_dir(path: Path | str | None, what: str) -> Path:
    if path is None:
        raise UsageError(f"Validation needs the {what} as a local directory.",
                         "Pass --source with the directory of the model that was quantized.")
    path = Path(path).expanduser()
    if not path.is_dir():
        raise UsageError(f"The {what} directory {path} does not exist.", "Pass the directory that holds config.json.")
    return path.resolve()


def _config(model_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return {}  # the config check reports why
    return data if isinstance(data, dict) else {}


def _exclusions(plan: dict | None, qconfig: dict | None) -> tuple[list[str], str]:
    """The plan's exclusions when given; else what Quark wrote; else the recipe's default."""
    if plan is not None and isinstance(plan.get("exclude_layers"), list):
        return [str(p) for p in plan["exclude_layers"]], "plan"
    if qconfig is not None and isinstance(qconfig.get("exclude"), list):
        return [str(p) for p in qconfig["exclude"]], "quantization_config"
    return list(DEFAULT_EXCLUDE), "default"


def _layout(source: Path, quantized: Path, qconfig: dict | None, exclude: list[str], plan: dict | None,
            headers: dict) -> CheckResult:
    for side, model_dir in (("source", source), ("output", quantized)):
        try:
            headers[side] = read_model_headers(model_dir)
        except UnsafeInputError as exc:
            headers[side] = exc.message
    unreadable = [(side, h) for side, h in headers.items() if isinstance(h, str)]
    if unreadable:
        result = CheckResult("layout")
        result.findings += [Finding(f"{side} safetensors", msg, side="environment",
                                    evidence="refused before reading any tensor data; an interrupted write or "
                                             "copy, a full disk, or a tampered index")
                            for side, msg in unreadable]
        return result
    overrides = (plan or {}).get("layer_quant_config") or {}
    return check_layout(LayoutInputs(headers["source"], headers["output"], qconfig, exclude,
                                     {str(k): str(v) for k, v in overrides.items()}))


def _md5(headers: dict, exclude: list[str], tied: bool, max_samples: int | None, seed: int,
         workers: int | None, progress: Progress | None) -> CheckResult:
    source, output = headers["source"], headers["output"]
    if isinstance(source, dict) and isinstance(output, dict):
        return check_md5(source, output, exclude, tied_embeddings=tied,
                         max_samples=max_samples, seed=seed, workers=workers, progress=progress)
    result = CheckResult("md5")
    why = "the safetensors headers were refused (see the layout check)"
    if isinstance(source, str):
        result.findings.append(Finding("source safetensors", f"excluded tensors cannot be compared: {why}.",
                                       side="environment"))
        return result
    checked = sample(excluded_candidates(source, exclude, tied), max_samples, seed)
    result.findings += [Finding(name, f"cannot be compared with the source: the output's {why}.",
                                side="environment") for name in checked]
    result.stats.update(checked=len(checked))
    return result


def _timed(run: Callable[[], CheckResult]) -> CheckResult:
    t0 = time.perf_counter()
    result = run()
    result.seconds = time.perf_counter() - t0
    return result
