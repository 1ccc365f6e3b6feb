"""The load check one part at a time (embeddings, each decoder block, final norm and lm_head), for a model larger
than the RAM free: the same verdict as the whole-model probe (``loadcheck.py``), never the whole model in memory.

Both checkpoints are opened on meta by the block streamer (``runtime/blocks.py``: the export's parts go through
the loader the evaluator would pick, transformers' Quark integration or Quark's importer, so what is judged is
what that loader makes of the files). For each part in order:

1. the source's part is read and run on the source's own hidden states, every module's input and output
   captured (``replay.capture_during``); its output is the next part's input;
2. that part becomes the export's emulation in float32 (``emulate.py``: weights decoded from the files,
   activations quantized as exported) and each unit's emulated output is kept; the part is freed;
3. the export's part is read, each unit replayed on the captured inputs (``load_verdict.replay_units``) and judged
   (``load_judge.judge_units``); the export's part also runs on the export's own hidden states, for the logits
   and the greedy agreement; then it is freed.

Memory: the larger of one source part in float32 and its captures, plus one export part. The judgment of each part
is kept, its tensors are not: a part's verdict cannot depend on another's outputs (errors do not compound from
module to module: replay.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.validate.load_sample import BlockSample
from quark_ptq_eval.validate.report import CheckResult

if TYPE_CHECKING:
    import torch

    from quark_ptq_eval.runtime.block_pass import Recorded
    from quark_ptq_eval.runtime.blocks import StreamedModel
    from quark_ptq_eval.validate.load_judge import Judged
    from quark_ptq_eval.validate.registry import CheckInputs
    from quark_ptq_eval.validate.scale_ranges import Observation

# What the probe holds beyond one source part and its float32 emulation: torch, transformers and Quark imported,
# both models' skeletons on meta, one part's captures on the probe (measured: 1.0-1.1 GiB between parts).
STREAM_START_BYTES = int(1.6 * 2**30)


@dataclass
class _Side:
    """One checkpoint streamed: its hidden states on the probe and what its model hands each layer."""

    model: StreamedModel
    hidden: Any = None
    recorded: dict[int, Recorded] = field(default_factory=dict)
    logits: Any = None


def stream_bytes(ctx: CheckInputs) -> int:
    """RAM the streamed probe needs at its peak: the largest source part three times (stored in BF16 beside its
    float32 emulation), start-up. An export part is loaded once the source's is freed, and is no larger."""
    largest = max(_part_sizes(ctx, "source").values(), default=0)
    return 3 * largest + STREAM_START_BYTES


def _part_sizes(ctx: CheckInputs, side: str) -> dict[str, int]:
    """Bytes of each part the streamer would load (``blocks.split_parts``; a tied lm_head's exit loads the
    embedding too)."""
    from quark_ptq_eval.runtime.blocks import ENTRY, EXIT, split_parts, stack_path

    tensors = ctx.tensors(side) or {}
    parts = {part: sum(t.nbytes for t in infos)
             for part, infos in split_parts(tensors, stack_path(tensors) or "model.layers").items()}
    config = ctx.src_config if side == "source" else ctx.out_config
    if config.get("tie_word_embeddings") and not any("lm_head" in name for name in tensors):
        parts[EXIT] = parts.get(EXIT, 0) + parts.get(ENTRY, 0)
    return parts


def cut_parts(ctx: CheckInputs) -> set[str]:
    """The export's parts with a module past a truncated shard's cut (``CheckInputs.truncated``)."""
    from quark_ptq_eval.runtime.blocks import split_parts, stack_path

    lost = set(ctx.without_data)
    if not lost:
        return set()
    declared = ctx.declared_output
    return {part for part, infos in split_parts(declared, stack_path(declared) or "model.layers").items()
            if any(t.name in lost for t in infos)}


def cut_ends(ctx: CheckInputs) -> bool:
    """The embeddings or the head lost bytes to a truncated shard: nothing can run through the export."""
    from quark_ptq_eval.runtime.blocks import ENTRY, EXIT

    return bool(cut_parts(ctx) & {ENTRY, EXIT})


def probe_streamed(ctx: CheckInputs, result: CheckResult, tokenizer: Any, ids: torch.Tensor, trust: bool) -> None:
    """The load check's probe over streamed checkpoints: findings and notes into ``result``. The static activation
    scales are re-observed on the way, each calibration window run through the source's parts as they pass."""
    from quark_ptq_eval.runtime import blocks
    from quark_ptq_eval.validate.load_judge import Judged
    from quark_ptq_eval.validate.load_verdict import finish_probe
    from quark_ptq_eval.validate.scale_ranges import judge_observation, prepare_observation

    src = _Side(blocks.open_streamed(ctx.source, trust_remote_code=trust))
    out = _Side(blocks.open_streamed(ctx.quantized, trust_remote_code=trust, partial=bool(ctx.truncated)))
    cut = cut_parts(ctx)
    walk = _Walk(ctx, src, out, ids, Judged(), result.name)
    walk.observation = prepare_observation(ctx, {name for name, _ in src.model.model.named_modules()}, tokenizer, result)
    chosen = BlockSample(out.model.num_blocks, ctx.load_budget_s)
    started = time.perf_counter()
    walk.part(blocks.ENTRY)
    chosen.entry_took(time.perf_counter() - started)
    for index in range(out.model.num_blocks):
        if str(index) in cut:  # skipped on both sides, as a block the sample leaves out
            walk.skip()
            continue
        if not chosen.take(index):
            walk.skip()
            continue
        started = time.perf_counter()
        walk.part(str(index))
        chosen.timed(index, time.perf_counter() - started)
    walk.part(blocks.EXIT)
    walk.report_notes(result)
    if (note := chosen.note()) is not None:
        result.notes.append(note)
    if cut:
        blocks_cut = sorted(int(p) for p in cut)
        result.notes.append(f"{len(blocks_cut)} blocks ({blocks_cut[0]}-{blocks_cut[-1]}) not run: their bytes lie past "
                            "a truncated shard's cut (the layout check names it); each skipped on both sides")
    if chosen.note() is not None or cut:
        result.stats.update(blocks_replayed=out.model.num_blocks - len(chosen.skipped) - len(cut))
    if walk.observation is not None:
        judge_observation(walk.observation, walk.maxima, result)
    loader = out.model.loader
    result.stats.update(probe_tokens=int(ids.shape[1]), loader=loader, streamed_blocks=out.model.num_blocks)
    read = src.model.read_bytes + out.model.read_bytes
    result.notes.append(f"loaded with {loader} ({out.model.loader_reason}) one part at a time: "
                        f"{out.model.num_blocks} decoder blocks, {read / 2**30:.1f} GiB read from both checkpoints "
                        f"in {src.model.load_s + out.model.load_s:.1f} s")
    finish_probe(ctx, result, (out.logits, src.logits), loader, walk.judged, walk.owners)


@dataclass
class _Walk:
    ctx: CheckInputs
    src: _Side
    out: _Side
    ids: Any
    judged: Judged
    check: str  # the result's name (the load check's, as its registry row says)
    owners: int = 0
    notes: Counter[str] = field(default_factory=Counter)
    stats: Counter[str] = field(default_factory=Counter)
    observation: Observation | None = None  # static scales to re-observe, and the calibration windows
    windows: list[_Side] = field(default_factory=list)  # each window's pass through the source
    maxima: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    observation_cut: bool = False  # blocks were skipped: no scale is re-observed past the first skip

    def part(self, part: str) -> None:
        """Part ``part`` of both checkpoints captured, emulated, replayed and judged, then freed."""
        from quark_ptq_eval.validate import experts, replay
        from quark_ptq_eval.validate.emulate import emulate_outputs
        from quark_ptq_eval.validate.load_judge import judge_units

        src = self.src.model
        parts = _load(src, part)
        inside = _inside(src, part)
        captures, owners, _ = replay.capture_during(src.model, lambda: self._run(self.src, part, self.ids), inside)
        experts.route_every_expert(src.model, captures)
        self._observe(part, inside)  # on the source's weights, before they become the emulation
        roots = _roots(src, parts)
        emulated = emulate_outputs(self.ctx, src.model, owners, captures, roots)
        emulated.emulation.close()
        for root in roots:  # back to the source's dtype: a part's free keeps it for the next load of its tensors
            src.model.get_submodule(root).to(src.dtype)
        _free(src, parts)
        outputs = self._replay(part, owners, captures)
        self.owners += len(owners)
        self._merge(judge_units(outputs, captures, emulated))

    def skip(self) -> None:
        """A block left out of the sample (load_sample.py): both sides keep their hidden states. The calibration
        windows would reach the next blocks' scales off their path: scales are judged up to here only."""
        if self.observation is not None and not self.observation_cut:
            self.observation_cut = True
            kept = [s for s in self.observation.scales if self.maxima.get((s.module, s.side))]
            self.observation = dataclasses.replace(self.observation, scales=kept) if kept else None

    def _replay(self, part: str, owners: list[str], captures: dict[str, Any]) -> dict[Any, Any]:
        from quark_ptq_eval.validate import replay
        from quark_ptq_eval.validate.load_verdict import replay_units

        out = self.out.model
        parts = _load(out, part)
        exported = dict(out.model.named_modules())
        scratch = CheckResult(self.check)  # its notes are counted over the parts, then reported once
        units = replay_units(self.ctx, owners, captures, exported, scratch)
        outputs = replay.unit_outputs(units, captures, exported)
        self._run(self.out, part, self.ids)
        _free(out, parts)
        self.notes.update(scratch.notes)
        self.stats.update({k: v for k, v in scratch.stats.items() if isinstance(v, int)})
        return outputs

    def _observe(self, part: str, inside: Any) -> None:
        """Each calibration window through the source's part, the absmax each watched module sees kept per window
        (as the whole-model check's pass over the windows keeps it: ``scale_ranges._observe``)."""
        import torch

        from quark_ptq_eval.runtime import blocks
        from quark_ptq_eval.validate.scale_ranges import Watch

        if self.observation is None or self.observation_cut:
            return
        scales = [s for s in self.observation.scales if inside(s.module)]
        if part == blocks.EXIT and not scales:
            return  # no logits needed: the windows' pass ends here
        if not self.windows:
            self.windows = [_Side(self.src.model) for _ in self.observation.windows]
            self.maxima = {(s.module, s.side): [] for s in self.observation.scales}
        with torch.no_grad(), Watch(dict(self.src.model.model.named_modules()), scales) as watch:
            for side, ids in zip(self.windows, self.observation.windows, strict=True):
                self._run(side, part, ids)
                side.logits = None
                watch.window_done(self.maxima)

    def _run(self, side: _Side, part: str, ids: torch.Tensor) -> None:
        """The part's forward on the side's own hidden states (the entry: the token ids)."""
        from quark_ptq_eval.runtime import block_pass, blocks

        if part == blocks.ENTRY:
            side.hidden, side.recorded = block_pass.entry(side.model, ids, inference=False)
        elif part == blocks.EXIT:
            side.logits = block_pass.exit_logits(side.model, ids, side.hidden, inference=False).float().cpu()
        else:
            index = int(part)
            side.hidden = block_pass.run_block(side.model, index, side.hidden, side.recorded[index], inference=False)

    def _merge(self, part: Judged) -> None:
        self.judged.loader.update(part.loader)
        self.judged.fallback.update(part.fallback)
        self.judged.quantization.extend(part.quantization)
        self.judged.note = self.judged.note or part.note

    def report_notes(self, result: CheckResult) -> None:
        """The parts' notes once each (with how many parts gave it) and their counts summed."""
        for note, times in self.notes.items():
            result.notes.append(note if times == 1 else f"{note} (in each of {times} parts)")
        result.stats.update(self.stats)


def _load(streamed: StreamedModel, part: str) -> list[str]:
    from quark_ptq_eval.runtime import blocks

    parts = blocks.exit_parts(streamed) if part == blocks.EXIT else [part]
    for name in parts:
        blocks.load(streamed, name)
    return parts


def _free(streamed: StreamedModel, parts: list[str]) -> None:
    from quark_ptq_eval.base.allocator import release_freed_memory
    from quark_ptq_eval.runtime import blocks

    for name in parts:
        blocks.free(streamed, name)
    release_freed_memory()


def _inside(streamed: StreamedModel, part: str) -> Any:
    """Which module names belong to ``part``: a block's own; for the entry and exit every module outside the
    decoder stack that holds none of it (the model around the stack is no unit: its blocks are not loaded)."""
    from quark_ptq_eval.runtime import blocks

    stack = streamed.layers_path
    if part not in (blocks.ENTRY, blocks.EXIT):
        root = f"{stack}.{part}"
        return lambda name: name == root or name.startswith(root + ".")
    return lambda name: not (name == stack or name.startswith(stack + ".") or stack.startswith(name + "."))


def _roots(streamed: StreamedModel, parts: list[str]) -> list[str]:
    """The modules that hold the tensors ``parts`` loaded (what becomes the emulation)."""
    from quark_ptq_eval.runtime import blocks

    if parts[0] not in (blocks.ENTRY, blocks.EXIT):
        return [f"{streamed.layers_path}.{parts[0]}"]
    owners = {name.rpartition(".")[0] for part in parts for name in streamed.loaded.get(part, [])}
    return sorted(owner for owner in owners if not any(owner.startswith(o + ".") for o in owners if o != owner))
