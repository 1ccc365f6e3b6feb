"""Tier 1: token-level perplexity over non-overlapping windows, plus KL/top-1 against a baseline.

Windowing and averaging match Quark's ``quark.contrib.llm_eval.evaluation.ppl_eval`` (evaluate/ppl/data.py):
each window scores its ``seq_len - 1`` next-token predictions, and the perplexity is exp of the mean
negative log-likelihood. Windows are batched, and with a baseline each window pair is scored in one
pass (evaluate/ppl/kernels.py: KL, top-1, both NLLs) so no logits outlive their batch; the statistics
(evaluate/ppl/stats.py) stream per batch, llama.cpp's KL-divergence report among them. The pilot and the
estimate are in evaluate/ppl/pilot.py. The names below from those modules stay importable from here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from quark_ptq_eval.base.errors import QpeError, UsageError
from quark_ptq_eval.evaluate.context import RuntimeEstimate, ScoredText, TextScorer, TierInputs, TierOutcome
from quark_ptq_eval.evaluate.details import MetricNoise, PerplexityDetails
from quark_ptq_eval.evaluate.ppl.data import (  # noqa: F401 - re-exported
    CPU_TOKENS_PER_BATCH,
    LOGIT_BUDGET,
    MAX_AUTO_BATCH,
    auto_batch_size,
    eval_texts,
    token_windows,
)
from quark_ptq_eval.evaluate.ppl.kernels import (  # noqa: F401 - re-exported
    ROW_CHUNK_ELEMENTS,
    fast_nll,
    pair_stats,
    score_batch,
    synchronize,
    token_stats,
)
from quark_ptq_eval.evaluate.ppl.kld_report import kld_report_lines
from quark_ptq_eval.evaluate.ppl.kld_report import num as _num
from quark_ptq_eval.evaluate.ppl.pilot import FINISH_S, Clock, PilotTiming, pilot  # noqa: F401 - re-exported
from quark_ptq_eval.evaluate.ppl.pilot import estimate as estimate_runtime
from quark_ptq_eval.evaluate.ppl.stats import (  # noqa: F401 - re-exported
    Accumulator,
    distribution,
    kl_stats,
    llama_cpp_stats,
    mean_and_stderr,
    paired_delta,
    perplexity_stats,
    resolution_pct,
    sorted_values,
)
from quark_ptq_eval.runtime.loading import LoadedModel, load_model, require_finite  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from quark_ptq_eval.evaluate.eval_report import EvalReport

TASK = "perplexity"
# in-memory Tier 1 holds the weights as loaded plus start-up and a batch's logits: streamed when that exceeds the
# RAM free now (the in-memory path would be killed by the host; docs/streamed_tier1.md)
IN_MEMORY_OVERHEAD = 1.25
__all__ = [  # what other modules, the tests and the benches import from here
    "CPU_TOKENS_PER_BATCH", "FINISH_S", "LOGIT_BUDGET", "MAX_AUTO_BATCH", "ROW_CHUNK_ELEMENTS", "TASK", "Accumulator",
    "Clock", "PilotTiming", "PplPrepared", "auto_batch_size", "distribution", "eval_texts", "fast_nll",
    "fit_eval_window", "kl_stats", "llama_cpp_stats", "mean_and_stderr", "new_accumulator", "outcome_from",
    "paired_delta", "pair_stats", "perplexity_stats", "pilot", "prepare", "require_finite", "resolution_pct", "score",
    "score_batch", "section", "sorted_values", "synchronize", "text_outcome", "token_stats", "token_windows",
]
KLD_REPORT_DEFINITIONS = (
    "llama.cpp perplexity --kl-divergence's statistics (tools/perplexity/perplexity.cpp) over every scored "
    "token of these windows: ± are its per-token uncertainties (tokens taken as independent); dp = "
    "p_Q(label) - p_base(label) as a fraction; percentiles interpolate the sorted per-token values "
    "(kept as float32); KL is exact float64 over the full vocabulary (llama.cpp: 16-bit stored "
    "log-probabilities, terms below e^-16 dropped). llama.cpp scores only the second half of each "
    "window; this scores all seq_len - 1 predictions (Quark's ppl_eval)."
)


@dataclass
class PplPrepared:
    ctx: TierInputs
    quantized: LoadedModel
    baseline: LoadedModel | None
    windows: Any
    batch_size: int
    acc: Accumulator
    estimate: RuntimeEstimate
    pilot_s: float = 0.0
    next_batch: int = 1  # batch 0 was the pilot
    window_note: str | None = None  # why the default window was clamped to the model's context


class Prepared(Protocol):
    """What the tier's contract asks of a prepared run (in memory, or streamed: evaluate/ppl/stream.py)."""

    @property
    def estimate(self) -> RuntimeEstimate: ...


def prepare(ctx: TierInputs) -> Prepared:
    """Load the data and the model(s), score the first batch as a pilot, and estimate the rest; streamed
    one decoder block at a time when asked or when the models do not fit this host (evaluate/ppl/stream.py)."""
    why = stream_reason(ctx)
    if why:
        from quark_ptq_eval.evaluate.ppl import stream

        ctx.log(f"Tier 1 streamed one decoder block at a time: {why}")
        return stream.prepare(ctx, fit_eval_window)  # passed in: stream.py never imports this module
    return _prepare_in_memory(ctx)


def stream_reason(ctx: TierInputs) -> str | None:
    """Why Tier 1 streams (--stream-blocks, or the models it would load exceed the RAM free now), else None."""
    from quark_ptq_eval.base.safetensors_io import read_model_headers
    from quark_ptq_eval.evaluate.ppl.options import PplOptions
    from quark_ptq_eval.plan.host_memory import mem_available_bytes

    if ctx.options.of(PplOptions).stream_blocks:
        return "asked (--stream-blocks)"
    dirs = [ctx.model_dir] + ([ctx.options.baseline] if ctx.options.baseline else [])
    try:
        needed = sum(t.nbytes for d in dirs for t in read_model_headers(d).values())
    except Exception:  # noqa: BLE001 - unreadable headers: the load itself reports them
        return None
    free = mem_available_bytes()
    if free is None or needed * IN_MEMORY_OVERHEAD <= free:
        return None
    return (f"the models hold {needed / 2**30:.1f} GiB of weights and this host has {free / 2**30:.1f} GiB free; "
            "at most one block of each is held instead")


def _prepare_in_memory(ctx: TierInputs) -> PplPrepared:
    window_note = fit_eval_window(ctx)  # before anything loads: a window beyond the context is refused
    options, clock = ctx.options, Clock()
    texts = eval_texts(options.eval_data, options.eval_text_limit)  # fails before any model loads
    clock.lap("data")
    quantized = load_model(ctx.model_dir, options.device, options.trust_remote_code)
    ctx.log(
        f"loaded {ctx.model_dir} with the {quantized.loader} loader in {quantized.load_s:.1f} s ({quantized.loader_reason})"
    )
    clock.lap("load")
    seq_len = options.seq_len
    assert seq_len is not None  # fit_eval_window set it
    windows = token_windows(quantized.tokenizer, texts, seq_len, options.max_windows)
    clock.lap("tokenize")
    baseline = _load_baseline(ctx, texts, quantized.tokenizer) if options.baseline else None
    clock.lap("baseline load")
    vocab = quantized.model.get_output_embeddings().weight.shape[0]
    batch_size = options.batch_size or auto_batch_size(seq_len, vocab, quantized.device)
    acc = Accumulator()
    pilot_batches, pilot_s, per_batch_s = pilot(quantized, baseline, windows, batch_size, acc)
    clock.lap("pilot")
    estimate = estimate_runtime(ctx, quantized, baseline, windows, PilotTiming(batch_size, pilot_batches, per_batch_s), acc)
    estimate.parts = clock.parts
    return PplPrepared(ctx, quantized, baseline, windows, batch_size, acc, estimate, pilot_s, pilot_batches,
                       window_note=window_note)


def fit_eval_window(ctx: TierInputs) -> str | None:
    """Set ``ctx.options.seq_len`` within the model's context: the default clamped (the reason is
    returned and said), an explicit longer window refused naming the limit."""
    import dataclasses

    from quark_ptq_eval.base.context_window import fit_window, read_model_config
    from quark_ptq_eval.evaluate.options import DEFAULT_SEQ_LEN

    seq_len, note = fit_window(ctx.options.seq_len, DEFAULT_SEQ_LEN, read_model_config(ctx.model_dir), "--seq-len")
    ctx.options = dataclasses.replace(ctx.options, seq_len=seq_len)
    if note:
        ctx.log(f"Tier 1 window: {note}")
    return f"Tier 1 window of {seq_len} tokens: {note}." if note else None


def _load_baseline(ctx: TierInputs, texts: list[str], tokenizer: PreTrainedTokenizerBase) -> LoadedModel:
    assert ctx.options.baseline is not None  # only called with --baseline
    baseline = load_model(ctx.options.baseline, ctx.options.device, ctx.options.trust_remote_code)
    ctx.log(f"loaded baseline {ctx.options.baseline} in {baseline.load_s:.1f} s")
    sample = "\n\n".join(texts)[:20000]
    if baseline.tokenizer(sample).input_ids != tokenizer(sample).input_ids:
        raise UsageError(
            f"The baseline {ctx.options.baseline} tokenizes the text differently from the quantized model; "
            "per-token KL needs the same tokenizer."
        )
    return baseline


def score(prepared: Prepared) -> TierOutcome:
    if not isinstance(prepared, PplPrepared):
        from quark_ptq_eval.evaluate.ppl import stream

        assert isinstance(prepared, stream.StreamPrepared)
        return stream.score(prepared, outcome_from)
    ctx, acc, windows, size = prepared.ctx, prepared.acc, prepared.windows, prepared.batch_size
    baseline_model = prepared.baseline.model if prepared.baseline else None
    total = math.ceil(windows.shape[0] / size)
    scoring_started = time.perf_counter()
    for index in range(prepared.next_batch, total):
        score_batch(
            prepared.quantized.model,
            windows[index * size : (index + 1) * size].to(prepared.quantized.device),
            acc,
            baseline_model,
        )
        if ctx.progress is not None:  # a run: the terminal's bar with an ETA, milestone lines elsewhere
            ctx.progress("perplexity batches", index + 1, total)
        elif index % 10 == 0 or index == total - 1:
            ctx.log(f"perplexity: batch {index + 1}/{total}")
    seq_len = ctx.options.seq_len
    assert seq_len is not None  # fit_eval_window set it
    outcome = outcome_from(acc, seq_len, prepared)
    _vllm_cross_check(prepared, outcome, time.perf_counter() - scoring_started + prepared.pilot_s)
    return outcome


def _vllm_cross_check(prepared: PplPrepared, outcome: TierOutcome, hf_seconds: float) -> None:
    """--vllm-python: the same windows through that vLLM's prompt log-probabilities (evaluate/serving/ppl.py)."""
    from quark_ptq_eval.evaluate.serving.ppl import cross_check

    try:
        result = cross_check(prepared.ctx, prepared.windows, prepared.acc.window_nll, hf_seconds)
    except QpeError as exc:  # vLLM refuses the export, or never answers: Tier 1's own scores stand
        outcome.notes.append(f"HF vs vLLM was not checked: {exc.message}")
        return
    if result is not None:
        assert isinstance(outcome.details, PerplexityDetails)  # text_outcome's
        outcome.details.hf_vs_vllm = result.as_dict()
        outcome.notes.append(result.sentence())


class NamedLoader(Protocol):
    @property
    def loader(self) -> str: ...
    @property
    def loader_reason(self) -> str: ...


class ScoredRun(Protocol):
    """What outcome_from reads of a prepared run: PplPrepared, or compare's scoring against a cached baseline."""

    @property
    def batch_size(self) -> int: ...
    @property
    def quantized(self) -> NamedLoader: ...
    @property
    def baseline(self) -> NamedLoader | None: ...


def outcome_from(acc: Accumulator, seq_len: int, prepared: ScoredRun) -> TierOutcome:
    """The outcome of a prepared run's accumulated windows (text_outcome of what it names)."""
    base = prepared.baseline
    return text_outcome(ScoredText(acc, seq_len, prepared.batch_size,
                                   f"{prepared.quantized.loader} ({prepared.quantized.loader_reason})",
                                   base.loader if base is not None else None,
                                   getattr(prepared, "window_note", None)))


def new_accumulator() -> Accumulator:
    """An empty accumulator for ScoredText (compare fills it from its cached baseline)."""
    return Accumulator()


def text_outcome(scored: ScoredText) -> TierOutcome:
    """Perplexity (and with a baseline KL, top-1 and the paired delta) with its evidence for the verdict."""
    acc, seq_len = scored.acc, scored.seq_len
    stats = perplexity_stats(acc.window_nll, seq_len - 1)
    quantized = {TASK: {"perplexity": stats["perplexity"]}}
    details = PerplexityDetails(stats, seq_len, scored.batch_size, scored.loader,
                                "non-overlapping windows, mean next-token NLL (Quark ppl_eval's averaging)")
    # Sampling noise for the verdict: log(perplexity) is the mean NLL, so its standard error is the NLL's.
    noise = {"perplexity": MetricNoise(log_stderr=stats["nll_stderr"])}
    baseline = None
    if scored.baseline_loader is not None:
        base_stats = perplexity_stats(acc.base_window_nll, seq_len - 1)
        kl_sorted, dp_sorted = sorted_values(acc.kl_values), sorted_values(acc.dp_values)
        kl, paired = kl_stats(acc, kl_sorted) | scored.kl_extra, paired_delta(acc)
        quantized[TASK].update({"kl_divergence": kl["kl_divergence"], "top1_agreement": kl["top1_agreement"]})
        baseline = {TASK: {"perplexity": base_stats["perplexity"]}}
        details.baseline, details.kl, details.paired = base_stats, kl, paired
        details.kld_report = {**llama_cpp_stats(acc, kl_sorted, dp_sorted), "definitions": KLD_REPORT_DEFINITIONS}
        details.distribution = distribution(acc, kl_sorted=kl_sorted, dp_sorted=dp_sorted)
        details.loader += f"; baseline: {scored.baseline_loader}"
        noise["perplexity"] = MetricNoise(log_stderr=stats["nll_stderr"], baseline_log_stderr=base_stats["nll_stderr"],
                                          paired_log_delta=paired["delta_nll"], paired_log_stderr=paired["delta_nll_stderr"])
        noise["kl_divergence"] = MetricNoise(stderr=kl["kl_stderr"])
    details.noise, details.required = {TASK: noise}, {TASK: list(quantized[TASK])}
    details.baseline_cache = scored.baseline_cache
    return TierOutcome(
        quantized=quantized,
        baseline=baseline,
        directions={TASK: {"perplexity": False, "kl_divergence": False, "top1_agreement": True}},
        details=details,
        informational=("top1_agreement",),
        notes=[scored.window_note] if scored.window_note else [],
    )


def section(report: EvalReport) -> list[str]:
    """The report's Tier 1 section: perplexity with its interval, KL and top-1 agreement, the paired
    per-window delta, llama.cpp's KL-divergence block."""
    details = report.details
    if not isinstance(details.get("quantized"), dict) or "windows" not in details["quantized"]:
        return []
    lines = ["## Perplexity details", ""]
    for label in ("quantized", "baseline"):
        stats = details.get(label)
        if stats:
            lines.append(
                f"- {label}: perplexity {_num(stats['perplexity'])} (95 % CI {_num(stats['perplexity_ci95_low'])}"
                f"–{_num(stats['perplexity_ci95_high'])}; NLL {stats['mean_nll']:.6g} ± {stats['nll_stderr']:.3g} "
                f"nats s.e. over windows), {stats['tokens']:,} scored tokens in {stats['windows']} windows"
            )
    if "kl" in details:
        kl = details["kl"]
        lines[2:2] = _agreement_table(kl, details.get("paired"))
        lines.append(
            f"- KL(baseline ‖ quantized) per token: mean {kl['kl_divergence']:.6g} ± {kl['kl_stderr']:.3g} s.e., "
            f"p50 {kl['kl_p50']:.6g}, p90 {kl['kl_p90']:.6g}, p99 {kl['kl_p99']:.6g}, max {kl['kl_max']:.6g} nats"
        )
        lines.append(f"- top-1 agreement with the baseline: {100 * kl['top1_agreement']:.2f} %")
    if "paired" in details:
        paired = details["paired"]
        lines.append(
            f"- paired per-window NLL delta (quantized − baseline): {paired['delta_nll']:+.6g} nats, 95 % "
            f"interval {paired['delta_nll_ci95_low']:+.6g} … {paired['delta_nll_ci95_high']:+.6g} "
            f"({paired['noise'] or 'one window: no interval'}); perplexity ratio "
            f"{_num(paired['perplexity_ratio'])}"
        )
    lines.append(f"- loader: {details.get('loader')}")
    return [*lines, "", *per_block_lines(details.get("per_block")), *kld_report_lines(details.get("kld_report"))]


def per_block_lines(rows: list[dict[str, float]] | None) -> list[str]:
    """The streamed tier's chart of where the error enters: each block's own error (its quantized copy on the
    baseline's input), a bar per block, the distance of the hidden states after it, and the blocks adding most."""
    if not rows:
        return []
    top = max((r["own_error"] for r in rows if math.isfinite(r["own_error"])), default=0.0) or 1.0
    worst = sorted(rows, key=lambda r: r["own_error"], reverse=True)[:3]
    lines = ["## Where the error enters (per block)", "",
             "Own error: the block's quantized copy run on the baseline's input, ||Q(h) − B(h)|| / ||B(h)|| (mean "
             "over the first batch's tokens). Distance: ||h_q − h_base|| / ||h_base|| of the hidden states after "
             "the block (mean over every token), the error carried so far.", "",
             "| block | own error | | distance after |", "|---:|---:|:---|---:|"]
    for r in rows:
        own = r["own_error"]
        bar = "█" * max(0, round(30 * own / top)) if math.isfinite(own) else ""
        lines.append(f"| {int(r['block'])} | {own:.4g} | {bar} | {r['relative_distance']:.4g} |")
    lines += ["", "Blocks adding most: " + ", ".join(f"{int(r['block'])} ({r['own_error']:.3g})" for r in worst), ""]
    return lines


def _agreement_table(kl: dict[str, Any], paired: dict[str, Any] | None) -> list[str]:
    """KL quantiles and top-1 agreement at a glance (the bullets below say the same in words)."""
    delta = "-" if not paired else f"{paired['delta_nll']:+.4g} ± {paired['delta_nll_stderr']:.2g}"
    return [
        "| KL mean | KL p50 | KL p99 | KL max | top-1 agreement | paired ΔNLL (nats, ± s.e.) |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {kl['kl_divergence']:.4g} | {kl['kl_p50']:.4g} | {kl['kl_p99']:.4g} | {kl['kl_max']:.4g} | "
        f"{100 * kl['top1_agreement']:.2f} % | {delta} |",
        "",
    ]


class PerplexityTier(TextScorer):
    """Tier 1 as its registry row names it: the functions above, and what compare scores a text through."""

    prepare = staticmethod(prepare)
    score = staticmethod(score)
    section = staticmethod(section)
    eval_texts = staticmethod(eval_texts)
    token_windows = staticmethod(token_windows)
    auto_batch_size = staticmethod(auto_batch_size)
    new_accumulator = staticmethod(new_accumulator)
    text_outcome = staticmethod(text_outcome)
