"""How the engine reads the source, decided by the plan before anything runs (intake/formats.py).

- ``direct``: BF16/FP16/FP32 safetensors, read as they are;
- ``file2file_native``: an engine that reads the format itself (its entry's ``reads_sources``: Quark's
  file-to-file engine on a GPU host recovers FP8 blocks itself);
- ``stage_bf16``: an exact BF16 copy (each FP8 block x its scale; each MXFP4 code x its block's
  power of two) in the work dir, for CPU hosts and calibrated schemes (and every gpt-oss MXFP4
  source: Quark's file-to-file engine does not read that layout); written shard by shard after the
  execution gate (execute/staging.py);
- ``convert_bin``: ``pytorch_model.bin`` converted to safetensors in the work dir, after the gate;
- refused (a UsageError): what is wrong and what would work.

Validation, the load check and Tier 1's baseline read ``source_dir`` (:func:`effective_source`):
the staged copy when there is one, so they compare against what the engine was given.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.artifacts import ModelAnalysis, QuantPlan
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.plan_records import DeviceStrategy, SourceReading
from quark_ptq_eval.base.sizes import gb
from quark_ptq_eval.intake.formats import (
    CONVERT_BIN,
    DIRECT,
    FORMATS,
    REFUSED,
    STAGE_BF16,
    UNQUANTIZED,
    release_of,
)

if TYPE_CHECKING:
    from quark_ptq_eval.plan.engines import SourceRead

STAGED_BF16_DIR = "source-bf16"  # in the work dir
CONVERTED_BIN_DIR = "source-safetensors"
COMPLETE_MARK = ".staged-complete"  # written last: a staged dir without it is unfinished


def source_format(analysis: ModelAnalysis) -> dict[str, Any]:
    fmt: dict[str, Any] = getattr(analysis, "source_format", None) or {"name": UNQUANTIZED, "reading": DIRECT}
    return fmt


def decide(analysis: ModelAnalysis, engine: str, device: DeviceStrategy, workdir: Path) -> SourceReading:
    """The plan's ``source_reading``: mode, reason, the dir the engine reads and the staging's disk cost."""
    fmt = source_format(analysis)
    model = analysis.model["model_path"]
    entry = FORMATS[fmt["name"]]
    if fmt["reading"] == REFUSED:
        raise UsageError(f"This source cannot be quantized here: its weights are {fmt.get('summary') or entry.summary}.",
                         entry.refusal[0].upper() + entry.refusal[1:] + ".")
    name = fmt["name"]
    if fmt["reading"] == DIRECT:
        return SourceReading(name, model, model, 0, "direct", f"{fmt.get('summary') or entry.summary}: read as they are")
    if fmt["reading"] == CONVERT_BIN:
        staged = str(Path(workdir) / CONVERTED_BIN_DIR)
        disk = int(analysis.size.get("bytes") or 0)
        return SourceReading(name, staged, staged, disk, "convert_bin",
                             f"only pytorch_model.bin: converted to safetensors in {staged} after the execution gate "
                             f"(torch.load(weights_only=True), about {gb(disk)} on disk); the engine, validation and "
                             "the baseline read that copy")
    assert fmt["reading"] == STAGE_BF16
    staged = str(Path(workdir) / STAGED_BF16_DIR)
    disk = int(fmt.get("read_as_bytes") or 2 * int(analysis.size.get("params") or 0))
    how = _dequant_rule(fmt)
    reads = _reads_itself(engine)
    if reads:
        read = _check_native(engine, fmt["name"], reads.get(fmt["name"]), device, disk, how)
        return SourceReading(name, staged, model, disk, "file2file_native",
                             f"{read.note}; validation and the baseline read an exact BF16 copy ({how}) written to "
                             f"{staged} after the execution gate (about {gb(disk)} on disk)")
    return SourceReading(name, staged, staged, disk, "stage_bf16",
                         f"{fmt.get('summary') or entry.summary}: the {engine} engine loads the model with transformers, "
                         f"which cannot load {entry.unloadable}, and calibration needs the model; an exact BF16 copy "
                         f"({how}) is written shard by shard to {staged} after the execution gate: about {gb(disk)} on disk")


def _dequant_rule(fmt: dict[str, Any]) -> str:
    if FORMATS[fmt["name"]].stage_rule:
        return FORMATS[fmt["name"]].stage_rule
    block = fmt.get("weight_block_size")
    if block:
        return f"each {block[0]}x{block[1]} block x its weight_scale_inv"
    return "each weight x its per-tensor/channel scale"


def _reads_itself(engine: str) -> Mapping[str, SourceRead]:
    """The source formats ``engine`` reads itself (empty for one that reads what the plan gives it)."""
    from quark_ptq_eval.plan.engines import ENGINES

    return ENGINES[engine].reads_sources if engine in ENGINES else {}


def _check_native(engine: str, name: str, read: SourceRead | None, device: DeviceStrategy, disk: int,
                  how: str) -> SourceRead:
    """``read`` when ``engine`` can read this staged format itself on this device, else its UsageError."""
    staging = (f"Leave out --engine: the plan then reads it through an exact BF16 staging copy ({how}, about "
               f"{gb(disk)} in the work dir) with the quark-api engine")
    if read is None or not read.reads:
        why = read.note if read else f"the {engine} engine does not read {name} sources"
        raise UsageError(f"--engine {engine} cannot read this source: {why}.", staging + ".")
    if read.gpu_only and device.device == "cpu":
        raise UsageError(f"--engine {engine} cannot read this {release_of(name)} release on this CPU host: "
                         f"{read.gpu_only}.",
                         f"{staging}; or run on a GPU host with --engine {engine} --device cuda.")
    if read.one_device and device.multi_device:
        raise UsageError(read.one_device,
                         f"Drop --multi-device (one GPU, shard by shard), or leave out --engine {engine}.")
    return read


def engine_reads_source(engine: str, analysis: ModelAnalysis, device: str) -> bool:
    """Whether ``engine`` reads this source itself on this device (as the engine's entry declares)."""
    name = source_format(analysis)["name"]
    read = _reads_itself(engine).get(name)
    if FORMATS[name].reading in (REFUSED, CONVERT_BIN) or read is None or not read.reads:
        return False
    return not (read.gpu_only and device == "cpu")


def effective_source(plan: QuantPlan | None, model_path: Path | None) -> Path | None:
    """The source validation, the load check and Tier 1's baseline compare against: the staged
    BF16 (or converted) copy when the plan made one and it is complete, else the model dir.
    For other checks that want the dequantized source (e.g. a decode check in validate/)."""
    reading = plan.source_reading if plan is not None else None
    if reading is not None and reading.staged and (Path(reading.source_dir) / COMPLETE_MARK).is_file():
        return Path(reading.source_dir)
    return model_path


def decision_row(reading: SourceReading) -> dict[str, Any]:
    value = reading.mode + (f" ({gb(reading.disk_bytes)} on disk)" if reading.disk_bytes else "")
    return {"decision": "source reading", "value": value, "reason": reading.reason}


def disk_problem(reading: SourceReading, fit: dict[str, Any]) -> list[dict[str, Any]]:
    """A staged copy larger than the free disk blocks the plan (added to ``fit``); its table row."""
    free = (fit.get("host") or {}).get("disk_free_bytes")
    need = reading.disk_bytes + int(fit.get("output_bytes") or 0)
    if not reading.disk_bytes or free is None or need <= free:
        return []
    message = (f"the staged source copy ({gb(reading.disk_bytes)}) and the output ({gb(fit['output_bytes'])}) "
               f"need about {gb(need)} on disk; {gb(free)} is free")
    fit.setdefault("problems", []).append({"blocking": True, "what": "disk (staged source)", "message": message})
    fit["fits"] = False
    return [{"decision": "does not fit: disk (staged source)", "value": "STOP", "reason": message}]
