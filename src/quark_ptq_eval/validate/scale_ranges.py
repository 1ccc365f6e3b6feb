"""Static activation scales set against the data they were calibrated on.

The load check holds the loader to the export; a static ``input_scale`` written wrong is then read
"right" by both. So each exported static per-tensor scale is re-observed: the model runs the
run's own calibration windows (the plan's text, seq_len and sample count, cut as the engine cuts them:
``execute/quark_api_parts.calibration_batches``), and Quark's observer for the spec
(``PerTensorMinMaxObserver``: absmax over every token; symmetric integers divide by half the integer
range, fp8 by its largest value) gives the scale it would have written. Quark observes the float
model (a SmoothQuant export's scales are exactly absmax 1.0 over its smoothed channels: no upstream
quantization moved them), so the windows run through the source; a resample of the windows moves a
maximum, so the check
accepts the spread that resampling the windows gives (``RESAMPLES`` bootstrap draws: from the 1st
percentile to the full data's value) widened by that spread on each side; outside it the scale is an
export fault, named. Scales exactly 1.0 stay the calibration check's (calibration.py). Under a
scaling algorithm (SmoothQuant, AWQ) or a rotation, calibration saw a rewritten float model the export
does not store: those scales are not re-observed, and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.schemes import as_spec_list
from quark_ptq_eval.validate.expectations import module_config
from quark_ptq_eval.validate.quantizers import FLOAT_MAX, int_range, is_int, read_scale
from quark_ptq_eval.validate.report import MAX_LISTED, Finding

if TYPE_CHECKING:
    import torch

    from quark_ptq_eval.validate.registry import CheckInputs
    from quark_ptq_eval.validate.report import CheckResult

OBSERVER = "PerTensorMinMaxObserver"
# Calibration windows re-run at most, evenly spaced over the run's: each is a whole forward of the source, as many as
# Tier 1's. A sample's maximum bounds calibration's from below, so a sample judges scales too small (clipping); only
# every window judges a scale too large.
OBSERVED_WINDOWS = 8
RESAMPLES = 200
UNOBSERVED = 1.0  # the calibration check's
ROUNDING = 2.0 ** -7


@dataclass
class StaticScale:
    module: str
    side: str  # "input" or "output"
    exported: float
    top: float  # the format's half range (ints) or largest value (floats)


def static_scales(ctx: CheckInputs, modules: set[str]) -> list[StaticScale]:
    """Every static per-tensor activation scale of the export observed by ``PerTensorMinMaxObserver``."""
    qconfig, output = ctx.qconfig or {}, ctx.tensors("output") or {}
    found = []
    for module in sorted(modules):
        if f"{module}.weight_scale" not in output:
            continue
        config = module_config(qconfig, module)
        # inputs only: KV-cache output scales are merged across k and v (export.kv_cache_group) and
        # floored (min_kv_scale), so one module's range does not give them; kvcache.py checks those
        for side, specs in (("input", config.input_tensors if config else None),):
            spec = next(iter(as_spec_list(specs)), None)
            if spec is None or spec.get("is_dynamic") or spec.get("qscheme") != "per_tensor":
                continue
            if spec.get("observer_cls") != OBSERVER or not (spec.get("symmetric", True) or spec["dtype"] in FLOAT_MAX):
                continue
            dtype = str(spec.get("dtype"))
            top = FLOAT_MAX.get(dtype) or ((int_range(dtype)[1] - int_range(dtype)[0]) / 2 if is_int(dtype) else 0)
            value = read_scale(output, f"{module}.{side}_scale")
            if top and value is not None and value.size == 1 and float(value.reshape(-1)[0]) != UNOBSERVED:
                found.append(StaticScale(module, side, float(value.reshape(-1)[0]), top))
    return found


@dataclass
class Observation:
    """What re-observing the static scales takes: the scales, the calibration windows (batch of one each)."""

    scales: list[StaticScale]
    windows: list[torch.Tensor]
    capped: bool


def check_static_scales(ctx: CheckInputs, model: torch.nn.Module, tokenizer: Any, result: CheckResult) -> None:
    """Findings for static scales outside what the calibration text gives; a note when it cannot judge."""
    observation = prepare_observation(ctx, {name for name, _ in model.named_modules()}, tokenizer, result)
    if observation is not None:
        judge_observation(observation, _observe(model, observation.windows, observation.scales), result)


def prepare_observation(ctx: CheckInputs, modules: set[str], tokenizer: Any, result: CheckResult) -> Observation | None:
    """The scales to re-observe among ``modules`` and the windows to run; None (with a note) when there is none
    or it cannot judge them."""
    from quark_ptq_eval.validate.rewrites import ROTATING, SCALING, algorithms

    scales = static_scales(ctx, modules)
    if not scales:
        return None
    rewrites = sorted(set(algorithms(ctx.qconfig, ctx.plan)) & (SCALING | ROTATING))
    if rewrites:
        result.notes.append(f"{len(scales)} static activation scales not re-observed: {', '.join(rewrites)} "
                            "calibrated a rewritten float model the export does not store")
        return None
    calibration = (ctx.plan or {}).get("calibration") or {}
    path = calibration.get("path")
    if not path or not Path(path).exists():
        result.notes.append(f"{len(scales)} static activation scales not re-observed: the run's calibration text "
                            "is not a local file recorded in the plan")
        return None
    windows, capped = _windows(tokenizer, calibration)
    return Observation(scales, windows, capped)


def judge_observation(observation: Observation, maxima: dict[tuple[str, str], list[float]], result: CheckResult) -> None:
    """Each scale against the resampled spread of its windows' maxima: findings for those outside it."""
    scales, windows, capped = observation.scales, observation.windows, observation.capped
    result.stats["static_scales_checked"] = len(scales)
    bad = [(s, bounds) for s in scales if (bounds := _bounds(maxima[(s.module, s.side)], s.top, capped))
           and not bounds[0] <= s.exported <= bounds[1]]
    result.stats["static_scales_off"] = len(bad)
    note = " (a sample, evenly spaced: only scales too small judged)" if capped else ""
    result.stats["static_scale_windows"] = len(windows)
    result.notes.append(f"{len(scales)} static activation scales re-observed on {len(windows)} of the run's "
                        f"calibration windows{note}; {len(bad)} outside the resampled spread")
    for s, (low, high) in bad[:MAX_LISTED]:
        clip = "clips activations the calibration text reaches" if s.exported < low else "wastes the format's range"
        result.findings.append(Finding(
            f"{s.module}.{s.side}_scale", f"is {s.exported:.4g}, outside the {low:.4g}-{high:.4g} the calibration "
            f"text gives when re-observed as {OBSERVER} would: it {clip}.", side="quark",
            evidence=f"expected: a scale within the calibration windows' resampled spread; found {s.exported:.6g}"))


def _windows(tokenizer: Any, calibration: dict[str, Any]) -> tuple[list[torch.Tensor], bool]:
    from quark_ptq_eval.base.textdata import load_texts
    from quark_ptq_eval.execute.quark_api_parts import calibration_windows

    texts = load_texts(calibration["path"], calibration.get("text_field") or "text")
    num = int(calibration.get("num_samples") or 128)
    windows = calibration_windows(tokenizer, texts, int(calibration.get("seq_len") or 512), num)
    if len(windows) > OBSERVED_WINDOWS:
        step = len(windows) / OBSERVED_WINDOWS
        return [windows[int(i * step)][None, :] for i in range(OBSERVED_WINDOWS)], True
    return [w[None, :] for w in windows], False


def _observe(model: torch.nn.Module, windows: list[torch.Tensor],
             scales: list[StaticScale]) -> dict[tuple[str, str], list[float]]:
    """Per (module, side): the absmax of each window."""
    import torch

    maxima: dict[tuple[str, str], list[float]] = {(s.module, s.side): [] for s in scales}
    device = next(model.parameters()).device
    with torch.no_grad(), Watch(dict(model.named_modules()), scales) as watch:
        for ids in windows:
            model(ids.to(device), use_cache=False)
            watch.window_done(maxima)
    return maxima


class Watch:
    """Hooks keeping the absmax each watched module sees (its input, before its own quantizer; or its output),
    over the calls since the last ``window_done``."""

    def __init__(self, modules: dict[str, Any], scales: list[StaticScale]):
        self.modules, self.keys = modules, [(s.module, s.side) for s in scales if s.module in modules]
        self.current: dict[tuple[str, str], float] = {}
        self.handles: list[Any] = []

    def keep(self, key: tuple[str, str], value: Any) -> None:
        import torch

        if isinstance(value, torch.Tensor):
            self.current[key] = max(self.current.get(key, 0.0), float(value.detach().abs().amax()))

    def __enter__(self) -> Watch:
        for module, side in self.keys:
            if side == "input":
                self.handles.append(self.modules[module].register_forward_pre_hook(  # before its own quantizer
                    lambda _m, args, key=(module, side): self.keep(key, args[0] if args else None), prepend=True))
            else:
                self.handles.append(self.modules[module].register_forward_hook(
                    lambda _m, _a, out, key=(module, side): self.keep(key, out)))
        return self

    def window_done(self, maxima: dict[tuple[str, str], list[float]]) -> None:
        for key in self.keys:
            maxima[key].append(self.current.get(key, 0.0))
        self.current.clear()

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _bounds(maxima: list[float], top: float, capped: bool) -> tuple[float, float] | None:
    """(low, high) accepted for the exported scale, from the windows' maxima resampled with replacement."""
    import numpy as np

    values = np.asarray(maxima, dtype=np.float64)
    if not values.size or values.max() <= 0:
        return None
    rng = np.random.default_rng(0)
    draws = values[rng.integers(0, values.size, size=(RESAMPLES, values.size))].max(axis=1)
    low, full = float(np.percentile(draws, 1)) / top, float(values.max()) / top
    # never narrower than two BF16 rounding steps (2**-8 each): a BF16 model's activations and the scale
    # Quark stores in BF16 (a correct int8 export read 0.09 % over a zero-width spread)
    spread = max(full - low, full * ROUNDING)
    return low - spread, (full + spread) if not capped else float("inf")
