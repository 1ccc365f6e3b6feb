"""The validation checks as one registry: each check is an object with a name, a title and ``run``.

Progress counts, report section titles, which failures are structural (exit 4, stop), the next
action a failure advises and which failures the fix gate repairs all come from the rows of
``checks.CHECKS`` (a :class:`Registry`), so adding a check is one module plus one row there.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UnsafeInputError
from quark_ptq_eval.base.registry import load
from quark_ptq_eval.base.safetensors_io import TensorInfo, TruncatedFileError, read_model_headers, with_data
from quark_ptq_eval.validate.load_sample import DEFAULT_BUDGET_S
from quark_ptq_eval.validate.report import CheckResult, Finding

Progress = Callable[[str, int, int], None]


@dataclass
class Handoffs:
    """What one check hands to a later one (in ``checks.CHECKS`` order), typed."""

    quantized_modules: set[str] = field(default_factory=set)  # layout: modules the plan quantizes (bytes check)
    expected_qconfig: dict[str, Any] | None = None  # plan conformance: the expected qconfig (KV-scale check)
    module_error_limit: tuple[float, str] | None = None  # load check: (limit, why) of its module replay
    structural_failed: bool = False  # a structural check failed: the serving check does not run
    unloadable: bool = False  # the files cannot be what a loader reads (layout, shard index): the load check does not run


@dataclass
class CheckInputs:
    """Everything the checks share: the two model dirs, the plan, configs and parsed headers."""

    source: Path
    quantized: Path
    plan: dict[str, Any] | None
    max_samples: int | None = None
    seed: int = 0
    workers: int | None = None
    load_check: bool = False
    stream_blocks: bool | None = None  # the load check one part at a time (None: when the whole model does not fit)
    load_budget_s: float | None = DEFAULT_BUDGET_S  # the streamed load check's blocks (load_sample.py; 0: all)
    vllm_python: Path | None = None  # the serving check's vLLM (None: runtime/vllm_host.vllm_python's)
    vllm_args: tuple[str, ...] = ()  # the user's --vllm-arg values, over the sized ones (runtime/vllm_sizing.py)
    progress: Progress | None = None
    src_config: dict[str, Any] = field(default_factory=dict)
    out_config: dict[str, Any] = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)
    exclusions_from: str = "default"
    headers: dict[str, dict[str, TensorInfo] | str] = field(default_factory=dict)
    shared: Handoffs = field(default_factory=Handoffs)  # results one check hands to a later one
    weights_source: Path | None = None  # where the decode check reads source weights (an FP8 release's BF16 copy)
    # an export shard whose data stops short: its header kept for the layout, its modules without bytes left out of
    # ``headers`` (what every data-reading check sees), so the rest of the export is still judged in this run
    truncated: dict[Path, TruncatedFileError] = field(default_factory=dict)
    declared_output: dict[str, TensorInfo] = field(default_factory=dict)  # every tensor the export's headers declare
    without_data: tuple[str, ...] = ()  # declared tensors whose module lost bytes to a truncated shard, in name order

    @property
    def qconfig(self) -> dict[str, Any] | None:
        q = self.out_config.get("quantization_config")
        return q if isinstance(q, dict) else None

    def read_headers(self) -> None:
        for side, model_dir in (("source", self.source), ("output", self.quantized)):
            try:
                self.headers[side] = read_model_headers(model_dir, self.truncated if side == "output" else None)
            except UnsafeInputError as exc:
                self.headers[side] = exc.message
        if (declared := self.tensors("output")) is not None:
            self.declared_output = declared
            self.headers["output"] = kept = with_data(declared, self.truncated)
            self.without_data = tuple(sorted(declared.keys() - kept.keys()))
        src, out = self.tensors("source"), self.tensors("output")
        if src is not None and out is not None:  # legacy checkpoint names (Mixtral's w1/w2/w3) -> the export's
            from quark_ptq_eval.base.tensor_names import align_source_names

            aligned = align_source_names(src, out, self.src_config.get("model_type"))
            self.headers["source"] = aligned
            from quark_ptq_eval.base.legacy_exclusions import legacy_exclusions

            self.exclude = [*self.exclude, *legacy_exclusions(src, aligned, self.exclude)]

    def tensors(self, side: str) -> dict[str, TensorInfo] | None:
        h = self.headers.get(side)
        return h if isinstance(h, dict) else None

    def readable(self, side: str) -> dict[str, TensorInfo]:
        """The parsed headers of ``side``, for a check past its ``unreadable_headers`` guard."""
        h = self.headers[side]
        if not isinstance(h, dict):
            raise RuntimeError(f"the {side} headers are unreadable ({h}): the check's guard should have stopped it")
        return h


@dataclass(frozen=True)
class Check:
    """One validation check: ``run(context)`` never raises on a mismatch, it returns findings."""

    name: str
    title: str
    run: Callable[[CheckInputs], CheckResult] | str  # or "module:function", imported when it runs
    structural: bool  # a failure means the weights are wrong: stop, no fix offered
    advisory: bool = False  # its failures are reported ("warn") and never stop the run
    next_action: str = ""  # what the report advises when it fails
    fixable: bool = False  # its failing findings name files the fix gate re-copies from the source
    module: str | None = None  # the module that implements it, when ``run`` is an adapter in checks.py
    # failing, the files are not what a loader reads: the load check does not run (other faults leave it running,
    # so that one validation names every fault)
    unloadable_when_failed: bool = False

    @property
    def implemented_in(self) -> str:
        return self.module or (self.run.partition(":")[0] if isinstance(self.run, str) else self.run.__module__)

    def execute(self, ctx: CheckInputs) -> CheckResult:
        run: Callable[[CheckInputs], CheckResult] = load(self.run) if isinstance(self.run, str) else self.run
        return run(ctx)


def read_config_or_empty(model_dir: Path) -> dict[str, Any]:
    """config.json as a dict; {} when it is missing or unreadable (the config check says why)."""
    try:
        data = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return {}  # the config check reports why
    return data if isinstance(data, dict) else {}


def unreadable_headers(ctx: CheckInputs, name: str) -> CheckResult | None:
    """The result for a check that needs headers one side refused, else None."""
    bad = [(side, h) for side, h in ctx.headers.items() if isinstance(h, str)]
    if not bad:
        return None
    result = CheckResult(name)
    result.findings += [Finding(f"{side} safetensors", msg, side="environment",
                                evidence="refused before reading any tensor data; an interrupted write or "
                                         "copy, a full disk, or a tampered index")
                        for side, msg in bad]
    return result
