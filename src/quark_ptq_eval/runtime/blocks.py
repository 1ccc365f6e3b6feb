"""The block streamer: a checkpoint run one decoder block at a time, never held whole.

A model is built on the ``meta`` device from its config.json with transformers' own class (its
decoder layers, rotary embedding, masks and norms), and its linears are mapped the way the
loader that Tier 1 would pick maps them (``runtime/loading.py``): transformers' Quark
integration (``QuarkHfQuantizer``), or Quark's importer for two-level scales and per-expert MoE
linears. Nothing is allocated until a part is asked for: ``load(part)`` reads only that part's
tensors from the safetensors files (their byte ranges, from the headers: no mmap of a whole
shard), renames them as the loader does, puts them into the meta model with the dtypes the
loader gives them, and runs the loader's own post-load step; ``free(part)`` returns it to meta.

The forward over a part (entry, one block, exit) is ``runtime/block_pass.py``. Used by Tier 1
(``evaluate/ppl/stream.py``).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.base.safetensors_io import TensorInfo, TruncatedFileError, read_model_headers, with_data

if TYPE_CHECKING:
    import torch

TORCH_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}
ENTRY, EXIT = "entry", "exit"
_STACK = re.compile(r"^(.*?)\.\d+\.")  # a name's first numbered container: the decoder stack


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """One tensor's bytes, read by offset (a sparse file's holes read as zeros, costing no disk)."""
    import torch

    if info.dtype not in TORCH_DTYPES:
        raise QpeError(f"{info.file.name}: tensor {info.name} has dtype {info.dtype}, which the block streamer "
                       "cannot read.")
    buffer = bytearray(info.nbytes)
    with open(info.file, "rb", buffering=0) as fh:
        view, done = memoryview(buffer), 0
        while done < info.nbytes:
            got = os.preadv(fh.fileno(), [view[done:]], info.start + done)
            if got <= 0:
                raise QpeError(f"{info.file} ended inside tensor {info.name}: the file is truncated.")
            done += got
    dtype = getattr(torch, TORCH_DTYPES[info.dtype])
    if not buffer:
        return torch.empty(info.shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).reshape(info.shape)


@dataclass
class StreamedModel:
    """A checkpoint's model on meta, its tensors by part, and the loader that maps them."""

    path: Path
    model: Any
    layers: Any  # the decoder layers' ModuleList
    layers_path: str  # "model.layers"
    parts: dict[str, list[TensorInfo]]  # "entry" / "exit" / block index as str -> its tensors
    loader: str
    loader_reason: str
    device: str
    dtype: Any
    load_config: Any  # transformers' LoadStateDictConfig for its loader; None for Quark's importer
    quark_config: Any  # Quark's PretrainedConfig of the export for its importer; None for transformers
    read_bytes: int = 0
    read_s: float = 0.0  # reading the parts' bytes
    load_s: float = 0.0  # reading and loading them (the loader's own step included)
    loaded: dict[str, list[str]] = field(default_factory=dict)  # part -> the tensor names its load filled

    @property
    def num_blocks(self) -> int:
        return len(self.layers)

    def block_bytes(self, index: int) -> int:
        return sum(t.nbytes for t in self.parts.get(str(index), []))

    def part_bytes(self, part: str) -> int:
        return sum(t.nbytes for t in self.parts.get(part, []))


def open_streamed(model_dir: Path, device: str = "cpu", trust_remote_code: bool = False,
                  partial: bool = False) -> StreamedModel:
    """The checkpoint ``model_dir`` on meta, its linears mapped by the loader Tier 1 would use. ``partial``: a
    truncated shard's modules whose bytes are missing are left out of the parts (the caller skips those parts)."""
    from quark_ptq_eval.runtime.loading import QUARK, pick_loader, read_config_or_raise

    model_dir = Path(model_dir)
    config_dict = read_config_or_raise(model_dir)
    loader, reason = pick_loader(model_dir, config_dict)
    truncated: dict[Path, TruncatedFileError] = {}
    headers = with_data(read_model_headers(model_dir, truncated if partial else None), truncated)
    if (config_dict.get("quantization_config") or {}).get("quant_method") == "quark":
        from quark_ptq_eval.base.first_use import announce_quark_import
        from quark_ptq_eval.base.quark_import import import_quark_torch

        announce_quark_import(f"loading the Quark export {model_dir.name}")  # as runtime/loading.py does
        import_quark_torch()  # through our cache of Quark's transformers scan (quark_import.py)
    if loader == QUARK:
        model, load_config, quark_config = _quark_skeleton(model_dir, trust_remote_code)
    else:
        model, load_config, quark_config = _transformers_skeleton(model_dir, config_dict, trust_remote_code)
    layers_path, layers = _decoder_layers(model)
    parts = split_parts(headers, layers_path)
    dtype = getattr(model, "dtype", None)
    return StreamedModel(model_dir, model, layers, layers_path, parts, loader, reason, device, dtype, load_config,
                         quark_config)


def _transformers_skeleton(model_dir: Path, config_dict: dict[str, Any], trust_remote_code: bool) -> tuple[Any, ...]:
    """transformers' class built as ``from_pretrained(dtype="auto")`` builds it (on meta; a Quark export's linears
    mapped by transformers' Quark quantizer's ``preprocess_model``); each part then goes through transformers'
    own ``convert_and_load_state_dict_in_model`` with the model's weight conversions (per-expert tensors fused
    into 3-D parameters, the quantizer's key table), so the loaded tensors are the loader's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.modeling_utils import LoadStateDictConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    dtype = getattr(config, "dtype", None) or torch.float32
    quantizer = None
    if (config_dict.get("quantization_config") or {}).get("quant_method"):
        from transformers.quantizers.auto import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(config.quantization_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    _rotary_buffers(model, config, trust_remote_code)
    if quantizer is not None:
        quantizer.preprocess_model(model=model, dtype=dtype, device_map=None, checkpoint_files=None, use_kernels=False)
    model.eval()
    conversions = get_model_conversion_mapping(model, None, quantizer)
    load_config = LoadStateDictConfig(pretrained_model_name_or_path=str(model_dir), dtype=dtype,
                                      dtype_plan=model._get_dtype_plan(dtype), hf_quantizer=quantizer,
                                      weight_mapping=conversions)  # type: ignore[arg-type]
    return model, load_config, None


def _rotary_buffers(model: Any, config: Any, trust_remote_code: bool) -> None:
    """Non-persistent buffers (rotary ``inv_freq``) computed on the CPU, as a real instance computes them:
    they are never in the checkpoint."""
    from accelerate import init_empty_weights  # type: ignore[import-untyped]
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        real = AutoModelForCausalLM.from_config(config, dtype=model.dtype, trust_remote_code=trust_remote_code)
    buffers = dict(real.named_buffers())
    for name, value in model.named_buffers():
        if value.device.type == "meta" and name in buffers:
            owner_path, _, leaf = name.rpartition(".")
            model.get_submodule(owner_path)._buffers[leaf] = buffers[name]
    del real


def _quark_skeleton(model_dir: Path, trust_remote_code: bool) -> tuple[Any, ...]:
    """Quark's importer, its steps applied to the meta model once and to each part as it loads:
    ``create_model_skeleton``, ``_build_quantized_model`` (its MoE preprocessing, ``_map_to_quark``),
    its key renaming, and ``_convert_quantized_model`` after each part's tensors are in."""
    from quark.torch.export.main_import.pretrained_config import PretrainedConfig
    from quark.torch.export.utils import (
        _build_quantized_model,
    )
    from quark.torch.utils.llm.model_preparation import create_model_skeleton

    model = None
    for attention in ("sdpa", "eager"):  # as runtime/loading.py: eager where a family has no SDPA path
        try:
            model = create_model_skeleton(str(model_dir), trust_remote_code=trust_remote_code,
                                          attn_implementation=attention)
            break
        except ValueError as exc:
            if "does not support an attention implementation" not in str(exc):
                raise
    model_config = PretrainedConfig(pretrained_dir=str(model_dir))
    model = _build_quantized_model(model, model_config, {})
    model.eval()
    return model, None, model_config


def _decoder_layers(model: Any) -> tuple[str, Any]:
    """The ModuleList of decoder layers (``model.layers`` in most families), found by its length."""
    import torch

    count = getattr(model.config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and name.endswith("layers"):
            return name, module
    raise QpeError(f"{model.config.model_type}: no ModuleList of {count} decoder layers was found, so this "
                   "family cannot be streamed block by block.")


def stack_path(names: Iterable[str]) -> str | None:
    """Where a checkpoint's decoder blocks are, from its tensor names alone (``model.layers`` for
    ``model.layers.0.mlp.up_proj.weight``): before any model is built, e.g. to size a streamed pass."""
    for name in names:
        if match := _STACK.match(name):
            return match.group(1)
    return None


def split_parts(headers: dict[str, TensorInfo], layers_path: str) -> dict[str, list[TensorInfo]]:
    """Tensors by part: a block's under ``<layers_path>.<i>.``, the rest split between the entry
    (embeddings, before the blocks) and the exit (final norm, lm_head)."""
    parts: dict[str, list[TensorInfo]] = {}
    prefix = layers_path + "."
    for name, info in headers.items():
        if name.startswith(prefix):
            index = name[len(prefix):].split(".", 1)[0]
            parts.setdefault(index, []).append(info)
        else:
            part = ENTRY if "embed" in name else EXIT
            parts.setdefault(part, []).append(info)
    return parts


def part_module(streamed: StreamedModel, part: str) -> Any:
    """The module a part's tensors load into: the model (entry, exit) or decoder layer ``part``."""
    return streamed.model if part in (ENTRY, EXIT) else streamed.layers[int(part)]


def exit_parts(streamed: StreamedModel) -> list[str]:
    """The exit's parts: its tensors, and the embedding too where lm_head is tied to it (its file holds one tensor)."""
    head_in_files = any("lm_head" in t.name for t in streamed.parts.get(EXIT, []))
    tied = getattr(streamed.model.config, "tie_word_embeddings", False)
    return [EXIT, ENTRY] if tied and not head_in_files else [EXIT]


def advise_part(streamed: StreamedModel, part: str) -> None:
    """Ask the kernel to read ``part``'s byte ranges into the page cache now (``POSIX_FADV_WILLNEED``): the
    disk works while the current block computes, and the pages count against no process's memory."""
    for info in streamed.parts.get(part, []):
        try:
            fd = os.open(info.file, os.O_RDONLY)
        except OSError:
            return  # the read itself reports it
        try:
            os.posix_fadvise(fd, info.start, info.nbytes, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def read_part(streamed: StreamedModel, part: str) -> dict[str, Any]:
    """``part``'s tensors as stored, by checkpoint name (safe in a helper thread: one file handle per tensor)."""
    return {t.name: read_tensor(t) for t in streamed.parts.get(part, [])}


def load(streamed: StreamedModel, part: str) -> None:
    """Read ``part``'s tensors (only those) and load them into the meta model through the loader's own code."""
    load_tensors(streamed, part, part, streamed.parts.get(part, []))
    if part not in (ENTRY, EXIT):
        missing = [n for n, t in _named_tensors(part_module(streamed, part)) if t.device.type == "meta"]
        if missing:
            raise QpeError(f"{streamed.path.name}: block {part}'s tensors {', '.join(missing[:3])} are not in its "
                           "files, or not under the names its loader expects; the checkpoint is incomplete.")


def load_tensors(streamed: StreamedModel, key: str, part: str, infos: list[TensorInfo], holder: Any = None) -> None:
    """Read ``infos`` (some of ``part``'s tensors, or slices of them) and load them through the loader's own
    code; ``free(streamed, key)`` returns what they filled to meta (runtime/expert_groups.py loads a block in
    pieces: its experts a group at a time). ``holder``: the modules Quark's post-load step converts (default:
    the part's)."""
    started = time.perf_counter()
    tensors = {t.name: read_tensor(t) for t in infos}
    streamed.read_s += time.perf_counter() - started
    streamed.read_bytes += sum(t.nbytes for t in infos)
    before = _meta_names(streamed.model)
    if streamed.load_config is not None:
        _load_with_transformers(streamed, tensors)
    else:
        _load_with_quark(streamed, part, tensors, holder)
    _tie(streamed)
    streamed.loaded[key] = sorted(before - _meta_names(streamed.model))
    streamed.load_s += time.perf_counter() - started


def _load_with_transformers(streamed: StreamedModel, tensors: dict[str, Any]) -> None:
    """transformers' own loading step (renames, fused experts, the quantizer's conversions, dtype casts)."""
    import dataclasses

    from transformers.core_model_loading import convert_and_load_state_dict_in_model

    config = dataclasses.replace(streamed.load_config, device_map={"": streamed.device})
    convert_and_load_state_dict_in_model(streamed.model, tensors, config)


def _load_with_quark(streamed: StreamedModel, part: str, tensors: dict[str, Any], holder: Any = None) -> None:
    """Quark's importer's steps on one part: its key renaming, ``load_state_dict(assign=True)``, its
    post-load conversion of the modules the part holds."""
    from quark.torch.export.utils import _convert_quantized_model, _fix_loaded_weights_key_mismatch

    model_config = streamed.quark_config
    fixed = _fix_loaded_weights_key_mismatch(tensors, weight_format=model_config.weight_format,
                                             custom_mode=model_config.quantization_config["quant_method"])
    fixed = {k: v.to(streamed.device) for k, v in fixed.items()}
    streamed.model.load_state_dict(fixed, assign=True, strict=False)
    if holder is None:
        holder = _Only(streamed) if part in (ENTRY, EXIT) else part_module(streamed, part)
    _convert_quantized_model(holder, model_config)


def _meta_names(model: Any) -> set[str]:
    return {n for n, t in _named_tensors(model) if t.device.type == "meta"}


class _Only:
    """The model seen without its decoder layers (a loader's post-load step over the entry or exit)."""

    def __new__(cls, streamed: StreamedModel) -> Any:
        import torch

        holder = torch.nn.Module()
        for name, module in streamed.model.named_children():
            if module is not streamed.layers:
                holder.add_module(name, module)
        return holder


def _named_tensors(module: Any) -> list[tuple[str, Any]]:
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def _tie(streamed: StreamedModel) -> None:
    """Tied embeddings: lm_head is the embedding (its file holds one tensor), as the loader ties them."""
    model = streamed.model
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "get_output_embeddings"):
        output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
        if output is not None and inputs is not None and inputs.weight.device.type != "meta":
            output.weight = inputs.weight


def free(streamed: StreamedModel, part: str) -> None:
    """Return the tensors a part's load filled to meta (their memory freed)."""
    for name in streamed.loaded.pop(part, []):
        _to_meta(streamed.model, name)


def _to_meta(model: Any, name: str) -> None:
    import torch

    owner_path, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_path)
    if leaf in owner._parameters and owner._parameters[leaf] is not None:
        old = owner._parameters[leaf]
        owner._parameters[leaf] = torch.nn.Parameter(torch.empty_like(old, device="meta"), requires_grad=False)
    elif leaf in owner._buffers and owner._buffers[leaf] is not None:
        owner._buffers[leaf] = torch.empty_like(owner._buffers[leaf], device="meta")
