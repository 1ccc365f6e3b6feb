"""Run a decoder from a block onwards on cached inputs: a layer in block b needs blocks b..N only.

The reference pass (nothing quantized) records, for every decoder block, the hidden states it
received and its other arguments (position embeddings, attention mask). A layer's measurement
then replays only the blocks from its own, then the final norm and the output head. When the
model's shape is not one we can replay exactly (checked against the reference pass itself), the
scan falls back to full forward passes: slower, never wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

REPLAY_TOLERANCE = 1e-3  # max |log-prob difference| between replay and the real forward


@dataclass
class Decoder:
    """The pieces of a causal LM the replay calls, found by structure, not by model type."""

    blocks: Any  # nn.ModuleList of decoder layers
    prefix: str  # module-name prefix of the blocks, e.g. "model.layers"
    norm: Any | None
    head: Any | None
    inputs: list[list[tuple[tuple[Any, ...], dict[str, Any]]]] = field(default_factory=list)  # [block][batch] -> (args, kwargs)
    final: list[Any] = field(default_factory=list)  # [batch] -> output of the last block (the head's input)

    def block_of(self, name: str) -> int | None:
        """Index of the block a module belongs to, None for modules outside every block (lm_head)."""
        if not name.startswith(self.prefix + "."):
            return None
        return int(name[len(self.prefix) + 1 :].split(".")[0])


def find_decoder(model: PreTrainedModel) -> Decoder | None:
    from torch import nn

    n_layers = getattr(model.config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n_layers and name.endswith("layers"):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            norm = getattr(parent, "norm", None)
            return Decoder(module, name, norm, model.get_output_embeddings())
    return None


def capture_inputs(decoder: Decoder, model: torch.nn.Module, batches: list[Any]) -> list[Any]:
    """Run the reference pass, recording each block's inputs; return float32 log-probs per batch."""
    import torch

    decoder.inputs = [[] for _ in decoder.blocks]

    def hook(index: int) -> Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def record(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            kept = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "use_cache")}
            decoder.inputs[index].append((args, kept))
        return record

    def record_final(_module: torch.nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        decoder.final.append(output[0] if isinstance(output, tuple) else output)

    decoder.final = []
    handles = [block.register_forward_pre_hook(hook(i), with_kwargs=True) for i, block in enumerate(decoder.blocks)]
    handles.append(decoder.blocks[-1].register_forward_hook(record_final))
    try:
        with torch.no_grad():
            return [log_probs(model(batch, use_cache=False).logits) for batch in batches]
    finally:
        for h in handles:
            h.remove()


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1)


def replay(decoder: Decoder, start: int, batch_index: int) -> torch.Tensor:
    """Log-probs of one batch, running blocks ``start``.. on the recorded input of block ``start``."""
    import torch

    if start >= len(decoder.blocks):
        hidden = decoder.final[batch_index]
    else:
        args, kwargs = decoder.inputs[start][batch_index]
        hidden = args[0] if args else kwargs["hidden_states"]
    with torch.no_grad():
        for j in range(start, len(decoder.blocks)):
            block_args, block_kwargs = decoder.inputs[j][batch_index]
            block_kwargs = {k: v for k, v in block_kwargs.items() if k != "hidden_states"}
            out = decoder.blocks[j](hidden, *block_args[1:], **block_kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        if decoder.norm is not None:
            hidden = decoder.norm(hidden)
        assert decoder.head is not None  # replay_matches refused a decoder without a head
        return log_probs(decoder.head(hidden))


def replay_matches(decoder: Decoder, reference: list[Any]) -> bool:
    """True when replaying from block 0 reproduces the reference pass (checked on the first batch)."""
    if decoder.head is None or not decoder.inputs or not decoder.inputs[0]:
        return False
    try:
        got = replay(decoder, 0, 0)
    except Exception:  # noqa: BLE001 - any model we cannot replay falls back to full passes
        return False
    return got.shape == reference[0].shape and float((got - reference[0]).abs().max()) < REPLAY_TOLERANCE
