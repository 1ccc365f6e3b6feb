"""Tier 1 streamed one decoder block at a time: a model larger than the host judged against its source.

The windows' hidden states are what is kept, not the models. For each chunk of windows (all of them
when their hidden states fit ``STATE_BUDGET``), both checkpoints advance together through the block
streamer (``runtime/blocks.py``): the entry (embeddings) gives each batch's hidden states and the
arguments the model hands its layers; then block 0 of the quantized model and block 0 of the
baseline are read (only their tensors), applied to every batch, and freed; then block 1, and so on;
then the exit (final norm, lm_head: the model's own forward) gives each batch's logits, scored by the
same kernels and statistics as the in-memory tier (``kernels.pair_stats``, ``stats.Accumulator``).
At most one block of each model is in memory, and each checkpoint is read once per chunk. A MoE block larger
than ``block_budget()`` is itself streamed: its routed experts read a group at a time (``runtime/expert_groups.py``).

The numbers are the in-memory tier's: the same transformers classes, the same loader's modules
(transformers' Quark integration or Quark's importer, mapped on meta and filled per block), the
same batches, in the model's dtype: equal to the in-memory Tier 1 (tests/evaluate/ppl/test_stream_tier1.py).
After each block the relative distance between the quantized and the baseline hidden states
(mean over tokens of ||h_q - h_b|| / ||h_b||) is recorded: ``details.per_block``, where the error enters.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.allocator import release_freed_memory
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.sizes import gb
from quark_ptq_eval.evaluate.context import RuntimeEstimate, TierInputs, TierOutcome, hardware_description
from quark_ptq_eval.evaluate.details import PerplexityDetails
from quark_ptq_eval.evaluate.ppl.data import auto_batch_size, eval_texts, token_windows
from quark_ptq_eval.evaluate.ppl.kernels import pair_stats, synchronize, token_stats
from quark_ptq_eval.evaluate.ppl.pilot import FINISH_S, Clock, resolution_warning
from quark_ptq_eval.evaluate.ppl.stats import Accumulator
from quark_ptq_eval.runtime import block_pass, blocks, expert_groups
from quark_ptq_eval.runtime.loading import require_finite, resolve_device

if TYPE_CHECKING:
    import torch

    from quark_ptq_eval.runtime.block_pass import Recorded
    from quark_ptq_eval.runtime.blocks import StreamedModel

STATE_BUDGET = 3 * 2**30  # bytes of hidden states held at once (both models); more windows go in chunks
OWN_ERROR_WINDOWS = 1  # windows a block's own error is measured on (each chunk's first): its tokens are the sample
BLOCK_SHARE = 4  # a block of one model may hold this fraction of the RAM free at the start: states and cache share the rest


@dataclass
class _Side:
    """One model's hidden states and per-layer arguments, per batch of the current chunk."""

    model: StreamedModel
    states: list[Any] = field(default_factory=list)
    recorded: list[dict[int, Recorded]] = field(default_factory=list)


@dataclass
class StreamPrepared:
    ctx: TierInputs
    quantized: StreamedModel
    baseline: StreamedModel | None
    windows: Any
    batch_size: int
    chunk_windows: int
    acc: Accumulator
    estimate: RuntimeEstimate
    pilot_s: float = 0.0
    window_note: str | None = None
    sides: list[_Side] = field(default_factory=list)
    # per block: [sum of per-token distances, tokens, sum of the block's own per-token error, tokens]
    distance: list[list[float]] = field(default_factory=list)
    next_block: int = 1  # the pilot ran chunk 0's entry and block 0
    block_budget: int = 2**62  # bytes one block of one model may hold; a MoE block over it runs by expert groups
    grouped: dict[int, int] = field(default_factory=dict)  # block -> its largest expert group, where one was used


def prepare(ctx: TierInputs, fit_eval_window: Callable[[TierInputs], str | None]) -> StreamPrepared:
    """Open both checkpoints on meta, tokenize, and run chunk 0's entry and block 0 as the pilot."""
    window_note = fit_eval_window(ctx)
    options, clock = ctx.options, Clock()
    texts = eval_texts(options.eval_data, options.eval_text_limit)
    clock.lap("data")
    device = resolve_device(options.device)
    quantized = blocks.open_streamed(ctx.model_dir, device, options.trust_remote_code)
    from transformers import AutoTokenizer  # after Quark's import, as runtime/loading.py: its scan is cached

    tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir, trust_remote_code=options.trust_remote_code)
    baseline = None
    if options.baseline:
        baseline = blocks.open_streamed(options.baseline, device, options.trust_remote_code)
        _same_tokenizer(ctx, texts, tokenizer)
    ctx.log(f"streaming {ctx.model_dir} block by block with the {quantized.loader} loader's modules "
            f"({quantized.num_blocks} blocks){' beside the baseline' if baseline else ''}")
    clock.lap("load")
    seq_len = options.seq_len
    assert seq_len is not None  # fit_eval_window set it
    windows = token_windows(tokenizer, texts, seq_len, options.max_windows)
    clock.lap("tokenize")
    vocab = int(quantized.model.get_output_embeddings().weight.shape[0])
    batch_size = options.batch_size or auto_batch_size(seq_len, vocab, device)
    hidden = int(quantized.model.config.hidden_size)
    per_window = seq_len * hidden * _itemsize(quantized.dtype) * (2 if baseline else 1) * 2  # states + a block's output
    chunk = max(batch_size, (STATE_BUDGET // max(1, per_window)) // batch_size * batch_size)
    prepared = StreamPrepared(ctx, quantized, baseline, windows, batch_size, min(chunk, windows.shape[0]),
                              Accumulator(), _placeholder(), window_note=window_note, block_budget=block_budget())
    started = time.perf_counter()
    _start_chunk(prepared, 0)
    entry_s = time.perf_counter() - started
    _block(prepared, 0)
    block_s = time.perf_counter() - started - entry_s
    prepared.pilot_s = entry_s + block_s
    clock.lap("pilot")
    prepared.estimate = _estimate(prepared, entry_s, block_s)
    prepared.estimate.parts = clock.parts
    return prepared


def block_budget() -> int:
    """Bytes one block of one model may hold at once: a share of the RAM free now (no limit where unknown)."""
    from quark_ptq_eval.plan.host_memory import mem_available_bytes

    free = mem_available_bytes()
    return free // BLOCK_SHARE if free else 2**62


def _placeholder() -> RuntimeEstimate:
    return RuntimeEstimate(tier="1 (ppl)", seconds=None, hardware="", model_bytes=0, data="", basis="")


def _itemsize(dtype: Any) -> int:
    import torch

    return int(torch.empty((), dtype=dtype or torch.float32).element_size())


def _same_tokenizer(ctx: TierInputs, texts: list[str], tokenizer: Any) -> None:
    from transformers import AutoTokenizer

    assert ctx.options.baseline is not None
    other = AutoTokenizer.from_pretrained(ctx.options.baseline, trust_remote_code=ctx.options.trust_remote_code)
    sample = "\n\n".join(texts)[:20000]
    if other(sample).input_ids != tokenizer(sample).input_ids:
        raise UsageError(f"The baseline {ctx.options.baseline} tokenizes the text differently from the quantized "
                         "model; per-token KL needs the same tokenizer.")


def _models(prepared: StreamPrepared) -> list[StreamedModel]:
    return [prepared.quantized] + ([prepared.baseline] if prepared.baseline else [])


def _chunk_batches(prepared: StreamPrepared, chunk: int) -> list[Any]:
    start = chunk * prepared.chunk_windows
    windows = prepared.windows[start : start + prepared.chunk_windows]
    size = prepared.batch_size
    return [windows[i : i + size] for i in range(0, windows.shape[0], size)]


def _start_chunk(prepared: StreamPrepared, chunk: int) -> None:
    """The entry of each model: embeddings read, every batch's block-0 input and layer arguments kept."""
    prepared.sides = []
    for model in _models(prepared):
        blocks.load(model, blocks.ENTRY)
        side = _Side(model)
        for batch in _chunk_batches(prepared, chunk):
            hidden, recorded = block_pass.entry(model, batch)
            side.states.append(hidden)
            side.recorded.append(recorded)
        blocks.free(model, blocks.ENTRY)
        prepared.sides.append(side)
    release_freed_memory()


def _prefetch(prepared: StreamPrepared, index: int) -> None:
    """The next block of each model asked of the disk while the current one computes (the kernel's
    readahead into the page cache, ``blocks.advise_part``: no process memory held for it)."""
    if index < prepared.quantized.num_blocks:
        for side in prepared.sides:
            blocks.advise_part(side.model, str(index))


def _block(prepared: StreamPrepared, index: int) -> None:
    """Block ``index`` of each model read, applied to every batch, freed. With a baseline, the distance of
    the hidden states after it, and the block's own error: the quantized block on the baseline's input of
    the chunk's first window, against the baseline block's output (where the error enters, not where it grew)."""
    plans = [expert_groups.plan_block(side.model, index, prepared.block_budget) for side in prepared.sides]
    if any(plans):
        _block_by_groups(prepared, index, plans)
        return
    for side in prepared.sides:
        blocks.load(side.model, str(index))
    _prefetch(prepared, index + 1)
    local = None
    for b in range(len(prepared.sides[0].states)):
        if b == 0 and len(prepared.sides) == 2:
            local = _quantized_with_own_error(prepared, index)
            base = prepared.sides[1]
            base.states[0] = block_pass.run_block(base.model, index, base.states[0], base.recorded[0][index])
            continue
        for side in prepared.sides:
            side.states[b] = block_pass.run_block(side.model, index, side.states[b], side.recorded[b][index])
    for side in prepared.sides:
        synchronize(side.model.device)
        blocks.free(side.model, str(index))
    if local is not None:
        _record_distance(prepared, index, local)
    release_freed_memory()


def _block_by_groups(prepared: StreamPrepared, index: int, plans: list[expert_groups.ExpertPlan | None]) -> None:
    """Block ``index`` where a model's block exceeds the budget: that model's routed experts read a group at a
    time (``runtime/expert_groups.py``), the other's block whole; one model's block at a time. The same jobs
    and the same own-error rows as ``_block``."""
    if index not in prepared.grouped:
        prepared.ctx.log(f"block {index}: over {gb(prepared.block_budget)} a model, its routed experts read "
                         f"{max(p.group_size for p in plans if p)} at a time")
    prepared.grouped[index] = max(p.group_size for p in plans if p)
    _prefetch(prepared, index + 1)
    local = None
    for number, (side, plan) in enumerate(zip(prepared.sides, plans, strict=True)):
        jobs = [(state, recorded[index]) for state, recorded in zip(side.states, side.recorded, strict=True)]
        rows = None
        if number == 0 and len(prepared.sides) == 2:  # before the baseline advances: its input is the extra rows
            joined, arguments, rows = _own_error_job(prepared, index)
            jobs[0] = (joined, arguments)
        if plan is None:
            blocks.load(side.model, str(index))
            outputs = [block_pass.run_block(side.model, index, state, recorded) for state, recorded in jobs]
            synchronize(side.model.device)
            blocks.free(side.model, str(index))
        else:
            outputs = expert_groups.run_block(side.model, plan, jobs)
        if rows is not None:
            local, outputs[0] = outputs[0][rows:], outputs[0][:rows]
        side.states = outputs
        release_freed_memory()
    if local is not None:
        _record_distance(prepared, index, local)


def _own_error_job(prepared: StreamPrepared, index: int) -> tuple[torch.Tensor, Recorded, int]:
    """The quantized model's first batch with the baseline's first window(s) as extra rows, their arguments,
    and the batch's row count (``_quantized_with_own_error``)."""
    import torch

    quantized, base = prepared.sides
    rows = quantized.states[0].shape[0]
    joined = torch.cat([quantized.states[0], base.states[0][:OWN_ERROR_WINDOWS].to(quantized.states[0].dtype)])
    extra = block_pass.first_rows(base.recorded[0][index], OWN_ERROR_WINDOWS, base.states[0].shape[0])
    return joined, block_pass.join_rows(quantized.recorded[0][index], extra, rows), rows


def _quantized_with_own_error(prepared: StreamPrepared, index: int) -> torch.Tensor:
    """The quantized block on the first batch, with the baseline's first window(s) as extra rows of the same
    forward (one weight dequantization, not two: on a CPU that is most of an FP8 block's time). Each row of a
    decoder layer is computed on its own (per-row norms and attention, GEMMs reduce along the hidden size),
    so the batch's rows are what a forward without the extra rows gives (the tests hold it to the in-memory
    tier). Returns the extra rows' output: the block's own error on the baseline's input."""
    quantized = prepared.sides[0]
    joined, arguments, rows = _own_error_job(prepared, index)
    out = block_pass.run_block(quantized.model, index, joined, arguments)
    quantized.states[0] = out[:rows]
    return out[rows:]


def _relative(q: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """||q - b|| / ||b|| per token (float32)."""
    import torch

    qf, bf = q.float(), b.float()
    ratio: torch.Tensor = torch.linalg.vector_norm(qf - bf, dim=-1) / torch.linalg.vector_norm(bf, dim=-1).clamp_min(1e-30)
    return ratio


def _record_distance(prepared: StreamPrepared, index: int, local: torch.Tensor) -> None:
    """Sums over tokens: the distance after block ``index`` (every batch), its own error (the first batch)."""
    while len(prepared.distance) <= index:
        prepared.distance.append([0.0, 0.0, 0.0, 0.0])
    quantized, base = prepared.sides
    row = prepared.distance[index]
    for q, b in zip(quantized.states, base.states, strict=True):
        ratio = _relative(q, b)
        row[0] += float(ratio.sum())
        row[1] += ratio.numel()
    own = _relative(local, base.states[0][:OWN_ERROR_WINDOWS])
    row[2] += float(own.sum())
    row[3] += own.numel()


def _exit(prepared: StreamPrepared, chunk: int) -> None:
    """Final norm and lm_head of each model (the model's own forward), then the same scoring as in memory."""
    batches = _chunk_batches(prepared, chunk)
    logits_by_side: list[list[Any]] = []
    for side in prepared.sides:
        parts = blocks.exit_parts(side.model)
        for part in parts:
            blocks.load(side.model, part)
        logits_by_side.append([block_pass.exit_logits(side.model, batch, side.states[b]) for b, batch in enumerate(batches)])
        side.states = []
        for part in parts:
            blocks.free(side.model, part)
    for b, batch in enumerate(batches):
        _score(prepared, batch, [side_logits[b] for side_logits in logits_by_side])
    release_freed_memory()


def _score(prepared: StreamPrepared, batch: torch.Tensor, logits: list[torch.Tensor]) -> None:
    """As ``kernels.score_batch``: the logits of all but the last position against the next tokens."""
    quantized = logits[0][:, :-1]
    labels = batch[:, 1:].to(quantized.device)
    if len(logits) == 1:
        require_finite(quantized, "The quantized model")
        prepared.acc.add(token_stats(quantized, labels), batch.shape[0])
        return
    base = logits[1][:, :-1].to(quantized.device)
    if base.shape[-1] != quantized.shape[-1]:
        raise UsageError("The baseline's vocabulary differs from the quantized model's: KL is undefined.")
    prepared.acc.add(pair_stats(quantized, labels, base), batch.shape[0])


def _chunks(prepared: StreamPrepared) -> int:
    return int(math.ceil(prepared.windows.shape[0] / prepared.chunk_windows))


def _estimate(prepared: StreamPrepared, entry_s: float, block_s: float) -> RuntimeEstimate:
    """The pilot's block 0 (read and applied to every batch of the chunk) times the blocks left, for
    each chunk; the exit timed as one more block scaled by its bytes."""
    quantized, ctx = prepared.quantized, prepared.ctx
    blocks_left, chunks = quantized.num_blocks - 1, _chunks(prepared)
    exit_bytes = sum(m.part_bytes(blocks.EXIT) for m in _models(prepared))
    block_bytes = max(1, sum(m.block_bytes(0) for m in _models(prepared)))
    exit_s = block_s * max(1.0, exit_bytes / block_bytes)
    per_chunk = entry_s + block_s * quantized.num_blocks + exit_s
    seconds = block_s * blocks_left + exit_s + per_chunk * (chunks - 1)
    n, seq = prepared.windows.shape
    models = "quantized + baseline" if prepared.baseline else "quantized"
    return RuntimeEstimate(
        tier="1 (ppl)",
        seconds=seconds,
        hardware=hardware_description(quantized.device),
        model_bytes=sum(m.part_bytes(p) for m in _models(prepared) for p in m.parts),
        data=f"{n * seq:,} tokens in {n} windows of {seq}",
        basis=(f"streamed block by block ({quantized.num_blocks} blocks, {chunks} chunk(s) of up to "
               f"{prepared.chunk_windows} window(s)): pilot block 0 of the {models} model(s) took {block_s:.2f} s "
               f"(read and applied to every batch); {blocks_left} block(s) and the exit left"),
        warning=resolution_warning(ctx, prepared.acc, n) if prepared.acc.window_nll else None,
        threshold_s=ctx.options.confirm_above_s,
        finish_s=FINISH_S,
    )


def score(prepared: StreamPrepared, outcome_from: Callable[[Accumulator, int, StreamPrepared], TierOutcome]) -> TierOutcome:
    """The rest of chunk 0's blocks, its exit, then every further chunk whole; the outcome as in memory."""
    ctx = prepared.ctx
    total = prepared.quantized.num_blocks
    for chunk in range(_chunks(prepared)):
        if chunk:
            _start_chunk(prepared, chunk)
        for index in range(prepared.next_block if chunk == 0 else 0, total):
            _block(prepared, index)
            _progress(ctx, chunk, index, total)
        _exit(prepared, chunk)
    seq_len = ctx.options.seq_len
    assert seq_len is not None
    outcome = outcome_from(prepared.acc, seq_len, prepared)
    assert isinstance(outcome.details, PerplexityDetails)
    outcome.details.method += "; streamed one decoder block at a time (runtime/blocks.py)"
    if prepared.distance:
        outcome.details.per_block = per_block_rows(prepared.distance)
    read = sum(m.read_bytes for m in _models(prepared))
    read_s, load_s = (sum(getattr(m, k) for m in _models(prepared)) for k in ("read_s", "load_s"))
    outcome.notes.append(f"Streamed block by block: {read / 2**30:.2f} GiB read from the checkpoints in {read_s:.1f} s "
                         f"({load_s:.1f} s with the loader's own step; {_chunks(prepared)} pass(es)); at most one "
                         "block of each model was in memory.")
    if prepared.grouped:
        outcome.notes.append(f"{len(prepared.grouped)} MoE block(s) exceeded {gb(prepared.block_budget)} a "
                             f"model: their routed experts were read up to {max(prepared.grouped.values())} at a time "
                             "(runtime/expert_groups.py).")
    return outcome


def _progress(ctx: TierInputs, chunk: int, index: int, total: int) -> None:
    if ctx.progress is not None:
        ctx.progress("streamed blocks", index + 1, total)
    elif index % 10 == 0 or index == total - 1:
        ctx.log(f"perplexity (streamed, chunk {chunk + 1}): block {index + 1}/{total}")


def per_block_rows(distance: list[list[float]]) -> list[dict[str, float]]:
    """Per block: the relative distance after it, what that grew by over the block before, and the block's
    own error (its quantized copy on the baseline's input: the error this block alone adds)."""
    rows, before = [], 0.0
    for index, (total, count, own, own_count) in enumerate(distance):
        value = total / count if count else float("nan")
        rows.append({"block": index, "relative_distance": value, "added": value - before,
                     "own_error": own / own_count if own_count else float("nan")})
        before = value
    return rows
