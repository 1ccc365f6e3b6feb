"""Where a quantization's time went, said by the engine in its log and read back by the remedies' estimate.

A remedy variant changes one thing about the run's plan, and what that costs depends on which part of the
quantization it touches: more calibration samples lengthen only the passes the samples go through (the decoder
layers' forwards: calibration, and an algorithm's per-layer passes), not loading, the algorithm's own fixed work
(SmoothQuant's scale folding, GPTQ's solves) or freezing and export; removing the algorithm removes its step. On a
tiny model the fixed part is nearly all of it (int8 + SmoothQuant on an 8-block Qwen2: 9.3 s, of which the 64-sample
variant added 0.7 s and the variant without SmoothQuant took 0.8 s), on an 8 B model the forwards are; scaling the
whole step by the samples, as the estimate did, was off by 2x on the former. So the engine times Quark's two steps
(its algorithm, its calibration) and the time spent inside decoder-layer forwards, and prints one line.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPLIT_LINE = "[quark-ptq-eval] quantization split: "
_FIELDS = re.compile(r"algorithm (?P<algorithm>[\d.]+) s, calibration (?P<calibration>[\d.]+) s, "
                     r"decoder forwards (?P<forwards>[\d.]+) s over (?P<samples>\d+) samples")
STEPS = {"algorithm": "_apply_advanced_quant_algo", "calibration": "_do_calibration"}  # Quark 0.13's ModelQuantizer


@dataclass(frozen=True)
class QuantSplit:
    """Seconds of one quantization: Quark's algorithm step, its calibration step, and the time inside decoder-layer
    forwards during both (what scales with the calibration samples)."""

    algorithm_s: float
    calibration_s: float
    forwards_s: float
    samples: int

    def line(self) -> str:
        return (f"{SPLIT_LINE}algorithm {self.algorithm_s:.2f} s, calibration {self.calibration_s:.2f} s, "
                f"decoder forwards {self.forwards_s:.2f} s over {self.samples} samples")

    @classmethod
    def read(cls, log: Path) -> QuantSplit | None:
        """The last split an engine's log says (None: no log, or an engine that said none)."""
        try:
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith(SPLIT_LINE)]
        except OSError:
            return None
        found = _FIELDS.search(lines[-1]) if lines else None
        if found is None:
            return None
        return cls(float(found["algorithm"]), float(found["calibration"]), float(found["forwards"]),
                   int(found["samples"]))


def _decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers: the longest ModuleList of its modules (empty where it has none)."""
    import torch

    lists: list[list[Any]] = [list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len, default=[])


@contextlib.contextmanager
def measured(quantizer: Any, model: Any, samples: int) -> Iterator[None]:
    """Time ``quantizer.quantize_model(model, ...)`` inside this block and print its split. Only the instance's
    step methods are wrapped and only timing hooks added (no tensor is touched); a Quark without those steps gets
    no split line, and the estimate falls back to scaling the whole step."""
    spent = dict.fromkeys(("algorithm", "calibration", "forwards"), 0.0)
    wrapped = [name for name in STEPS.values() if callable(getattr(quantizer, name, None))]

    def timed(key: str, step: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - began
        return run

    for key, name in STEPS.items():
        if name in wrapped:
            setattr(quantizer, name, timed(key, getattr(quantizer, name)))
    began: list[float] = []
    hooks = [h for layer in _decoder_layers(model) for h in (
        layer.register_forward_pre_hook(lambda *_: began.append(time.perf_counter())),
        layer.register_forward_hook(lambda *_: spent.__setitem__(
            "forwards", spent["forwards"] + time.perf_counter() - began.pop()) if began else None))]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for name in wrapped:
            delattr(quantizer, name)  # the class's method again
    if len(wrapped) == len(STEPS):
        print(QuantSplit(spent["algorithm"], spent["calibration"], spent["forwards"], samples).line(), flush=True)
