"""The quantization engines as a registry: one module per engine behind one protocol.

This module is the table (cheap to import: the plan schema, the CLI's ``--engine`` choices and
the plan's automatic choice read it); each row names the module that implements
:class:`Engine`. Adding an engine is one module plus one row (see docs/extending.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class Engine(Protocol):
    """What the recipe needs of an engine. ``plan`` is a QuantPlan, ``manifest`` a RunManifest."""

    name: str

    def auto_reason(self, accelerator: str, calibration: dict, device_is_cpu: bool) -> str | None:
        """Why this engine is the automatic choice for such a plan, or None when it is not."""

    def check_constraints(self, scheme_info: dict, algorithm: str | None, device: dict) -> None:
        """Raise UsageError (what is wrong + what to do) when it cannot serve this plan."""

    def argv(self, plan: Any, model_dir: Path, out: Path) -> list[str]:
        """The exact command: absolute paths, one flag vocabulary (quark-cli's), no shell."""

    def env(self, plan: Any, workdir: Path) -> dict[str, str]:
        """Environment the command needs beyond the offline switches."""

    def prepare_calibration(self, manifest: Any) -> None:
        """Make the calibration data the command names available, just before it runs."""

    def version(self) -> str:
        """The version of Quark behind this engine (recorded in the manifest)."""


@dataclass(frozen=True)
class EngineEntry:
    name: str  # value of --engine and of quant_plan.json's engine.name
    module: str  # implements Engine as its module-level ENGINE
    summary: str


# The automatic choice takes the first engine whose auto_reason answers.
ENGINES: dict[str, EngineEntry] = {
    e.name: e
    for e in (
        EngineEntry("quark-cli", "quark_ptq_eval.execute.engines.quark_cli",
                    "`quark-cli torch-llm-ptq`, Quark's public CLI"),
        EngineEntry("quark-api", "quark_ptq_eval.execute.engines.quark_api",
                    "Quark's public Python API driven by our engine module (any device, local calibration text)"),
        EngineEntry("file2file", "quark_ptq_eval.execute.engines.file2file",
                    "Quark's file-to-file quantization: shard by shard, never the whole model (calibration-free "
                    "schemes; the plan picks it when the model does not fit the host)"),
    )
}
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)


def get_engine(name: str) -> Engine:
    from quark_ptq_eval.base.errors import UsageError

    if name not in ENGINES:
        raise UsageError(f"Unknown engine {name!r}.", f"Choose one of: {', '.join(ENGINE_NAMES)}.")
    return importlib.import_module(ENGINES[name].module).ENGINE


def choose_engine(requested: str, accelerator: str, calibration: dict, device_is_cpu: bool) -> tuple[str, str]:
    """The plan's engine decision: (name, reason)."""
    if requested != "auto":
        get_engine(requested)  # an unknown name is refused here, with the known ones
        return requested, "asked for explicitly"
    for name in ENGINE_NAMES:
        reason = get_engine(name).auto_reason(accelerator, calibration, device_is_cpu)
        if reason:
            return name, reason
    raise AssertionError("no engine in ENGINES accepts this plan automatically")
