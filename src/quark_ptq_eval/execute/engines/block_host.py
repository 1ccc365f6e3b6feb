"""The model Quark quantizes in the sequential engine: transformers' own class, holding one part at a time.

Quark's quantizer, algorithms and exporter take a whole ``PreTrainedModel`` and call ``model(batch)`` on the
calibration windows. For decoder block ``i`` the sequential engine hands them the real model object with:

- its decoder layers replaced by :class:`OffsetLayers`, which holds only block ``i`` and names it
  ``<layers_path>.<i>``: every pattern of the plan (exclusions, per-layer schemes) and every exported tensor name
  is the whole model's;
- its embedding replaced by a feeder that returns, for each window, the hidden states the whole model's block
  ``i`` received (recorded from block ``i - 1``), and its final norm and lm_head by pass-throughs.

The model's own forward still computes the causal mask and rotary embeddings from the window's shape, and block
``i`` runs as it runs inside the whole model. For the exit (final norm, lm_head) the layers are pass-throughs and
the last one returns the final hidden states.

Which hidden states feed the next block is Quark's own order (see :data:`PROPAGATION`): what the whole-model
run's calibration forward and its algorithm hand block ``i + 1``, recorded from block ``i``'s calls.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

# What Quark's whole-model algorithm feeds decoder block i + 1 during the algorithm step, as found in Quark 0.13:
# - smoothquant: ``awq/smooth.py`` ``_get_act_scale_and_input_feat`` runs the block once per window to collect
#   its activation statistics and makes those outputs (the block before smoothing) the next block's inputs:
#   the first pass over the windows;
# - gptq: ``algorithm/common.py`` ``BaseHessianProcessor.apply`` quantizes the block, then runs it again
#   (``block_forward``) and hands those outputs on: the last pass before calibration.
# After the algorithm, static activation scales are observed in one calibration forward of the whole model
# (observers on, fake quantization off: float activations), so the next block's calibration inputs are the block's
# outputs during that forward. An algorithm not in this table is refused by the engine (plan/engines/sequential.py).
PROPAGATION = {"smoothquant": "first", "gptq": "last"}


def window_key(ids: torch.Tensor) -> str:
    """A window's identity: its token ids (the same windows are fed in every phase)."""
    return hashlib.sha1(ids.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


@dataclass
class Feed:
    """The hidden states to hand block ``i`` for each window, one list per phase of Quark's run (the algorithm's
    pass first where there is one, then the calibration forward), and which window the model is running now."""

    keys: list[str]
    phases: list[list[torch.Tensor]]
    current: str = ""
    served: dict[str, int] = field(default_factory=dict)

    def next_for(self, key: str) -> torch.Tensor:
        """The hidden states of window ``key`` for the phase this call belongs to (each phase asks once)."""
        count = self.served.get(key, 0)
        self.served[key] = count + 1
        phase = self.phases[min(count, len(self.phases) - 1)]
        return phase[self.keys.index(key)]


class FeedEmbedding(torch.nn.Module):
    """Stands in for the embedding: returns the recorded hidden states entering the hosted block."""

    def __init__(self, feed: Feed):
        super().__init__()
        self.feed = feed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.feed.next_for(window_key(ids))


class PassThrough(torch.nn.Module):
    """Stands in for a part not hosted (final norm, lm_head, an earlier layer): returns its input."""

    def __init__(self, original: Any = None):
        super().__init__()
        from quark_ptq_eval.runtime.block_pass import copy_layer_attributes

        if original is not None:
            copy_layer_attributes(original, self)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


class FeedLayer(PassThrough):
    """The last decoder layer during the exit pass: returns the recorded final hidden states of the window."""

    def __init__(self, original: Any, feed: Feed):
        super().__init__(original)
        self.feed = feed

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.feed.next_for(self.feed.current)


class OffsetLayers(torch.nn.ModuleList):
    """The decoder layers seen with only block ``index`` present, registered under its own index.

    The model's forward slices its layers (``self.layers[: num_hidden_layers]``) and enumerates them: the slice is
    pass-throughs up to the hosted block, so a per-layer lookup (``config.layer_types[i]``) reads the block's own
    entry; Quark's algorithms index ``layers[0]`` and hook ``layers[:1]``: the hosted block."""

    def __init__(self, index: int | None, block: torch.nn.Module | None, originals: list[Any], tail: Any = None):
        super().__init__()
        self.index, self.originals, self.tail = index, originals, tail
        if block is not None and index is not None:
            self._modules[str(index)] = block

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice) and idx.start is None and (idx.stop is None or idx.stop >= len(self.originals)):
            return self._forward_list()[idx]  # the model's forward: ``self.layers[: config.num_hidden_layers]``
        return list(self._modules.values())[idx]  # Quark's ``layers[0]`` and ``layers[:1]``: the hosted block

    def _forward_list(self) -> list[torch.nn.Module]:
        """What the model's forward runs: pass-throughs, then the hosted block (or the exit's feeding layer)."""
        if self.tail is not None:
            return [*(PassThrough(o) for o in self.originals[:-1]), self.tail]
        assert self.index is not None
        return [*(PassThrough(o) for o in self.originals[: self.index]), self[0]]


@dataclass
class Calls:
    """Block outputs recorded while Quark ran, tagged with whether the model's forward made the call (the
    calibration forward) or the algorithm called the block itself."""

    outputs: list[tuple[bool, torch.Tensor]] = field(default_factory=list)
    in_forward: bool = False

    def next_phases(self, windows: int, algorithm: str | None) -> list[list[torch.Tensor]]:
        """The next block's feed, per phase of Quark's run (see PROPAGATION)."""
        own = [out for forward, out in self.outputs if not forward]
        calibration = [out for forward, out in self.outputs if forward]
        phases = []
        if algorithm:
            picked = own[:windows] if PROPAGATION[algorithm] == "first" else own[-windows:]
            phases.append(picked)
        if calibration:
            phases.append(calibration[-windows:])
        return phases


def _outputs(value: Any) -> torch.Tensor:
    out: torch.Tensor = value[0] if isinstance(value, tuple) else value
    return out.detach()


@contextmanager
def hosting(model: Any, layers_path: str, layers: Any, index: int | None, feed: Feed,
            exit_feed: bool = False) -> Iterator[Calls]:
    """``model`` holding block ``index`` (or, ``exit_feed``, the exit) for one Quark run; restored afterwards."""
    calls = Calls()
    originals = list(layers)
    inner = model.get_submodule(layers_path.rsplit(".", 1)[0]) if "." in layers_path else model
    saved = {"embed": model.get_input_embeddings(), "norm": getattr(inner, "norm", None),
             "head": model.get_output_embeddings()}
    handles = [model.register_forward_pre_hook(_window_hook(feed, calls), with_kwargs=True),
               model.register_forward_hook(_end_hook(calls), always_call=True)]
    if exit_feed:
        hosted = OffsetLayers(None, None, originals, tail=FeedLayer(originals[-1], feed))
    else:
        block = originals[index]  # type: ignore[index]
        hosted = OffsetLayers(index, block, originals)
        handles.append(block.register_forward_hook(
            lambda m, a, out: calls.outputs.append((calls.in_forward, _outputs(out)))))
        model.set_input_embeddings(FeedEmbedding(feed))
        if saved["norm"] is not None:
            inner.norm = PassThrough()
        model.set_output_embeddings(PassThrough())
    set_path(model, layers_path, hosted)
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()
        set_path(model, layers_path, layers)
        model.set_input_embeddings(saved["embed"])
        if saved["norm"] is not None:
            inner.norm = saved["norm"]
        if saved["head"] is not None:
            model.set_output_embeddings(saved["head"])


def set_path(model: Any, path: str, module: Any) -> None:
    owner, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, module)


def _window_hook(feed: Feed, calls: Calls) -> Any:
    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids: torch.Tensor = args[0] if args else kwargs["input_ids"]
        feed.current = window_key(ids)
        calls.in_forward = True
    return hook


def _end_hook(calls: Calls) -> Any:
    def hook(module: Any, args: Any, out: Any) -> None:
        calls.in_forward = False
    return hook
