"""Tier 1: token-level perplexity over non-overlapping windows, plus KL/top-1 against a baseline.

Windowing and averaging match Quark's ``quark.contrib.llm_eval.evaluation.ppl_eval``: the text is
joined with blank lines, tokenized once, cut into ``len // seq_len`` full windows (the tail is
dropped), each window scores its ``seq_len - 1`` next-token predictions, and the perplexity is
exp of the mean negative log-likelihood. Windows are batched, and with a baseline each window
pair is scored in one pass (KL, top-1, both NLLs) so no logits outlive their batch.

Where the time goes (bench/README.md): the model's forward pass. Without a baseline a token's NLL
is ``logsumexp(logits) - logits[label]`` in float32 (no log-softmax tensor is written, no float64
copy); only a row that is not finite that way (logits near the float32 limit) is redone in
float64. With a baseline the KL needs both full distributions and stays in float64.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from quark_ptq_eval.base.errors import QpeError, UsageError
from quark_ptq_eval.evaluate.context import RuntimeEstimate, TierContext, TierOutcome, hardware_description
from quark_ptq_eval.evaluate.verdict import BEYOND_NOISE, WITHIN_NOISE, Z95, safe_exp, safe_expm1
from quark_ptq_eval.validate.loading import LoadedModel, load_model, require_finite

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

TASK = "perplexity"
LOGIT_BUDGET = 64 * 2**20  # logits elements per batch when --batch-size is not given
MAX_AUTO_BATCH = 8
FINISH_S = 1.0  # statistics, chart and report files after the last batch (bench/bench_estimates.py)
CPU_TOKENS_PER_BATCH = 2048  # on a CPU larger batches only add cache misses (bench/README.md)
ROW_CHUNK_ELEMENTS = 8 * 2**20  # float64 elements of the vocabulary softmax handled at once (memory bound)


# ---------------------------------------------------------------- data


def eval_texts(eval_data: Path | None, limit: int | None = None) -> list[str]:
    """Documents to score: a local text source, or wikitext-2's test split through `datasets`."""
    if eval_data is not None:
        from quark_ptq_eval.base.textdata import load_texts

        texts = load_texts(eval_data)
    else:
        texts = _wikitext2_test()
    return texts[:limit] if limit else texts


def _wikitext2_test() -> list[str]:
    try:
        import datasets

        return list(datasets.load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1", split="test")["text"])
    except Exception as exc:  # noqa: BLE001 - offline, missing cache, hub errors: all mean "no wikitext"
        raise UsageError(
            f"wikitext-2 could not be loaded through `datasets` ({type(exc).__name__}); "
            "pass --eval-data PATH with a local .txt, .jsonl or .parquet text instead."
        ) from None


def token_windows(tokenizer: PreTrainedTokenizerBase, texts: list[str], seq_len: int,
                  max_windows: int | None = None) -> torch.Tensor:
    """``[n, seq_len]`` non-overlapping windows of the joined text (Quark's tokenization)."""
    ids: torch.Tensor = tokenizer("\n\n".join(texts), return_tensors="pt", verbose=False).input_ids[0]
    count = ids.numel() // seq_len
    if max_windows:
        count = min(count, max_windows)
    if count == 0:
        raise UsageError(
            f"The evaluation text has {ids.numel()} tokens, fewer than one window of --seq-len {seq_len}; "
            "give more text or a smaller --seq-len."
        )
    return ids[: count * seq_len].view(count, seq_len)


def auto_batch_size(seq_len: int, vocab: int, device: str) -> int:
    """Windows per forward pass: bounded by the logits' memory; on a CPU also by ~2k tokens, where a
    batch of 2048-token windows ran ~15-20 % slower per window than one window at a time."""
    gpu = device.startswith("cuda")
    budget = LOGIT_BUDGET * (4 if gpu else 1)
    size = min(MAX_AUTO_BATCH, budget // max(1, seq_len * vocab))
    if not gpu:
        size = min(size, CPU_TOKENS_PER_BATCH // max(1, seq_len))
    return max(1, size)


# ---------------------------------------------------------------- scoring


@dataclass
class Accumulator:
    """Per-window mean NLLs and KLs (for standard errors) and per-token KL values (for percentiles)."""

    window_nll: list[float] = field(default_factory=list)
    base_window_nll: list[float] = field(default_factory=list)
    window_kl: list[float] = field(default_factory=list)
    kl_values: list[Any] = field(default_factory=list)  # float64 tensors, one per batch
    top1_matches: int = 0
    tokens: int = 0
    windows: int = 0


def score_batch(model: torch.nn.Module, batch: torch.Tensor, acc: Accumulator,
                baseline: torch.nn.Module | None = None) -> None:
    """Score one batch of windows; with ``baseline``, also the same windows under it (one pass)."""
    import torch

    with torch.inference_mode():
        logits = model(batch).logits[:, :-1]
        require_finite(logits, "The quantized model")
        labels = batch[:, 1:].to(logits.device)
        base_logits = None
        if baseline is not None:
            base_logits = baseline(batch.to(_device_of(baseline))).logits[:, :-1].to(logits.device)
            require_finite(base_logits, "The baseline model")
            if base_logits.shape[-1] != logits.shape[-1]:
                raise UsageError(
                    "The baseline's vocabulary differs from the quantized model's: KL is undefined."
                )
        stats = token_stats(logits, labels, base_logits)
    acc.window_nll.extend(stats["nll"].mean(dim=1).tolist())
    if base_logits is not None:
        acc.base_window_nll.extend(stats["base_nll"].mean(dim=1).tolist())
        acc.window_kl.extend(stats["kl"].mean(dim=1).tolist())
        acc.kl_values.append(stats["kl"].reshape(-1).cpu())
        acc.top1_matches += int(stats["top1"].sum())
    acc.tokens += labels.numel()
    acc.windows += batch.shape[0]


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def token_stats(logits: torch.Tensor, labels: torch.Tensor,
                base_logits: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-token NLL (and with a baseline: its NLL, KL(baseline || quantized), top-1 match), ``[B, T]``.

    Log space in float64, in row chunks: finite logits of any size (a broken model's 1e30) give
    finite NLLs and KLs, where exp() or a float32 difference of log-probabilities would overflow.
    """
    import torch

    if base_logits is None:
        nll = fast_nll(logits, labels)
        if nll is not None:
            return {"nll": nll}
    vocab = logits.shape[-1]
    rows, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1, 1)
    base_rows = None if base_logits is None else base_logits.reshape(-1, vocab)
    step = max(1, ROW_CHUNK_ELEMENTS // vocab)
    parts: dict[str, list[Any]] = {"nll": [], "base_nll": [], "kl": [], "top1": []}
    for start in range(0, rows.shape[0], step):
        chunk = slice(start, start + step)
        log_q = torch.log_softmax(rows[chunk].double(), dim=-1)
        parts["nll"].append(-log_q.gather(1, flat_labels[chunk]).squeeze(1))
        if base_rows is None:
            continue
        log_b = torch.log_softmax(base_rows[chunk].double(), dim=-1)
        parts["base_nll"].append(-log_b.gather(1, flat_labels[chunk]).squeeze(1))
        parts["top1"].append(log_q.argmax(-1) == log_b.argmax(-1))
        # In place (two fewer full-vocabulary float64 tensors). xlogy-style: a token the baseline
        # gives probability 0 adds 0, not 0 * inf = NaN; a NaN here can come from nothing else
        # (require_finite ran on both logits).
        terms = log_b.exp().mul_(log_b.sub_(log_q)).nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)
        parts["kl"].append(terms.sum(dim=-1).clamp_min(0.0))  # clamp: rounding just below 0
    return {k: torch.cat(v).view(labels.shape) for k, v in parts.items() if v}


def fast_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """Per-token NLL ``[B, T]`` (float64 values) as ``logsumexp - logits[label]`` in float32, in row
    chunks; None when a value is not finite that way (the caller redoes it in float64).

    Equal to the float64 log-softmax to ~1e-6 nats per token (float32 rounding of the logsumexp),
    and ~1e-7 relative on a perplexity (tests/test_eval_ppl.py)."""
    import torch

    step = max(1, ROW_CHUNK_ELEMENTS // logits.shape[-1])
    parts = []
    for window, window_labels in zip(logits, labels.unsqueeze(-1), strict=True):  # views: no copy of the logits
        for start in range(0, window.shape[0], step):
            rows = window[start : start + step].float()
            picked = rows.gather(1, window_labels[start : start + step]).squeeze(1)
            parts.append(torch.logsumexp(rows, dim=-1) - picked)
    nll = torch.cat(parts)
    if not bool(torch.isfinite(nll).all()):
        return None
    return nll.double().view(labels.shape)


def synchronize(device: str) -> None:
    """Wait for queued device work, so a clock read after it measures the work, not its launch."""
    import torch

    if str(device).startswith("cuda"):  # ROCm builds answer through torch.cuda too
        torch.cuda.synchronize(device)
    elif str(device) != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


# ---------------------------------------------------------------- statistics


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error over windows (tokens inside a window are correlated)."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, math.nan
    return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in values) / (n - 1) / n)


def perplexity_stats(window_nll: list[float], tokens_per_window: int) -> dict[str, float]:
    """Perplexity (exp of the mean NLL: inf when that overflows), the NLL's standard error, a 95 % interval."""
    n = len(window_nll)
    mean_nll, stderr = mean_and_stderr(window_nll)
    return {
        "perplexity": safe_exp(mean_nll),
        "mean_nll": mean_nll,
        "nll_stderr": stderr,
        "perplexity_ci95_low": safe_exp(mean_nll - Z95 * stderr) if n > 1 else math.nan,
        "perplexity_ci95_high": safe_exp(mean_nll + Z95 * stderr) if n > 1 else math.nan,
        "tokens": n * tokens_per_window,
        "windows": n,
    }


def kl_stats(acc: Accumulator) -> dict[str, float]:
    import torch

    kl = torch.cat(acc.kl_values)
    quantiles = torch.quantile(
        kl[:: max(1, kl.numel() // 2**20)], torch.tensor([0.5, 0.9, 0.99], dtype=torch.double)
    )
    mean, stderr = mean_and_stderr(acc.window_kl)
    return {
        "kl_divergence": float(kl.mean()),
        "kl_stderr": stderr,  # over per-window means: the windows are the independent samples
        "kl_p50": float(quantiles[0]),
        "kl_p90": float(quantiles[1]),
        "kl_p99": float(quantiles[2]),
        "kl_max": float(kl.max()),
        "top1_agreement": acc.top1_matches / kl.numel(),
    }


def distribution(acc: Accumulator, bins: int = 40) -> dict[str, Any]:
    """What the report's chart draws: every window's paired NLL delta (quantized - baseline) and a
    histogram of the per-token KL over log-spaced bins (at most 8 decades below the largest)."""
    import torch

    kl = torch.cat(acc.kl_values)
    positive = kl[kl > 0]
    deltas = [q - b for q, b in zip(acc.window_nll, acc.base_window_nll, strict=True)]
    hist: dict[str, Any] = {"edges": [], "counts": [], "zero": int(kl.numel())}
    if positive.numel():
        high = float(positive.max())
        low = max(float(positive.min()), high * 1e-8)
        high = max(high, low * 10)  # one value: still a bin with a width
        edges = torch.logspace(math.log10(low), math.log10(high), bins + 1, dtype=torch.double)
        edges[0], edges[-1] = low, high  # 10 ** log10(x) can miss x by a rounding: the extremes stay in
        counts = torch.histogram(positive.clamp(low, high), bins=edges).hist
        hist = {"edges": edges.tolist(), "counts": [int(c) for c in counts], "zero": int(kl.numel() - positive.numel())}
    return {"window_nll_delta": deltas, "token_kl_histogram": hist}


def paired_delta(acc: Accumulator) -> dict[str, Any]:
    """Per-window NLL difference quantized - baseline: mean, paired standard error, 95 % interval."""
    diffs = [q - b for q, b in zip(acc.window_nll, acc.base_window_nll, strict=True)]
    mean, se = mean_and_stderr(diffs)
    low, high = mean - Z95 * se, mean + Z95 * se
    within = len(diffs) > 1 and low <= 0 <= high
    return {
        "delta_nll": mean,
        "delta_nll_stderr": se,
        "delta_nll_ci95_low": low,
        "delta_nll_ci95_high": high,
        "perplexity_ratio": safe_exp(mean),
        "perplexity_ratio_ci95_low": safe_exp(low),
        "perplexity_ratio_ci95_high": safe_exp(high),
        "noise": WITHIN_NOISE if within else (BEYOND_NOISE if len(diffs) > 1 else None),
    }


def resolution_pct(window_values: list[float], windows: int) -> float | None:
    """Half-width, in percent of perplexity, of the 95 % interval ``windows`` windows would give,
    projected from the spread of ``window_values`` (per-window NLLs or paired NLL differences)."""
    if len(window_values) < 2:
        return None
    _, se = mean_and_stderr(window_values)
    sd = se * math.sqrt(len(window_values))
    return 100.0 * safe_expm1(Z95 * sd / math.sqrt(windows))


# ---------------------------------------------------------------- the tier


@dataclass
class PplPrepared:
    ctx: TierContext
    quantized: LoadedModel
    baseline: LoadedModel | None
    windows: Any
    batch_size: int
    acc: Accumulator
    estimate: RuntimeEstimate
    pilot_s: float = 0.0
    next_batch: int = 1  # batch 0 was the pilot
    window_note: str | None = None  # why the default window was clamped to the model's context


class Clock:
    """Seconds per piece of the preparation, for the estimate's breakdown."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, piece: str) -> None:
        now = time.perf_counter()
        self.parts[piece] = self.parts.get(piece, 0.0) + now - self._last
        self._last = now


def prepare(ctx: TierContext) -> PplPrepared:
    """Load the data and the model(s), score the first batch as a pilot, and estimate the rest."""
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
    pilot_batches, pilot_s, per_batch_s = _pilot(quantized, baseline, windows, batch_size, acc)
    clock.lap("pilot")
    estimate = _estimate(ctx, quantized, baseline, windows, PilotTiming(batch_size, pilot_batches, per_batch_s), acc)
    estimate.parts = clock.parts
    return PplPrepared(ctx, quantized, baseline, windows, batch_size, acc, estimate, pilot_s, pilot_batches,
                       window_note=window_note)


def fit_eval_window(ctx: TierContext) -> str | None:
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


def _pilot(quantized: LoadedModel, baseline: LoadedModel | None, windows: torch.Tensor, batch_size: int,
           acc: Accumulator) -> tuple[int, float, float]:
    """Score up to two batches: batch 0 warms up (first-call allocations, kernel selection), batch 1,
    when there is one, is timed. Returns (batches, their seconds, seconds of the last)."""
    pilot_batches, pilot_s, per_batch_s = min(2, math.ceil(windows.shape[0] / batch_size)), 0.0, 0.0
    for index in range(pilot_batches):
        synchronize(quantized.device)
        started = time.perf_counter()
        score_batch(
            quantized.model,
            windows[index * batch_size : (index + 1) * batch_size].to(quantized.device),
            acc,
            baseline.model if baseline else None,
        )
        synchronize(quantized.device)
        per_batch_s = time.perf_counter() - started
        pilot_s += per_batch_s
    return pilot_batches, pilot_s, per_batch_s


def _load_baseline(ctx: TierContext, texts: list[str], tokenizer: PreTrainedTokenizerBase) -> LoadedModel:
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


@dataclass(frozen=True)
class PilotTiming:
    """What the pilot measured: batches of up to ``batch_size`` windows, ``per_batch_s`` after warm-up."""

    batch_size: int
    batches: int
    per_batch_s: float


def _estimate(ctx: TierContext, quantized: LoadedModel, baseline: LoadedModel | None, windows: torch.Tensor,
              pilot: PilotTiming, prepared_acc: Accumulator) -> RuntimeEstimate:
    batch_size, pilot_batches, per_batch_s = pilot.batch_size, pilot.batches, pilot.per_batch_s
    n = windows.shape[0]
    remaining_batches = math.ceil(n / batch_size) - pilot_batches
    models = "quantized + baseline" if baseline else "quantized"
    return RuntimeEstimate(
        tier="1 (ppl)",
        seconds=per_batch_s * remaining_batches,
        hardware=hardware_description(quantized.device),
        model_bytes=quantized.size_bytes + (baseline.size_bytes if baseline else 0),
        data=f"{n * windows.shape[1]:,} tokens in {n} windows of {windows.shape[1]}",
        basis=(
            f"pilot: {pilot_batches} batch(es) of up to {batch_size} window(s) on the {models} model(s), "
            f"{per_batch_s:.2f} s per batch after warm-up; {remaining_batches} batch(es) left"
        ),
        warning=_resolution_warning(ctx, prepared_acc, n),
        threshold_s=ctx.options.confirm_above_s,
        finish_s=FINISH_S,
    )


def _resolution_warning(ctx: TierContext, acc: Accumulator, windows: int) -> str | None:
    """Said at the checkpoint: the pilot's spread projects an interval wider than the healthy threshold."""
    options = ctx.options
    if acc.base_window_nll:
        spread = [q - b for q, b in zip(acc.window_nll, acc.base_window_nll, strict=True)]
        what = "paired NLL differences with the baseline"
    elif options.reference:
        spread, what = acc.window_nll, "per-window NLLs (no baseline: unpaired)"
    else:
        return None  # nothing to compare with: no verdict to resolve
    half = resolution_pct(spread, windows)
    healthy = options.thresholds.healthy_pct
    if half is None or half <= healthy or not math.isfinite(half):
        return None  # inf: a spread that overflows is a broken model, not noise that hides a verdict
    needed = math.ceil(windows * (math.log1p(half / 100) / math.log1p(healthy / 100)) ** 2)
    return (
        f"{windows} windows are too few to resolve the healthy threshold: the pilot's {what} project "
        f"a 95 % interval of about ±{half:.2g} % on the perplexity, wider than --healthy-pct {healthy:g}; "
        f"about {needed:,} windows would resolve it (more --eval-data or a larger --max-windows)."
    )


def run(prepared: PplPrepared) -> TierOutcome:
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
    """--vllm-python: the same windows through that vLLM's prompt log-probabilities (vllm_ppl.py)."""
    from quark_ptq_eval.evaluate.vllm_ppl import cross_check

    try:
        result = cross_check(prepared.ctx, prepared.windows, prepared.acc.window_nll, hf_seconds)
    except QpeError as exc:  # vLLM refuses the export, or never answers: Tier 1's own scores stand
        outcome.notes.append(f"HF vs vLLM was not checked: {exc.message}")
        return
    if result is not None:
        outcome.details["hf_vs_vllm"] = result.as_dict()
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
    stats = perplexity_stats(acc.window_nll, seq_len - 1)
    quantized = {TASK: {"perplexity": stats["perplexity"]}}
    details: dict[str, Any] = {
        "quantized": stats,
        "seq_len": seq_len,
        "batch_size": prepared.batch_size,
        "loader": f"{prepared.quantized.loader} ({prepared.quantized.loader_reason})",
        "method": "non-overlapping windows, mean next-token NLL (Quark ppl_eval's averaging)",
    }
    # Sampling noise for the verdict: log(perplexity) is the mean NLL, so its standard error is the NLL's.
    noise: dict[str, dict[str, Any]] = {"perplexity": {"log_stderr": stats["nll_stderr"]}}
    baseline = None
    if prepared.baseline is not None:
        base_stats = perplexity_stats(acc.base_window_nll, seq_len - 1)
        kl, paired = kl_stats(acc), paired_delta(acc)
        quantized[TASK].update({"kl_divergence": kl["kl_divergence"], "top1_agreement": kl["top1_agreement"]})
        baseline = {TASK: {"perplexity": base_stats["perplexity"]}}
        details.update(baseline=base_stats, kl=kl, paired=paired, distribution=distribution(acc))
        details["loader"] += f"; baseline: {prepared.baseline.loader}"
        noise["perplexity"].update(
            baseline_log_stderr=base_stats["nll_stderr"],
            paired_log_delta=paired["delta_nll"],
            paired_log_stderr=paired["delta_nll_stderr"],
        )
        noise["kl_divergence"] = {"stderr": kl["kl_stderr"]}
    details["noise"] = {TASK: noise}
    details["required"] = {TASK: list(quantized[TASK])}
    return TierOutcome(
        quantized=quantized,
        baseline=baseline,
        directions={TASK: {"perplexity": False, "kl_divergence": False, "top1_agreement": True}},
        details=details,
        informational=("top1_agreement",),
        notes=[note] if (note := getattr(prepared, "window_note", None)) else [],
    )
