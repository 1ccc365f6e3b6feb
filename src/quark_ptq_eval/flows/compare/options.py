"""What a comparison is asked to do; persisted in the compare work dir so a re-run needs no flags."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.evaluate.baseline_cache import DEFAULT_TOP_K

DEFAULT_MAX_PPL_INCREASE_PCT = 2.0  # the healthy threshold of a single run's verdict


@dataclass
class CompareOptions:
    model: str | None = None
    schemes: list[str] = field(default_factory=list)
    out_root: str | None = None
    plan: dict[str, Any] = field(default_factory=dict)  # PlanRequest fields shared by every scheme
    eval_data: str | None = None  # None: wikitext-2 test through `datasets`
    eval_text_limit: int | None = None
    seq_len: int = 2048
    max_windows: int | None = None
    batch_size: int | None = None
    device: str = "auto"
    top_k: int = DEFAULT_TOP_K
    max_kl: float | None = None
    max_ppl_increase_pct: float | None = None
    tasks: list[str] = field(default_factory=list)  # Tier 2: lm-eval tasks scored per scheme (none: Tier 1 only)
    include_path: str | None = None  # directory of local lm-eval task YAMLs
    limit: float | None = None  # lm-eval documents per task (a fraction below 1)
    num_fewshot: int | None = None
    max_task_drop_pct: float | None = None  # budget: largest drop of any task metric, percent of the baseline's
    offline: bool | None = None
    overwrite: bool = False

    def merged_over(self, stored: dict[str, Any]) -> CompareOptions:
        """These options, with anything left at its default taken from a stored earlier comparison."""
        defaults = CompareOptions()
        merged = {**stored}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
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
            raise UsageError("No schemes to compare.", "Pass --schemes, e.g. --schemes fp8,int8,int4_wo_128,mxfp4.")
        if len(set(self.schemes)) != len(self.schemes):
            raise UsageError(f"A scheme is listed twice in --schemes {','.join(self.schemes)}.")
        if self.top_k < 1:
            raise UsageError(f"--top-k must be a positive integer, not {self.top_k}.")
        for name, value in (("--max-kl", self.max_kl), ("--max-ppl-increase-pct", self.max_ppl_increase_pct),
                            ("--max-task-drop-pct", self.max_task_drop_pct), ("--limit", self.limit)):
            if value is not None and value < 0:
                raise UsageError(f"{name} must not be negative, not {value}.")
        if self.max_task_drop_pct is not None and not self.tasks:
            raise UsageError("--max-task-drop-pct needs task scores.", "Pass --tasks (lm-eval task names) too.")
        if self.include_path and not Path(self.include_path).is_dir():
            raise UsageError(f"--include-path {self.include_path} is not a directory of lm-eval task YAMLs.")

    @property
    def budget(self) -> dict[str, float]:
        """The accuracy budget a recommendation must fit: the given limits, else the healthy threshold."""
        given = (("max_kl", self.max_kl), ("max_ppl_increase_pct", self.max_ppl_increase_pct),
                 ("max_task_drop_pct", self.max_task_drop_pct))
        if all(v is None for _, v in given):
            return {"max_ppl_increase_pct": DEFAULT_MAX_PPL_INCREASE_PCT}
        return {k: v for k, v in given if v is not None}


def scheme_label(scheme: str) -> str:
    """A scheme's directory name: the scheme, made safe for a path."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", scheme)
