"""What a run was asked to do: ``RunOptions``, typed, and the one way the CLI and the Python API build it.

The plan request and the evaluation options are the per-concern dataclasses themselves
(``PlanRequest``, ``EvalOptions``). run_state.json stores only the fields the user gave (``request_given``,
``eval_given``), so a resume takes anything not given now from the stored run (``merged_over``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from quark_ptq_eval.base.options import build, check_names, flag
from quark_ptq_eval.evaluate.options import EvalOptions
from quark_ptq_eval.plan.request import PlanRequest
from quark_ptq_eval.publish import BASE_MODEL_HELP, CARD_CHOICES, check_base_model
from quark_ptq_eval.validate.load_sample import LOAD_MINUTES_HELP

OptionsT = TypeVar("OptionsT", PlanRequest, EvalOptions)
COMPOSED = ("model", "output_dir", "request", "eval", "request_given", "eval_given")  # built by run_options, not keywords
RENAMED = {"plan": "request"}  # run_state.json keys of earlier versions -> today's (a resume reads both)


@dataclass
class RunOptions:
    """Everything a run was asked to do; persisted in run_state.json so `resume` needs no flags.

    ``request`` and ``eval`` also accept a dict of the fields given (as run_state.json holds them)."""

    model: str | None = None
    output_dir: str | None = None
    request: PlanRequest = field(default_factory=PlanRequest)
    overwrite: bool = False
    eval: EvalOptions = field(default_factory=EvalOptions)
    offline: bool | None = None
    execution_mode: str | None = None
    contexts: dict[str, str | None] = field(default_factory=dict)
    no_load_check: bool = field(default=False, metadata=flag(  # False: "not given", like the others
        "--no-load-check", action="store_true",
        help="validation skips loading the export and running a probe through it (models too large for this "
             "host); the report says it was skipped"))
    load_check_minutes: float | None = field(default=None, metadata=flag(
        "--load-check-minutes", type=float, metavar="MINUTES", help=LOAD_MINUTES_HELP))
    card: str | None = field(default=None, metadata=flag(
        "--card", choices=CARD_CHOICES, help="the export's model card (README.md) at the end of the run: write "
                                             "(default) or none (no card, and no README.md of the base model)"))
    base_model: str | None = field(default=None, metadata=flag(
        "--base-model", metavar="ORG/NAME", help=BASE_MODEL_HELP))
    request_given: tuple[str, ...] = ()  # the PlanRequest fields the user gave (what run_state.json keeps)
    eval_given: tuple[str, ...] = ()  # the EvalOptions fields the user gave

    def __post_init__(self) -> None:
        given_request: Any = self.request  # a dict from a caller or the state file, or the dataclass itself
        given_eval: Any = self.eval
        self.request, self.request_given = _typed(PlanRequest, given_request, self.request_given)
        self.eval, self.eval_given = _typed(EvalOptions, given_eval, self.eval_given)
        check_base_model(self.base_model)  # refused before any work, not at the card, the run's last step

    @property
    def eval_tier(self) -> str | None:
        """The evaluation tier asked for (``eval.tier`` where given; None: the evaluation checkpoint asks)."""
        return self.eval.tier if "tier" in self.eval_given else None

    def to_state(self) -> dict[str, Any]:
        """These options as run_state.json holds them: the plan and evaluation fields given, as JSON."""
        stored = {k: v for k, v in vars(self).items() if k not in COMPOSED[-2:]}  # the fields, in order
        return {**stored, "contexts": dict(self.contexts), "request": _given_json(self.request, self.request_given),
                "eval": _given_json(self.eval, self.eval_given)}

    @classmethod
    def from_given(cls, request: dict[str, Any] | None = None, eval: dict[str, Any] | None = None,  # noqa: A002
                   **fields: Any) -> RunOptions:
        """RunOptions from the plan request and evaluation fields given (None: not given) and its own fields."""
        typed_request, request_names = _typed(PlanRequest, request or {}, ())
        typed_eval, eval_names = _typed(EvalOptions, eval or {}, ())
        return cls(request=typed_request, eval=typed_eval, request_given=request_names, eval_given=eval_names,
                   **fields)

    @classmethod
    def from_state(cls, stored: dict[str, Any]) -> RunOptions:
        """RunOptions as run_state.json holds them (a key this version does not know is left out)."""
        names = {f.name for f in dataclasses.fields(cls)} - set(COMPOSED[-2:])
        return cls.from_given(**{k: v for k, v in _current_keys(stored).items() if k in names})

    def merged_over(self, stored: dict[str, Any]) -> RunOptions:
        """These options, with anything not given now taken from a stored earlier run."""
        merged = _current_keys(stored)
        for k, v in self.to_state().items():
            if isinstance(v, dict):
                merged[k] = {**(merged.get(k) or {}), **{kk: vv for kk, vv in v.items() if vv is not None}}
            elif v not in (None, False):
                merged[k] = v
        return RunOptions.from_state(merged)


def _current_keys(stored: dict[str, Any]) -> dict[str, Any]:
    """``stored`` with the keys an earlier version wrote under another name renamed (``RENAMED``), and its own
    ``eval_tier`` (the tier was held twice) as the evaluation options' ``tier``."""
    renamed = {RENAMED[k]: v for k, v in stored.items() if k in RENAMED}
    current = {**renamed, **{k: v for k, v in stored.items() if k not in RENAMED}}  # today's key wins
    return _tier_in_eval(current)


def _tier_in_eval(options: Mapping[str, Any]) -> dict[str, Any]:
    """``eval_tier`` given beside the evaluation options (the CLI's and the API's keyword, an earlier
    run_state.json) moved into them as ``tier``: one field holds the tier."""
    moved = dict(options)
    tier = moved.pop("eval_tier", None)
    if tier is not None:
        moved["eval"] = {"tier": tier, **(moved.get("eval") or {})}
    return moved


def _typed(cls: type[OptionsT], given: OptionsT | dict[str, Any], names: tuple[str, ...]) -> tuple[OptionsT, tuple[str, ...]]:
    """``cls`` and the names of its fields given: from a dict of given fields (None: not given), or
    from a ``cls`` (its ``names``, else the fields that differ from the defaults)."""
    if isinstance(given, cls):
        if not names:
            default = vars(cls())
            names = tuple(k for k, v in vars(given).items() if v != default[k])
        return given, names
    assert isinstance(given, dict), f"{cls.__name__} or a dict of its fields, not {type(given).__name__}"
    known = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in given.items() if k in known and v is not None}
    return build(cls, values), tuple(values)


def _given_json(options: PlanRequest | EvalOptions, names: tuple[str, ...]) -> dict[str, Any]:
    """The given fields' values as JSON holds them: paths as strings, a nested dataclass as a dict."""
    def plain(value: Any) -> Any:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value

    values = vars(options)
    return {name: plain(values[name]) for name in names}


def run_options(model: str | Path | None, output_dir: str | Path | None, options: Mapping[str, object]) -> RunOptions:
    """RunOptions from ``run``'s keywords, the one way the CLI and the Python API build them: each keyword
    goes to the dataclass that declares it (``eval_options``: a dict of EvalOptions fields, every keyword
    that is no RunOptions field: a PlanRequest field); an unknown name is refused."""
    own = {f.name for f in dataclasses.fields(RunOptions)} - set(COMPOSED)
    run_given = {k: v for k, v in options.items() if k in own}
    eval_given = _tier_in_eval({"eval_tier": options.get("eval_tier"),  # run's --eval-tier, the API's eval_tier=
                                "eval": options.get("eval_options") or {}}).get("eval") or {}
    request_given = {k: v for k, v in options.items() if k not in own and k not in ("eval_options", "eval_tier")}
    check_names(PlanRequest, request_given, "plan")
    check_names(EvalOptions, eval_given, "evaluation")
    return RunOptions.from_given(request_given, eval_given, model=str(model) if model else None,
                                 output_dir=str(output_dir) if output_dir else None, **run_given)
