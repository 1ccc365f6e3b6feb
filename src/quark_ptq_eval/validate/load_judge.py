"""The load check's verdict on the replayed units: the loader against the export, the export against the source.

Where a unit is emulated (emulate.py), two distances are measured on the source's own input:

- **loader error**: the loaded module's output against what the export says it computes. Only the
  loader can move it: a scale misread, a transposed or shuffled weight, weights left at random. It is
  held to ``ROUNDING_LIMIT``, floating-point rounding: float32 against float32 agrees to ~1e-6; a
  BF16 model rounds its inputs, weights and outputs (2**-8 each) and may move an activation across a
  rounding boundary, ~1 % at most on the tiny models' int8/fp8/mx exports (bench/benchmarks/bench_load_check.py),
  where faults read 50 % to 300 %.
- **quantization error**: the emulation against the source. The scheme's error, not a fault: it
  never fails the check; it is reported per module, the worst first, with what makes it so (the
  input's largest channel against its median under per-tensor activations; the weights alone) and
  the remedies worth measuring. Phase 3 measures what it costs the model.

A unit the emulation does not cover (a format or spec not emulated, experts held under other names,
a composite module: only single linears and embeddings are held to the emulation) is judged as before: its error against the source within its scheme's measured limit (loadlimits.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.validate.replay import unit_error
from quark_ptq_eval.validate.report import Finding

if TYPE_CHECKING:
    import torch

    from quark_ptq_eval.validate.emulate import EmulatedOutputs
    from quark_ptq_eval.validate.folds import ReplayUnit
    from quark_ptq_eval.validate.quantizers import ActivationQuantizer
    from quark_ptq_eval.validate.replay import Capture
    from quark_ptq_eval.validate.report import CheckResult

ROUNDING_LIMIT = 0.03  # loader against emulation: BF16 rounding <= ~1 % measured; faults >= 50 %
BOUNDARY_ROUNDING = 2.0 ** -7  # two BF16 rounding steps: how far the loader's unrounded output may be off
OUTLIER_RATIO = 8.0  # an input channel this many times its median channel's absmax is an outlier
MAX_LISTED = 5
QUANT_LISTED = 10  # modules listed with their quantization error in the report


@dataclass
class QuantError:
    """One module's quantization error: the emulated export against the source, on the probe."""

    module: str
    error: float  # relative output error, activations and weights quantized as exported
    weights_only: float  # the same with the activations left unquantized
    cause: str
    input_outlier_ratio: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {"module": self.module, "error": _round(self.error), "weights_only": _round(self.weights_only),
                "cause": self.cause, "input_outlier_ratio": _round(self.input_outlier_ratio),
                "input_outlier": self.input_outlier}

    @property
    def input_outlier(self) -> bool:
        """The error traced to an input channel far above its median under per-tensor activations."""
        ratio = self.input_outlier_ratio
        return ratio is not None and ratio >= OUTLIER_RATIO and "per_tensor" in self.cause


@dataclass
class Judged:
    loader: dict[str, float] = field(default_factory=dict)  # emulated units: loader against emulation
    fallback: dict[str, float] = field(default_factory=dict)  # the others: against the source
    quantization: list[QuantError] = field(default_factory=list)
    note: str = ""

    def report(self, owners: int, loader: str, result: CheckResult, limit_why: tuple[float, str]) -> None:
        replayed = len(self.loader) + len(self.fallback)
        result.stats.update(modules_replayed=replayed, modules_emulated=len(self.loader))
        if self.note:
            result.notes.append(self.note)
        if not replayed:
            result.notes.append(f"no module of the {owners} holding weights could be replayed on the export: "
                                "greedy agreement judges alone")
            return
        self._report_loader(loader, result)
        self._report_fallback(loader, result, limit_why)
        self._report_quantization(result)

    def _report_loader(self, loader: str, result: CheckResult) -> None:
        if not self.loader:
            return
        worst = max(self.loader, key=self.loader.__getitem__)
        finite = math.isfinite(self.loader[worst])
        result.stats.update(max_loader_error=round(self.loader[worst], 6) if finite else None,
                            worst_loader_module=worst, loader_error_limit=ROUNDING_LIMIT)
        result.notes.append(f"{len(self.loader)} modules replayed on the source's inputs and held to what the "
                            f"export says they compute (decoded weights, activations quantized as exported): "
                            f"largest difference {self.loader[worst]:.2%} ({worst}; limit {ROUNDING_LIMIT:.0%}, "
                            "floating-point rounding)")
        for name in _over(self.loader, ROUNDING_LIMIT)[:MAX_LISTED]:
            result.findings.append(Finding(
                name, f"gives outputs {self.loader[name]:.0%} away from what the export says this module computes "
                f"(its weights decoded from the file, its activations quantized as exported), over the "
                f"{ROUNDING_LIMIT:.0%} rounding limit: the loader does not read this module as exported.",
                side="quark", evidence=f"expected: loader = emulated export within {ROUNDING_LIMIT}; found "
                                       f"{self.loader[name]:.3g} (loader {loader})"))

    def _report_fallback(self, loader: str, result: CheckResult, limit_why: tuple[float, str]) -> None:
        if not self.fallback:
            return
        limit, why = limit_why
        worst = max(self.fallback, key=self.fallback.__getitem__)
        finite = math.isfinite(self.fallback[worst])
        result.stats.update(max_module_error=round(self.fallback[worst], 4) if finite else None,
                            worst_module=worst, module_error_limit=limit, module_error_limit_from=why)
        result.notes.append(f"{len(self.fallback)} modules not emulated, held to the source: largest relative "
                            f"output error {self.fallback[worst]:.1%} ({worst}; limit {limit:.0%}: {why})")
        over = _over(self.fallback, limit)
        for name in over[:MAX_LISTED]:
            result.findings.append(Finding(
                name, f"gives outputs {self.fallback[name]:.0%} away from the source module's on the same input, "
                f"over the {limit:.0%} limit: the loader does not read this module as exported.", side="quark",
                evidence=f"expected: relative error <= {limit} ({why}); found {self.fallback[name]:.3g} "
                         f"(loader {loader})"))
        if len(over) > MAX_LISTED:
            result.notes.append(f"{len(over) - MAX_LISTED} more modules over the limit")

    def _report_quantization(self, result: CheckResult) -> None:
        if not self.quantization:
            return
        ranked = sorted(self.quantization, key=lambda q: -q.error if math.isfinite(q.error) else -math.inf)
        result.stats["quantization_error"] = [q.as_json() for q in ranked[:QUANT_LISTED]]
        result.stats["max_quantization_error"] = _round(ranked[0].error)
        worst = ranked[0]
        result.notes.append(f"quantization error (the export emulated against the source, evidence for Phase 3, "
                            f"never a failure): largest {worst.error:.1%} at {worst.module} ({worst.cause}; "
                            f"weights alone {worst.weights_only:.1%})")
        result.for_evaluation.append(
            f"Validation measured the export's quantization error per module: largest {worst.error:.1%} at "
            f"{worst.module} ({worst.cause}; weights alone {worst.weights_only:.1%}); Tier 1 with a baseline "
            "measures what it costs the model.")
        if (remedy := remedy_for(worst)) is not None:
            result.notes.append(remedy)
            result.for_evaluation.append(remedy)


def judge_units(outputs: dict[ReplayUnit, torch.Tensor], captures: dict[str, Capture],
                emulated: EmulatedOutputs) -> Judged:
    from quark_ptq_eval.validate.emulate import unit_key

    judged = Judged(note=emulated.note)
    for unit, got in outputs.items():
        cap = captures[unit.key]
        if not emulated.covers(unit):  # a composite (emulate._candidates), or a weight not decoded
            if not _as_exported(judged, unit, got, cap, emulated):
                judged.fallback[unit.key] = unit_error(unit, got, cap.output, cap)
            continue
        emu = emulated.outputs[unit_key(unit)]
        before = emulated.before_output.get(unit_key(unit))
        if before is not None:
            got = across_boundaries(got, emu, before, emulated.emulation.output[unit.module])
        judged.loader[unit.key] = unit_error(unit, got, emu, cap)
        if unit.module not in emulated.emulation.quantized or unit.alone:
            continue  # an unquantized module (lm_head, embeddings), a unit holding several, a folded linear alone
        only = emulated.weights_only.get(unit_key(unit), emu)
        error, weights = unit_error(unit, emu, cap.output, cap), unit_error(unit, only, cap.output, cap)
        judged.quantization.append(_explain(unit.key, error, weights, cap, emulated))
    return judged


def _as_exported(judged: Judged, unit: ReplayUnit, got: torch.Tensor, cap: Capture,
                 emulated: EmulatedOutputs) -> bool:
    """A composite fold unit the loader computes as the export's files do: judged as an emulated unit.

    A composite is held to the source (the emulation may not compute all it does), within its format's
    limit. But a scheme can take one far from the source by itself: SmoothQuant under a per-tensor int8
    weight scale rounds rows of an MLP's up_proj to nothing (decode_damage.py), and its MLP reads 47-100 %
    from the source in a faithful export. The emulation, computed from the export's files without the
    loader, tells the two apart: where the loader agrees with it within floating-point rounding, the
    loader reads the unit as exported, and its distance from the source is the export's own (the
    quantization error, reported, evidence for Phase 3); where it does not, the composite is held to the
    source as before, and a loader fault fails named. Only the files' own faults could fool it, and the
    decode check, which runs first, holds them to the source."""
    key = (unit.key, unit.module, unit.norm)
    emu = emulated.composite.get(key)
    if emu is None or any(name == unit.module or name.startswith(unit.module + ".")
                          for name in emulated.emulation.skipped):
        return False
    loader = unit_error(unit, got, emu, cap)
    if not loader <= ROUNDING_LIMIT:
        return False
    judged.loader[unit.key] = loader
    error = unit_error(unit, emu, cap.output, cap)
    weights = unit_error(unit, emulated.composite_weights_only.get(key, emu), cap.output, cap)
    what = "weight rounding" if weights >= 0.5 * error else "activation rounding"
    judged.quantization.append(QuantError(unit.key, error, weights, f"mostly {what} in a unit holding folded "
                                          "scales, the loader agreeing with the export's files", _outlier_ratio(cap)))
    return True


def across_boundaries(got: torch.Tensor, emu: torch.Tensor, before: torch.Tensor,
                      quantizer: ActivationQuantizer) -> torch.Tensor:
    """The loader's output with every value that rounding alone explains set to the emulation's.

    An output quantizer (a KV cache's) rounds the matmul's result to a grid. The loader computes that
    result in its own precision and order (BF16: ~2**-8 off), so a value within that of a boundary
    between two grid points lands on the other one: one grid step, 6-12 % of the value on fp8's, on ~3 %
    of the values, ~3 % of the output. Such a value is not a misread: it is on the grid, and no farther
    from the unrounded result than the emulation's choice plus rounding. A misread scale or weight puts
    values off the grid or far from the result, and stays counted."""
    import torch

    if got.shape != emu.shape:
        return got  # unit_error names the shape
    got32 = got.float()
    # a matmul's rounding is relative to its terms, not its result: a value that cancels to near zero is
    # off by ~2**-8 of the output's typical size, not its own
    typical = float(before.float().pow(2).mean().sqrt())
    slack = BOUNDARY_ROUNDING * (before.abs() + typical) + torch.finfo(torch.float32).eps * float(before.abs().amax())
    on_grid = (quantizer(got32) - got32).abs() <= BOUNDARY_ROUNDING * got32.abs() + slack
    nearest = (got32 - before).abs() <= (emu - before).abs() + slack
    return torch.where(on_grid & nearest, emu, got32)


def _explain(module: str, error: float, weights: float, cap: Capture, emulated: EmulatedOutputs) -> QuantError:
    """What makes a module's quantization error: its input's outlier channels under per-tensor activations,
    the activations otherwise, or the weights."""
    quantizer = emulated.emulation.activation.get(module)
    ratio = _outlier_ratio(cap)
    if quantizer is None:
        return QuantError(module, error, weights, "weight rounding (weight-only scheme)", ratio)
    acts = f"{'dynamic' if quantizer.dynamic else 'static'} {quantizer.qscheme} {quantizer.dtype} activations"
    if weights >= 0.5 * error:
        return QuantError(module, error, weights, f"mostly weight rounding; {acts}", ratio)
    if ratio is not None and ratio >= OUTLIER_RATIO and quantizer.qscheme == "per_tensor":
        return QuantError(module, error, weights, f"input absmax {ratio:.0f}x its median channel: {acts}", ratio)
    return QuantError(module, error, weights, acts, ratio)


def remedy_for(q: QuantError) -> str | None:
    """The remedies worth measuring for the worst module: hypotheses, with where to measure them."""
    if q.input_outlier_ratio is None or q.input_outlier_ratio < OUTLIER_RATIO or "per_tensor" not in q.cause:
        return None
    return (f"{q.module}'s input has a channel {q.input_outlier_ratio:.0f}x its median: worth measuring (each is "
            "a hypothesis until measured; SmoothQuant under a per-tensor weight scale can round rows of small "
            "weights to zero and hurt more than it heals): SmoothQuant (--algorithm smoothquant), per-token or "
            "wider activations (fp8), or keeping this module's group out of quantization; Tier 1 (--eval-tier "
            "ppl --baseline) or `compare --schemes` measures each.")


def _outlier_ratio(cap: Capture) -> float | None:
    """The input's largest channel absmax over its median channel's (the last axis is the channel)."""
    import torch

    x = next((a for a in cap.args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    if x is None or x.ndim < 2 or x.shape[-1] < 2:
        return None
    per_channel = x.float().abs().reshape(-1, x.shape[-1]).amax(dim=0)
    median = float(per_channel.median())
    return float(per_channel.max()) / median if median > 0 else None


def _over(errors: dict[str, float], limit: float) -> list[str]:
    return sorted((n for n, e in errors.items() if e > limit), key=errors.__getitem__, reverse=True)


def _round(value: float | None) -> float | None:
    return round(value, 4) if value is not None and math.isfinite(value) else None

