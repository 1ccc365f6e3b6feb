"""The block streamer's forward, one part at a time over the same windows: entry, each block, exit.

The entry runs the model's own forward with every decoder layer replaced by a recorder, so the hidden states
entering block 0 and the arguments the model hands each layer (its causal or sliding-window mask, rotary
position embeddings) are the model's own; a block applies one real decoder layer (``runtime/blocks.py``
loaded it); the exit runs the model's own forward again with the layers replaced by a replay of the last
block's output (embedding zeroed: never read), so the final norm, lm_head and any logit scaling or
soft-capping are the model's own. Imported only where a model is streamed (it imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from quark_ptq_eval.runtime.blocks import StreamedModel


@dataclass
class Recorded:
    """What the model's forward handed one decoder layer (positional and keyword arguments)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    hidden: Any = None  # the hidden states it was given (kept for block 0 only: the entry's output)


class _EntryDone(Exception):
    """Raised by the last recorder: the entry pass has all it needs."""


class Recorder(torch.nn.Module):
    """Stands in for decoder layer ``index`` during the entry pass: keeps its arguments and passes the hidden
    states through unchanged (no layer's weights are needed); the last one stops the forward (the norm and
    lm_head after the blocks are not loaded)."""

    def __init__(self, original: torch.nn.Module, index: int, sink: dict[int, Recorded], last: int):
        super().__init__()
        self.index, self.sink, self.last = index, sink, last
        copy_layer_attributes(original, self)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kept = {k: v for k, v in kwargs.items() if k != "past_key_values"}
        self.sink[self.index] = Recorded(args, kept, hidden_states if self.index == 0 else None)
        if self.index == self.last:
            raise _EntryDone
        return hidden_states


class Replay(torch.nn.Module):
    """Stands in for a decoder layer during the exit pass: the last one returns the stored output."""

    def __init__(self, original: torch.nn.Module, final: torch.Tensor | None):
        super().__init__()
        self.final = final
        copy_layer_attributes(original, self)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states if self.final is None else self.final


class ZeroEmbedding(torch.nn.Module):
    """The embedding during the exit pass: zeros of the right shape (the replay overrides them)."""

    def __init__(self, original: torch.nn.Module, like: torch.Tensor):
        super().__init__()
        self.width, self.dtype, self.device = like.shape[-1], like.dtype, like.device
        self.weight = original.weight  # tied heads and configs read it; never multiplied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((*ids.shape, self.width), dtype=self.dtype, device=self.device)


def copy_layer_attributes(original: Any, module: Any) -> None:
    """The plain attributes the model's forward reads off its layers (``attention_type`` picks the mask)."""
    for name in ("attention_type", "layer_idx", "is_sliding", "sliding_window"):
        if hasattr(original, name):
            setattr(module, name, getattr(original, name))


def no_grad(inference: bool) -> Any:
    """``torch.inference_mode`` (the fastest), or ``no_grad`` where tensors made here are reused outside it (the
    load check replays a loaded module on captured inputs: an inference tensor cannot be updated there)."""
    return torch.inference_mode() if inference else torch.no_grad()


def entry(streamed: StreamedModel, batch: torch.Tensor, inference: bool = True) -> tuple[torch.Tensor, dict[int, Recorded]]:
    """The hidden states entering block 0 and what the model hands each layer, for one batch."""
    sink: dict[int, Recorded] = {}
    originals = list(streamed.layers)
    try:
        for index, layer in enumerate(originals):
            streamed.layers[index] = Recorder(layer, index, sink, len(originals) - 1)
        with no_grad(inference):
            streamed.model(batch.to(streamed.device), use_cache=False)
    except _EntryDone:
        pass
    finally:
        for index, layer in enumerate(originals):
            streamed.layers[index] = layer
    return sink[0].hidden, sink


def first_rows(recorded: Recorded, rows: int, batch: int) -> Recorded:
    """The arguments of a sub-batch: every tensor whose first dimension is the batch cut to ``rows``."""

    def cut(value: Any) -> Any:
        if hasattr(value, "shape") and value.ndim and value.shape[0] == batch:
            return value[:rows]
        if isinstance(value, tuple | list):
            return type(value)(cut(v) for v in value)
        return value

    return Recorded(tuple(cut(a) for a in recorded.args), {k: cut(v) for k, v in recorded.kwargs.items()})


def join_rows(first: Recorded, extra: Recorded, batch: int) -> Recorded:
    """The arguments of ``first``'s batch with ``extra``'s rows appended: tensors whose first dimension is the
    batch are concatenated, the rest (shared) kept."""
    def join(a: Any, b: Any) -> Any:
        if hasattr(a, "shape") and a.ndim and a.shape[0] == batch:
            return torch.cat([a, b.to(a.dtype)])
        if isinstance(a, tuple | list):
            return type(a)(join(x, y) for x, y in zip(a, b, strict=True))
        return a

    return Recorded(tuple(join(a, b) for a, b in zip(first.args, extra.args, strict=True)),
                    {k: join(v, extra.kwargs[k]) for k, v in first.kwargs.items()})


def run_block(streamed: StreamedModel, index: int, hidden: torch.Tensor, recorded: Recorded,
              inference: bool = True) -> torch.Tensor:
    """Decoder layer ``index`` (loaded) applied to ``hidden`` with the arguments the model gave it."""
    with no_grad(inference):
        out = streamed.layers[index](hidden, *recorded.args, **recorded.kwargs)
    return out[0] if isinstance(out, tuple) else out


def exit_logits(streamed: StreamedModel, batch: torch.Tensor, final: torch.Tensor, inference: bool = True) -> torch.Tensor:
    """The model's own forward after the blocks: final norm, lm_head and its logit processing."""
    originals = list(streamed.layers)
    embeddings = streamed.model.get_input_embeddings()
    streamed.model.set_input_embeddings(ZeroEmbedding(embeddings, final))
    try:
        for index, layer in enumerate(originals):
            streamed.layers[index] = Replay(layer, final if index == len(originals) - 1 else None)
        with no_grad(inference):
            logits: torch.Tensor = streamed.model(batch.to(streamed.device), use_cache=False).logits
    finally:
        for index, layer in enumerate(originals):
            streamed.layers[index] = layer
        streamed.model.set_input_embeddings(embeddings)
    return logits
