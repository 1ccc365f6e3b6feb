"""The block streamer: a checkpoint run one decoder block at a time, never held whole.

A model is built on the ``meta`` device from its config.json with transformers' own class (its
decoder layers, rotary embedding, masks and norms), and its linears are mapped the way the
loader that Tier 1 would pick maps them (``runtime/loading.py``): transformers' Quark
integration (``QuarkHfQuantizer``), or Quark's importer for two-level scales and per-expert MoE
linears. Nothing is allocated until a part is asked for: ``load(part)`` reads only that part's
tensors from the safetensors files (their byte ranges, from the headers: no mmap of a whole
shard), renames them as the loader does, puts them into the meta model with the dtypes the
loader gives them, and runs the loader's own post-load step; ``free(part)`` returns it to meta.

A forward is then three stages over the same windows (``entry``, each ``block``, ``exit``):
the entry runs the model's own forward with every decoder layer replaced by a recorder, so the
hidden states entering block 0 and the arguments the model hands each layer (its causal or
sliding-window mask, rotary position embeddings) are the model's own; a block applies one real
decoder layer; the exit runs the model's own forward again with the layers replaced by a replay
of the last block's output (embedding zeroed: never read), so the final norm, lm_head and any
logit scaling or soft-capping are the model's own. Used by Tier 1 (``evaluate/ppl/stream.py``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.base.safetensors_io import TensorInfo, read_model_headers

if TYPE_CHECKING:
    import torch

TORCH_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}
ENTRY, EXIT = "entry", "exit"


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
class Recorded:
    """What the model's forward handed one decoder layer (positional and keyword arguments)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    hidden: Any = None  # the hidden states it was given (kept for block 0 only: the entry's output)


class _EntryDone(Exception):
    """Raised by the last recorder: the entry pass has all it needs."""


class _Recorder:
    """Stands in for decoder layer ``index`` during the entry pass: keeps its arguments, passes the
    hidden states through unchanged (so no layer's weights are needed)."""

    def __new__(cls, original: Any, index: int, sink: dict[int, Recorded], last: int) -> Any:
        import torch

        class Recorder(torch.nn.Module):
            def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                kept = {k: v for k, v in kwargs.items() if k != "past_key_values"}
                sink[index] = Recorded(args, kept, hidden_states if index == 0 else None)
                if index == last:
                    raise _EntryDone  # the norm and lm_head after the blocks are not loaded: stop here
                return hidden_states

        module = Recorder()
        _copy_layer_attributes(original, module)
        return module


class _Replay:
    """Stands in for every decoder layer during the exit pass: the last one returns the stored output."""

    def __new__(cls, original: Any, final: torch.Tensor | None) -> Any:
        import torch

        class Replay(torch.nn.Module):
            def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                return hidden_states if final is None else final

        module = Replay()
        _copy_layer_attributes(original, module)
        return module


def _copy_layer_attributes(original: Any, module: Any) -> None:
    """The plain attributes the model's forward reads off its layers (``attention_type`` picks the mask)."""
    for name in ("attention_type", "layer_idx", "is_sliding", "sliding_window"):
        if hasattr(original, name):
            setattr(module, name, getattr(original, name))


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
    rename: Any  # checkpoint name -> the model's state-dict name (the loader's own renaming)
    after_load: Any  # the loader's post-load step on a module holding one part
    read_bytes: int = 0
    config: Any = None
    quark_config: Any = None
    loaded: set[str] = field(default_factory=set)

    @property
    def num_blocks(self) -> int:
        return len(self.layers)

    def block_bytes(self, index: int) -> int:
        return sum(t.nbytes for t in self.parts.get(str(index), []))

    def part_bytes(self, part: str) -> int:
        return sum(t.nbytes for t in self.parts.get(part, []))


_BLOCK_NAME = re.compile(r"^(?P<prefix>.+?)\.(?P<index>\d+)\.")


def open_streamed(model_dir: Path, device: str = "cpu", trust_remote_code: bool = False) -> StreamedModel:
    """The checkpoint ``model_dir`` on meta, its linears mapped by the loader Tier 1 would use."""
    from quark_ptq_eval.runtime.loading import QUARK, pick_loader, read_config_or_raise

    model_dir = Path(model_dir)
    config_dict = read_config_or_raise(model_dir)
    loader, reason = pick_loader(model_dir, config_dict)
    headers = read_model_headers(model_dir)
    if loader == QUARK:
        model, rename, after, quark_config = _quark_skeleton(model_dir, trust_remote_code)
    else:
        model, rename, after, quark_config = _transformers_skeleton(model_dir, config_dict, trust_remote_code)
    layers_path, layers = _decoder_layers(model)
    parts = _split_parts(headers, layers_path, rename)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return StreamedModel(model_dir, model, layers, layers_path, parts, loader, reason, device, dtype, rename, after,
                         config=model.config, quark_config=quark_config)


def _transformers_skeleton(model_dir: Path, config_dict: dict[str, Any], trust_remote_code: bool) -> tuple[Any, ...]:
    """transformers' class on meta, dtype as ``from_pretrained(dtype="auto")``; a Quark export's linears
    mapped by transformers' own Quark quantizer, its checkpoint keys renamed by that quantizer's table."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    dtype = getattr(config, "dtype", None) or torch.float32
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.eval()
    qconfig = config_dict.get("quantization_config") or {}
    if qconfig.get("quant_method") != "quark":
        return model, (lambda name: name), (lambda module: None), None
    from transformers.quantizers.auto import AutoHfQuantizer
    from transformers.quantizers.quantizer_quark import CHECKPOINT_KEYS

    quantizer = AutoHfQuantizer.from_config(config.quantization_config)
    quantizer._process_model_before_weight_loading(model)  # QuarkHfQuantizer: Quark's _map_to_quark

    def rename(name: str) -> str:
        head, _, leaf = name.rpartition(".")
        return f"{head}.{CHECKPOINT_KEYS[leaf]}" if leaf in CHECKPOINT_KEYS else name

    return model, rename, (lambda module: None), config.quantization_config


def _quark_skeleton(model_dir: Path, trust_remote_code: bool) -> tuple[Any, ...]:
    """Quark's importer, its steps applied to the meta model once and to each part as it loads:
    ``create_model_skeleton``, ``_build_quantized_model`` (its MoE preprocessing, ``_map_to_quark``),
    its key renaming, and ``_convert_quantized_model`` after each part's tensors are in."""
    from quark.torch.export.utils import (
        _build_quantized_model,
        _convert_quantized_model,
        _fix_loaded_weights_key_mismatch,
    )
    from quark.torch.utils.llm.model_preparation import create_model_skeleton
    from quark.torch.export.main_import.pretrained_config import PretrainedConfig

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
    mode = model_config.quantization_config["quant_method"]

    def rename(name: str) -> str:
        fixed = _fix_loaded_weights_key_mismatch({name: None}, weight_format=model_config.weight_format,
                                                 custom_mode=mode)
        return next(iter(fixed))

    return model, rename, (lambda module: _convert_quantized_model(module, model_config)), model_config


def _decoder_layers(model: Any) -> tuple[str, Any]:
    """The ModuleList of decoder layers (``model.layers`` in most families), found by its length."""
    import torch

    count = getattr(model.config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and name.endswith("layers"):
            return name, module
    raise QpeError(f"{model.config.model_type}: no ModuleList of {count} decoder layers was found, so this "
                   "family cannot be streamed block by block.")


def _split_parts(headers: dict[str, TensorInfo], layers_path: str, rename: Any) -> dict[str, list[TensorInfo]]:
    """Tensors by part: a block's under ``<layers_path>.<i>.``, the rest split between the entry
    (embeddings, before the blocks) and the exit (final norm, lm_head)."""
    parts: dict[str, list[TensorInfo]] = {}
    prefix = layers_path + "."
    for name, info in headers.items():
        if name.startswith(prefix):
            index = name[len(prefix):].split(".", 1)[0]
            parts.setdefault(index, []).append(info)
        else:
            part = ENTRY if "embed" in rename(name) else EXIT
            parts.setdefault(part, []).append(info)
    return parts


def part_module(streamed: StreamedModel, part: str) -> Any:
    """The module a part's tensors load into: the model (entry, exit) or decoder layer ``part``."""
    return streamed.model if part in (ENTRY, EXIT) else streamed.layers[int(part)]


def load(streamed: StreamedModel, part: str) -> None:
    """Read ``part``'s tensors (only those) and put them into the meta model on the streamed device."""
    import torch

    tensors = {streamed.rename(t.name): read_tensor(t) for t in streamed.parts.get(part, [])}
    streamed.read_bytes += streamed.part_bytes(part)
    holder = streamed.model
    with torch.no_grad():
        for name, value in tensors.items():
            _assign(holder, name, value, streamed.device)
    if part in (ENTRY, EXIT):
        _tie(streamed)
        streamed.after_load(_Only(streamed, part))
    else:
        streamed.after_load(part_module(streamed, part))
        missing = [n for n, t in _named_tensors(part_module(streamed, part)) if t.device.type == "meta"]
        if missing:
            raise QpeError(f"{streamed.path.name}: block {part}'s tensors {', '.join(missing[:3])} are not in its "
                           "files; the checkpoint is incomplete.")
    streamed.loaded.add(part)


class _Only:
    """The model seen without its decoder layers (a loader's post-load step over the entry or exit)."""

    def __new__(cls, streamed: StreamedModel, part: str) -> Any:
        import torch

        holder = torch.nn.Module()
        for name, module in streamed.model.named_children():
            if module is not streamed.layers:
                holder.add_module(name, module)
        return holder


def _named_tensors(module: Any) -> list[tuple[str, Any]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _assign(model: Any, name: str, value: torch.Tensor, device: str) -> None:
    """Put ``value`` at ``name``, in the dtype the mapped module declared for it where it is floating
    (as transformers casts a checkpoint's float tensors to the model's dtype), else as stored."""
    import torch

    owner_path, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_path)
    except AttributeError:
        return  # a tensor the loader does not load either (e.g. rotary inv_freq of old checkpoints)
    current = getattr(owner, leaf, None)
    if isinstance(current, torch.Tensor) and current.is_floating_point() and value.is_floating_point():
        value = value.to(current.dtype)
    value = value.to(device)
    if leaf in owner._parameters:
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    elif leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        setattr(owner, leaf, value)


def _tie(streamed: StreamedModel) -> None:
    """Tied embeddings: lm_head is the embedding (its file holds one tensor), as the loader ties them."""
    model = streamed.model
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "get_output_embeddings"):
        output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
        if output is not None and inputs is not None and inputs.weight.device.type != "meta":
            output.weight = inputs.weight


def free(streamed: StreamedModel, part: str) -> None:
    """Return a part's tensors to meta (their memory freed)."""
    module = part_module(streamed, part)
    if part in (ENTRY, EXIT):
        for info in streamed.parts.get(part, []):
            _to_meta(streamed.model, streamed.rename(info.name))
        _tie_meta(streamed)
    else:
        for name, _ in _named_tensors(module):
            _to_meta(module, name)
    streamed.loaded.discard(part)


def _to_meta(model: Any, name: str) -> None:
    import torch

    owner_path, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_path)
    except AttributeError:
        return
    if leaf in owner._parameters and owner._parameters[leaf] is not None:
        old = owner._parameters[leaf]
        owner._parameters[leaf] = torch.nn.Parameter(torch.empty_like(old, device="meta"), requires_grad=False)
    elif leaf in owner._buffers and owner._buffers[leaf] is not None:
        owner._buffers[leaf] = torch.empty_like(owner._buffers[leaf], device="meta")


def _tie_meta(streamed: StreamedModel) -> None:
    model = streamed.model
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "get_output_embeddings"):
        output = model.get_output_embeddings()
        if output is not None and output.weight.device.type != "meta":
            output.weight = model.get_input_embeddings().weight


def entry(streamed: StreamedModel, batch: torch.Tensor) -> tuple[torch.Tensor, dict[int, Recorded]]:
    """The hidden states entering block 0 and what the model hands each layer, for one batch."""
    import torch

    sink: dict[int, Recorded] = {}
    originals = list(streamed.layers)
    try:
        for index, layer in enumerate(originals):
            streamed.layers[index] = _Recorder(layer, index, sink, len(originals) - 1)
        with torch.inference_mode():
            streamed.model(batch.to(streamed.device), use_cache=False)
    except _EntryDone:
        pass
    finally:
        for index, layer in enumerate(originals):
            streamed.layers[index] = layer
    return sink[0].hidden, sink


def run_block(streamed: StreamedModel, index: int, hidden: torch.Tensor, recorded: Recorded) -> torch.Tensor:
    """Decoder layer ``index`` (loaded) applied to ``hidden`` with the arguments the model gave it."""
    import torch

    with torch.inference_mode():
        out = streamed.layers[index](hidden, *recorded.args, **recorded.kwargs)
    return out[0] if isinstance(out, tuple) else out


def exit_logits(streamed: StreamedModel, batch: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """The model's own forward after the blocks: final norm, lm_head and its logit processing."""
    import torch

    originals = list(streamed.layers)
    embeddings = streamed.model.get_input_embeddings()
    streamed.model.set_input_embeddings(_ZeroEmbedding(embeddings, final))
    try:
        for index, layer in enumerate(originals):
            streamed.layers[index] = _Replay(layer, final if index == len(originals) - 1 else None)
        with torch.inference_mode():
            logits: torch.Tensor = streamed.model(batch.to(streamed.device), use_cache=False).logits
    finally:
        for index, layer in enumerate(originals):
            streamed.layers[index] = layer
        streamed.model.set_input_embeddings(embeddings)
    return logits


class _ZeroEmbedding:
    """The embedding during the exit pass: zeros of the right shape (the replay overrides them)."""

    def __new__(cls, original: Any, like: torch.Tensor) -> Any:
        import torch

        class Zero(torch.nn.Module):
            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                return torch.zeros((*ids.shape, like.shape[-1]), dtype=like.dtype, device=like.device)

        module = Zero()
        module.weight = original.weight  # tied heads and configs read it; never multiplied
        return module
