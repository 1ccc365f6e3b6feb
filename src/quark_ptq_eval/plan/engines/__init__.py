"""The quantization engines as a registry: one module per engine behind one protocol.

This module is the table (cheap to import: the plan schema, the CLI's ``--engine`` choices and
the plan's automatic choice read it); each row names the module that implements
:class:`Engine`. Adding an engine is one module plus one row (see docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from quark_ptq_eval.base.catalog import SchemeInfo
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.plan_records import DeviceStrategy, PlannedCalibration
from quark_ptq_eval.base.registry import Registry, load


class Engine(Protocol):
    """What the recipe needs of an engine. ``plan`` is a QuantPlan, ``manifest`` a RunManifest."""

    name: str

    def auto_reason(self, accelerator: str, calibration: PlannedCalibration, device_is_cpu: bool) -> str | None:
        """Why this engine is the automatic choice for such a plan, or None when it is not."""

    def check_constraints(self, scheme_info: SchemeInfo, algorithm: str | None, device: DeviceStrategy) -> None:
        """Raise UsageError (what is wrong + what to do) when it cannot serve this plan."""

    def argv(self, plan: Any, model_dir: Path, out: Path) -> list[str]:
        """The exact command: absolute paths, one flag vocabulary (quark-cli's), no shell."""

    def env(self, plan: Any, workdir: Path) -> dict[str, str]:
        """Environment the command needs beyond the offline switches."""

    def prepare_calibration(self, manifest: Any) -> None:
        """Make the calibration data the command names available, just before it runs."""

    def version(self) -> str:
        """The version of Quark behind this engine (recorded in the manifest)."""


WHOLE_MODEL, ONE_SHARD, ONE_BLOCK = "whole_model", "one_shard", "one_block"  # what an engine holds at its peak


@dataclass(frozen=True)
class SourceRead:
    """What an engine that reads the source itself (no staging copy in the work dir) does with one
    source format, a row of intake/formats.py: the engine's knowledge, not the format's."""

    note: str  # what it does with the format, as a sentence (also the refusal's words when it cannot read it)
    reads: bool = True  # False: it cannot read this layout at all
    gpu_only: str = ""  # why it reads the format only on a GPU ("": on any device)
    one_device: str = ""  # why it refuses several devices for the format ("": it does not)


@dataclass(frozen=True)
class EngineEntry:
    name: str  # value of --engine and of quant_plan.json's engine.name
    module: str  # implements Engine as its module-level ENGINE
    summary: str
    # WHOLE_MODEL: the plan's estimate is the loaded model plus calibration; ONE_SHARD: a multiple of the
    # largest shard, and the plan picks it when a whole-model engine does not fit the host (plan/host_fit.py).
    # ONE_BLOCK: one decoder block plus the calibration states; the plan picks it when neither fits or file-to-file
    # cannot run the plan. ONE_SHARD and ONE_BLOCK engines also answer unsupported_reason(scheme_info, algorithm,
    # kv) and refusal(why).
    memory: str = WHOLE_MODEL
    # The source formats (by name) it reads itself, with no BF16 staging copy; a format not named is one it
    # does not read itself. Empty: it reads what the plan's source reading gives it (plan/source_reading.py).
    reads_sources: Mapping[str, SourceRead] = field(default_factory=dict)
    reads_text_file: bool = False  # its child reads a local calibration text itself: the plan checks the file
    # A folder under its output where it keeps what it finished: a re-run of the same approved command resumes
    # from it instead of setting the partial output aside (execute/step.py). "": it starts over.
    resumes_in: str = ""


# Quark 0.13's file-to-file engine on each source format it meets (measured: docs/planning.md).
_FP8_ON_GPU = SourceRead(
    "Quark's file-to-file engine recovers the FP8 weights itself on the GPU, shard by shard",
    gpu_only="Quark 0.13 recovers FP8 weights with a Triton kernel that needs a GPU (on a CPU it logs "
             "'FP8 model dequantization requires a CUDA device' and writes nothing)",
    one_device="Quark 0.13's file-to-file engine refuses several devices for FP8 sources.")
FILE2FILE_READS = {
    "float": SourceRead("Quark's file-to-file engine reads it as it is"),
    "fp8_block": _FP8_ON_GPU,
    "fp8_tensor": _FP8_ON_GPU,
    "mxfp4": SourceRead("Quark 0.13's file-to-file engine does not read the gpt-oss *_blocks/*_scales layout "
                        "(Quark 0.13 recovers the DeepSeek-V4 MXFP4 layout only)", reads=False),
}

# The automatic choice takes the first engine whose auto_reason answers.
ENGINES: Registry[EngineEntry] = Registry("engine", (
    EngineEntry("quark-cli", "quark_ptq_eval.plan.engines.quark_cli",
                "`quark-cli torch-llm-ptq`, Quark's public CLI"),
    EngineEntry("quark-api", "quark_ptq_eval.plan.engines.quark_api",
                "Quark's public Python API driven by our engine module (any device, local calibration text)",
                reads_text_file=True),
    EngineEntry("file2file", "quark_ptq_eval.plan.engines.file2file",
                "Quark's file-to-file quantization: shard by shard, never the whole model (calibration-free "
                "schemes; the plan picks it when the model does not fit the host)",
                memory=ONE_SHARD, reads_sources=FILE2FILE_READS),
    EngineEntry("sequential", "quark_ptq_eval.plan.engines.sequential",
                "Quark's quantizer, algorithms and exporter on one decoder block at a time (static scales, "
                "GPTQ, SmoothQuant, KV-cache scales; the plan picks it when the model does not fit the host and "
                "file-to-file cannot run the plan)",
                memory=ONE_BLOCK, reads_text_file=True, resumes_in=".sequential"),
))
ENGINE_NAMES: tuple[str, ...] = ENGINES.names()


def get_engine(name: str) -> Engine:
    engine: Engine = load(ENGINES[name].module).ENGINE  # an unknown name is refused with the known ones
    return engine


class OneShardEngine(Engine, Protocol):
    """An engine that holds one shard at a time (``memory=ONE_SHARD``): it says which plans it cannot serve."""

    def unsupported_reason(self, scheme_info: SchemeInfo, algorithm: str | None, kv_cache_scheme: str | None) -> str | None:
        """Why it cannot serve this plan, or None when it can."""

    def refusal(self, why: str) -> UsageError:
        """The UsageError for an explicit request it cannot serve."""


def shard_engine() -> OneShardEngine | None:
    """The engine the plan falls back on when a whole-model engine does not fit the host."""
    entry = next(iter(ENGINES.where(lambda e: e.memory == ONE_SHARD)), None)
    engine: OneShardEngine | None = load(entry.module).ENGINE if entry else None
    return engine


def block_engine() -> OneShardEngine | None:
    """The engine the plan falls back on when neither a whole-model engine nor file-to-file serves the plan here."""
    entry = next(iter(ENGINES.where(lambda e: e.memory == ONE_BLOCK)), None)
    engine: OneShardEngine | None = load(entry.module).ENGINE if entry else None
    return engine


def holds_one_block(name: str | None) -> bool:
    return name is not None and name in ENGINES and ENGINES[name].memory == ONE_BLOCK


def holds_one_shard(name: str | None) -> bool:
    return name is not None and name in ENGINES and ENGINES[name].memory == ONE_SHARD


def choose_engine(requested: str, accelerator: str, calibration: PlannedCalibration, device_is_cpu: bool) -> tuple[str, str]:
    """The plan's engine decision: (name, reason)."""
    if requested != "auto":
        get_engine(requested)  # an unknown name is refused here, with the known ones
        return requested, "asked for explicitly"
    for name in ENGINES:
        reason = get_engine(name).auto_reason(accelerator, calibration, device_is_cpu)
        if reason:
            return name, reason
    raise AssertionError("no engine in ENGINES accepts this plan automatically")
