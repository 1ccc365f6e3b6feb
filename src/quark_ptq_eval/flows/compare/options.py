"""What a comparison is asked to do; persisted in the compare work dir so a re-run needs no flags.

Composed from the per-concern dataclasses, as the recipe's own options are: every scheme's plan takes
the ``PlanRequest`` options but those that settle one plan's scheme (``PLAN``), the evaluation is an
``EvalOptions`` of the Tier 1 window / compute and the Tier 2 task options (``TIER1``, ``TASKS``), and
only what is the comparison's own (its baseline cache, its accuracy budget) is declared here. The
command's flags and the Python API's keywords both come from these parts: no list of option names.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.options import OFFLINE_HELP, Part, build, concern, flag, json_values
from quark_ptq_eval.evaluate.options import DEFAULT_SEQ_LEN, SERVING, EvalOptions
from quark_ptq_eval.evaluate.ppl.baseline_cache import DEFAULT_TOP_K
from quark_ptq_eval.evaluate.speed.workload import WITH_TIER3, SpeedOptions
from quark_ptq_eval.plan.request import CHOICE, SEARCH_FIELDS, PlanChange, PlanRequest
from quark_ptq_eval.publish import BASE_MODEL_HELP, check_base_model
from quark_ptq_eval.runtime.vllm_host import vllm_python

DEFAULT_MAX_PPL_INCREASE_PCT = 2.0  # the healthy threshold of a single run's verdict
BUDGET, CACHE, CARD, RUN = "budget", "cache", "card", "run"  # the concerns of the comparison's own options
MEASURE = "measure"  # --speed: serving speed measured beside accuracy
RAY_HELP = ("run {what} as a Ray task on the cluster at ADDRESS (default auto: the one `ray start` brought up; "
            "local: start one on this host; write --ray=ADDRESS before a positional argument); needs the [ray] extra")
NOT_STORED = ("ray",)


@dataclass(frozen=True)
class MixCell:
    """One compared plan given as a mix: the global scheme and the per-pattern overrides."""

    scheme: str
    layer_quant_config: dict[str, str] = field(default_factory=dict)
    # other plan options this cell sets over the shared ones (a remedy: its algorithm, exclusions, calibration size)
    request: PlanChange = field(default_factory=PlanChange)

    def __post_init__(self) -> None:  # a stored comparison's state holds the change as JSON
        object.__setattr__(self, "request", PlanChange.of(self.request))


@dataclass
class CompareOptions:
    model: str | None = None
    schemes: list[str] = field(default_factory=list)
    out_root: str | None = None
    plan: dict[str, Any] = field(default_factory=dict)  # PLAN's PlanRequest fields given, shared by every scheme
    eval: EvalOptions = field(default_factory=EvalOptions)  # TIER1 and TASKS (a dict when read from the state)
    top_k: int = field(default=DEFAULT_TOP_K, metadata=flag(
        "--top-k", type=int, help="baseline log-probabilities kept per token in the cache (default 64)") | concern(CACHE))
    max_kl: float | None = field(default=None, metadata=flag(
        "--max-kl", type=float, help="largest acceptable mean KL(baseline || scheme)") | concern(BUDGET))
    max_ppl_increase_pct: float | None = field(default=None, metadata=flag(
        "--max-ppl-increase-pct", type=float,
        help="largest acceptable perplexity increase in percent (default 2 when no budget is given)") | concern(BUDGET))
    max_task_drop_pct: float | None = field(default=None, metadata=flag(  # percent of the baseline's score
        "--max-task-drop-pct", type=float,
        help="largest acceptable drop of any task metric, in percent of the baseline's (needs --tasks)")
        | concern(BUDGET))
    # every usable cell and the baseline served once each and measured with vLLM's own serving benchmark
    speed: bool = field(default=False, metadata=flag(
        "--speed", action="store_true",
        help="also measure each scheme's and the baseline's serving speed, once each, with vLLM's own serving "
             "benchmark (the speed tier; needs --vllm-python): throughput and TPOT columns, an accuracy x "
             "throughput chart, and `speed first` goals pick the fastest scheme within the budget") | concern(MEASURE))
    # the chosen scheme's card names it (stored: a re-run of the comparison keeps it)
    base_model: str | None = field(default=None, metadata=flag(
        "--base-model", metavar="ORG/NAME", help=BASE_MODEL_HELP) | concern(CARD))
    overwrite: bool = field(default=False, metadata=flag("--overwrite", action="store_true") | concern(RUN))
    offline: bool | None = field(default=None, metadata=flag(
        "--offline", action="store_true", help=OFFLINE_HELP) | concern(RUN))
    # Where this call runs, not what the comparison is: never stored, so a resume runs where it is told to.
    ray: str | None = field(default=None, metadata=flag(
        "--ray", nargs="?", const="auto", metavar="ADDRESS", help=RAY_HELP.format(what="each scheme")) | concern(RUN))
    # A cell that is a mix rather than one scheme: label (in ``schemes``) -> its plan's global scheme and
    # overrides (the budget search's side by side, flows/recipe/budget_side.py); no flag, stored with the comparison.
    cells: dict[str, MixCell] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cells = {k: v if isinstance(v, MixCell) else MixCell(**v) for k, v in self.cells.items()}
        if isinstance(self.eval, dict):
            self.eval = build(EvalOptions, self.eval)
        if self.eval.seq_len is None:
            self.eval.seq_len = DEFAULT_SEQ_LEN  # one window for every scheme and the baseline's cache

    def to_state(self) -> dict[str, Any]:
        """These options as the state file holds them (JSON: absolute paths)."""
        stored = {k: v for k, v in dataclasses.asdict(self).items() if k not in NOT_STORED}
        return {**stored, "eval": json_values(dataclasses.asdict(self.eval))}

    def merged_over(self, stored: dict[str, Any]) -> CompareOptions:
        """These options, with anything left at its default taken from a stored earlier comparison."""
        defaults = CompareOptions()
        merged = {**stored}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "eval":
                now, default = json_values(dataclasses.asdict(value)), json_values(dataclasses.asdict(defaults.eval))
                merged["eval"] = {**(stored.get("eval") or {}), **{k: v for k, v in now.items() if v != default[k]}}
            elif isinstance(value, dict):
                merged[f.name] = {**(stored.get(f.name) or {}), **{k: v for k, v in value.items() if v is not None}}
            elif value != getattr(defaults, f.name) or f.name not in stored:
                merged[f.name] = value
        names = {f.name for f in dataclasses.fields(CompareOptions)}
        return CompareOptions(**{k: v for k, v in merged.items() if k in names})

    def check(self) -> None:
        if not self.model:
            raise UsageError("No model given and no earlier comparison in this output root.",
                             "Run `quark-ptq-eval compare MODEL --schemes A,B -o OUT_ROOT` first.")
        if not Path(self.model).expanduser().is_dir():
            raise UsageError(f"compare needs the model as a local directory; {self.model} is not one.",
                             "Download it first (huggingface-cli download) and pass the local directory.")
        if not self.schemes:
            raise UsageError("No schemes to compare.", "Pass --schemes, e.g. --schemes fp8,int8,int4_wo_128,mxfp4, "
                                                       "or a budget (--budget-bits, --budget-size) to compare the "
                                                       "search's plans.")
        if len(set(self.schemes)) != len(self.schemes):
            raise UsageError(f"A scheme is listed twice in --schemes {','.join(self.schemes)}.")
        check_base_model(self.base_model)
        if self.top_k < 1:
            raise UsageError(f"--top-k must be a positive integer, not {self.top_k}.")
        for name, value in (("--max-kl", self.max_kl), ("--max-ppl-increase-pct", self.max_ppl_increase_pct),
                            ("--max-task-drop-pct", self.max_task_drop_pct), ("--limit", self.eval.limit)):
            if value is not None and value < 0:
                raise UsageError(f"{name} must not be negative, not {value}.")
        if self.max_task_drop_pct is not None and not self.eval.tasks:
            raise UsageError("--max-task-drop-pct needs task scores.", "Pass --tasks (lm-eval task names) too.")
        if self.eval.include_path and not Path(self.eval.include_path).is_dir():
            raise UsageError(f"--include-path {self.eval.include_path} is not a directory of lm-eval task YAMLs.")
        if self.speed and vllm_python(self.eval.vllm_python) is None:
            raise UsageError("compare --speed serves each model with a vLLM on this host, and none is found.",
                             "Name its interpreter with --vllm-python, build the checkout's own with "
                             "`make vllm-env`, or leave out --speed.")

    @property
    def budget(self) -> dict[str, float]:
        """The accuracy budget a recommendation must fit: the given limits, else the healthy threshold."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if BUDGET_PART.takes(f)}
        if all(v is None for v in given.values()):
            return {"max_ppl_increase_pct": DEFAULT_MAX_PPL_INCREASE_PCT}
        return {k: v for k, v in given.items() if v is not None}


PLAN = Part(PlanRequest, skip_concerns=(CHOICE,))  # every scheme's plan: all but what settles its scheme
TIER1 = Part(EvalOptions, concerns=("windows", "compute"))  # Tier 1 against the baseline evaluated once
TASKS = Part(EvalOptions, concerns=("tasks",))  # Tier 2: lm-eval per scheme, paired tests against the baseline
SERVING_PART = Part(EvalOptions, concerns=(SERVING,))  # --speed: the vLLM that serves each model
SPEED_WORKLOAD = Part(SpeedOptions, skip_concerns=(WITH_TIER3,))  # --speed: the speed tier's workload, the same for every cell and the baseline
MEASURE_PART = Part(CompareOptions, concerns=(MEASURE,))
CACHE_PART = Part(CompareOptions, concerns=(CACHE,))  # the baseline cache, beside Tier 1's options
BUDGET_PART = Part(CompareOptions, concerns=(BUDGET,))  # the accuracy budget of the recommendation
CARD_PART = Part(CompareOptions, concerns=(CARD,))  # what the chosen scheme's model card states
RUN_PART = Part(CompareOptions, concerns=(RUN,))
PARTS = (PLAN, TIER1, CACHE_PART, TASKS, BUDGET_PART, CARD_PART, RUN_PART, MEASURE_PART, SERVING_PART,
         SPEED_WORKLOAD)


def keywords() -> set[str]:
    """The Python API's option keywords: the flags' dests, as on the command line."""
    return set().union(*(part.dests() for part in PARTS))


def options_from(model: str | Path | None, schemes: list[str] | str | None, out_root: str | Path,
                 given: dict[str, Any]) -> CompareOptions:
    """CompareOptions from the command line's or the Python API's option values (by flag dest)."""
    unknown = set(given) - keywords()
    if unknown:
        raise TypeError(f"compare() got unexpected keyword argument(s): {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(sorted(keywords()))}")
    args = argparse.Namespace(**given)
    if isinstance(schemes, str):
        schemes = [s.strip() for s in schemes.split(",") if s.strip()]
    plan = PLAN.given(args)
    if plan.get("calib_data"):
        plan["calib_data"] = os.path.abspath(os.path.expanduser(plan["calib_data"]))
    if model and Path(model).exists():
        model = Path(model).resolve()  # stored for a resume from another directory
    own = {**CACHE_PART.given(args), **BUDGET_PART.given(args), **CARD_PART.given(args), **RUN_PART.given(args),
           **MEASURE_PART.given(args)}
    evaluation = EvalOptions(**TIER1.given(args), **TASKS.given(args), **SERVING_PART.given(args),
                             tier_options=SPEED_WORKLOAD.given(args))
    return CompareOptions(model=str(model) if model else None, schemes=list(schemes or []), out_root=str(out_root),
                          plan=plan, eval=evaluation, **own)


def cell_request(opts: CompareOptions, label: str) -> dict[str, Any]:
    """The plan request of one compared cell: the shared plan options (less the budget search's: the search ran
    once, flows/compare/budget.py) with its scheme, or its mix."""
    shared = {k: v for k, v in opts.plan.items() if k not in SEARCH_FIELDS}
    cell = opts.cells.get(label)
    if cell is None:
        return {**shared, "scheme": label}
    return {**shared, **cell.request.overrides(), "scheme": cell.scheme, "layer_quant_config": dict(cell.layer_quant_config)}


def budget_asked(opts: CompareOptions) -> bool:
    """A comparison of the budget search's plans (--budget-bits or --budget-size), not of named schemes."""
    return any(opts.plan.get(k) is not None for k in SEARCH_FIELDS[:2])


def scheme_label(scheme: str) -> str:
    """A scheme's directory name: the scheme, made safe for a path."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", scheme)
