"""What the remedies cost: the estimate said before the offer, the pilot's estimate of the rest once the first
variant ran, and the time they took, set beside each other in the report.

Every figure is scaled from a quantization measured on this host: the run's own (before the offer) or the first
variant's (the pilot). A variant changes the plan's algorithm or its calibration samples, and the two touch different
parts of a quantization (execute/quant_split.py: the engine's split of Quark's algorithm and calibration steps, and
the time inside decoder-layer forwards): more samples lengthen only the forwards, a removed algorithm takes its own
work with it, loading, freezing and export stay. Without a split (an engine that said none) the whole step scales
with the samples, as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.base.fsio import read_json
from quark_ptq_eval.evaluate.context import format_duration
from quark_ptq_eval.evaluate.remedies import algorithm_names
from quark_ptq_eval.evaluate.remedy_variants import Variant
from quark_ptq_eval.execute.quant_split import QuantSplit
from quark_ptq_eval.flows.compare.plans import ALGORITHM_PASSES
from quark_ptq_eval.flows.recipe.recipe_flow import IMPORT_SUFFIX

EXECUTE, VALIDATE = "phase1_execute", "phase2_validate"  # the step table's timing names
ENGINE_LOG = Path("logs") / "engine.log"


def variant_plan(v: Variant, ran: Collection[str], samples: int | None) -> tuple[Collection[str], int | None]:
    """The algorithms and calibration samples ``v`` quantizes with: its own where it changes them, else the plan's."""
    algos = ran if v.request.algorithm is None else algorithm_names(v.request.algorithm)
    return algos, v.request.num_calib_samples or samples


def _passes(names: Iterable[str]) -> float:
    return sum(ALGORITHM_PASSES.get(a, 1.0) for a in names)


@dataclass(frozen=True)
class QuantCost:
    """One quantization measured here (its step's seconds, the engine's start-up left out), what it ran, and the
    engine's split of it (None: it said none)."""

    seconds: float
    algorithms: Collection[str]
    samples: int | None
    split: QuantSplit | None = None

    def parts(self) -> tuple[float, float | None, float] | None:
        """(its fixed seconds: loading, freezing, export; its algorithms' own work per pass, besides their forwards
        (None: it ran none); one forward pass over its samples), from the split (None: it has none)."""
        split = self.split
        if split is None:
            return None
        here = _passes(self.algorithms)
        one_pass = split.forwards_s / (1 + here)
        own = max(split.algorithm_s - one_pass * here, 0.0)
        return max(self.seconds - split.forwards_s - own, 0.0), (own / here if here else None), one_pass

    def to(self, target: Collection[str], samples: int | None, own_rate: float | None = None) -> float:
        """The same quantization with ``target``'s algorithms on ``samples`` calibration samples: the fixed part,
        the algorithms' own work by their passes (at this one's rate, else ``own_rate``: measured by another
        quantization that ran one), and one forward pass over the samples per calibration and algorithm pass."""
        more = samples / self.samples if samples and self.samples else 1.0
        parts = self.parts()
        if parts is None:
            return self.seconds * more
        fixed, rate, one_pass = parts
        there = _passes(target)
        return fixed + (rate if rate is not None else own_rate or 0.0) * there + one_pass * (1 + there) * more

    def variant(self, v: Variant, ran: Collection[str], samples: int | None, own_rate: float | None = None) -> float:
        return self.to(*variant_plan(v, ran, samples), own_rate)


def estimate_s(timings: dict[str, float], results: dict[str, Any], variants: list[Variant], cost: QuantCost | None,
               ran: Collection[str], samples: int | None, warm_check_s: float | None = None) -> float | None:
    """What ``variants`` cost, from what this run's own steps took in this process: each variant one quantization
    (``cost``: the run's, its engine's start-up left out, scaled to the variant), one validation and its side of
    Tier 1 (half of the run's, which scored both sides); the baseline's side once, for the comparison's cache. The
    comparison runs its checks in this process, warm: the cold start this run's validation paid (importing torch,
    transformers and quark.torch: measured) is left out, and a validation measured warm here (``warm_check_s``)
    replaces the cold one's figure. None where a step ran in an earlier process (a resumed run)."""
    validate = timings.get(VALIDATE)
    tier1 = (results.get("runtime") or {}).get("actual_s")
    if cost is None or validate is None or not isinstance(tier1, int | float):
        return None
    cold = timings.get(VALIDATE + IMPORT_SUFFIX, 0.0)
    check = max(validate - cold, validate / 10) if warm_check_s is None else warm_check_s
    return tier1 / 2 + sum(cost.variant(v, ran, samples) + check + tier1 / 2 for v in variants)


def run_cost(timings: dict[str, float], workdir: Path, ran: Collection[str], samples: int | None,
             engine_ready_s: float | None) -> QuantCost | None:
    """The run's quantization as measured: its execute step less what a warm in-process engine would not pay (the
    engine child's start-up, from its log's ready line: a fresh child imports, a forked one nothing; else the
    validation's measured imports), and the engine's split (None: the step ran in an earlier process)."""
    execute = timings.get(EXECUTE)
    if execute is None:
        return None
    started = timings.get(VALIDATE + IMPORT_SUFFIX, 0.0) if engine_ready_s is None else engine_ready_s
    return QuantCost(max(execute - started, execute / 10), ran, samples,
                     QuantSplit.read(workdir / ENGINE_LOG))


def _cell_cost(workdir: Path, v: Variant, ran: Collection[str], samples: int | None) -> QuantCost | None:
    """A finished comparison cell's quantization (its run summary's execute step; in-process, so no start-up)."""
    try:
        timings = read_json(workdir / "run_summary.json", "run summary").get("timings_s") or {}
    except QpeError:  # a cell that failed early may have written none
        return None
    execute = timings.get(EXECUTE)
    if not isinstance(execute, int | float):
        return None
    return QuantCost(float(execute), *variant_plan(v, ran, samples), QuantSplit.read(workdir / ENGINE_LOG))


class Pilot:
    """The first variant, timed as it runs in this process, is the pilot of the others: the comparison's engines
    and checks run warm here, which the run's own cold steps (a fresh engine process, a first validation) cannot
    show, so the time the others will take is said from it as soon as it ends (its checks and scoring as they
    took, its quantization scaled to each: where it ran without the plan's algorithm, that algorithm's own work at
    the rate the run measured), and set beside what they took."""

    def __init__(self, variants: list[Variant], ran: Collection[str], samples: int | None, root: Path,
                 say: Callable[[str], None], run: QuantCost | None = None):
        self.variants, self.root, self.say = {v.label: v for v in variants}, root, say
        parts = None if run is None else run.parts()
        self.own_rate = None if parts is None else parts[1]  # the run's algorithm's own work: a pilot without it
        self.ran, self.samples = ran, samples
        self.began = time.monotonic()
        self.first: str | None = None
        self.first_began = self.rest_began = 0.0
        self.pilot_s: float | None = None
        self.rest_estimated_s: float | None = None

    def __call__(self, event: str, label: str) -> None:  # the comparison's progress events
        if event == "started" and self.first is None:
            self.first, self.first_began = label, time.monotonic()
        elif event in ("done", "failed") and label == self.first and self.pilot_s is None:
            self.rest_began = time.monotonic()
            self.pilot_s = self.rest_began - self.first_began
            rest = [v for name, v in self.variants.items() if name != label]
            if rest:
                first = self.variants[label]
                cost = _cell_cost(self.root / "work" / label, first, self.ran, self.samples)
                self.rest_estimated_s = sum(self._cost(cost, v) for v in rest)
                self.say(f"Remedies: {label} took {self.pilot_s:.0f} s here; the other {len(rest)}: about "
                         f"{format_duration(self.rest_estimated_s)}")

    def _cost(self, cost: QuantCost | None, v: Variant) -> float:
        assert self.pilot_s is not None
        if cost is None:  # the pilot said nothing of its steps: each of the others as long as it
            return self.pilot_s
        return self.pilot_s - cost.seconds + cost.variant(v, self.ran, self.samples, self.own_rate)

    def result(self) -> PilotResult | None:
        """The pilot and the rest's estimate beside the rest's time (None: no variant ended, or only one ran)."""
        if self.first is None or self.pilot_s is None or self.rest_estimated_s is None:
            return None
        return PilotResult(self.first, self.pilot_s, self.rest_estimated_s, time.monotonic() - self.rest_began)


@dataclass(frozen=True)
class PilotResult:
    """The first variant's time, and the others' estimate from it beside the time they took."""

    variant: str
    seconds: float
    rest_estimated_s: float
    rest_actual_s: float

    def as_json(self) -> dict[str, object]:
        ratio = round(self.rest_estimated_s / self.rest_actual_s, 3) if self.rest_actual_s else None
        return {"variant": self.variant, "seconds": round(self.seconds, 1),
                "rest_estimated_s": round(self.rest_estimated_s, 1), "rest_actual_s": round(self.rest_actual_s, 1),
                "rest_estimated_over_actual": ratio}


@dataclass(frozen=True)
class Runtime:
    """The remedies' estimate before they ran, the time they took (quantize, validate, score: all of them), and the
    pilot's estimate of the variants after the first beside their time."""

    estimated_s: float | None
    actual_s: float
    piloted: PilotResult | None = None

    @property
    def ratio(self) -> float | None:
        return None if self.estimated_s is None or not self.actual_s else self.estimated_s / self.actual_s

    def said(self) -> str:
        against = "" if self.ratio is None else (f" against the {self.estimated_s:.0f} s estimated "
                                                  f"(estimate/actual {self.ratio:.2f})")
        p = None if self.piloted is None else self.piloted.as_json()
        after = "" if p is None else (f"; after the first ({p['variant']}, {p['seconds']:.0f} s), the others: "
                                      f"{p['rest_estimated_s']:.0f} s estimated, {p['rest_actual_s']:.0f} s taken "
                                      f"(estimate/actual {p['rest_estimated_over_actual']:.2f})")
        return f"measured in {self.actual_s:.0f} s{against}{after}"

    def as_json(self) -> dict[str, Any]:
        return {"estimated_s": self.estimated_s, "actual_s": round(self.actual_s, 1), "estimated_over_actual": self.ratio,
                "pilot": None if self.piloted is None else self.piloted.as_json()}
