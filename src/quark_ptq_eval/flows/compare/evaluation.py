"""Tier 1 for each scheme of a comparison, against the baseline evaluated once and cached.

The scheme's own side is scored exactly as `run`'s Tier 1 does (same windows, same float64 NLL),
through the interface of the tier that scores a text (``context.text_scorer()``), so its
perplexity equals a separate run's; the baseline side (its NLLs, top-K distribution and
tail mass) comes from evaluate/ppl/baseline_cache.py. The result is written as the scheme's normal
eval_report.md / eval_results.json in its work dir, through the evaluation's own report code.
"""

from __future__ import annotations

import time
from pathlib import Path

from quark_ptq_eval.base.artifacts import PlanJson
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.evaluate.context import text_scorer
from quark_ptq_eval.evaluate.ppl.baseline_cache import BaselineCache, BaselineEntry, CacheKey
from quark_ptq_eval.evaluate.tiers import text_tier
from quark_ptq_eval.flows.compare.options import TIER1, CompareOptions

CACHE_DIR = "baseline_cache"


class BaselineSource:
    """The comparison's baseline: its key now (cheap: hashes and tokenization), the cache built
    at most once, on the first scheme that needs it, and read by every scheme."""

    def __init__(self, comparison, opts: CompareOptions):
        from transformers import AutoTokenizer

        from quark_ptq_eval.intake import resolve_model

        assert opts.model, "compare() refuses a comparison without a model"
        source, _ = resolve_model(opts.model, bool(opts.offline))
        if source is None:
            raise UsageError(f"The baseline {opts.model} is not available as local files.",
                             "Download it first (or pass its local directory) and re-run compare.")
        self.source: Path = source
        self.opts, self.log = opts, comparison.ui.info
        self.scorer = text_scorer()
        self.texts = self.scorer.eval_texts(opts.eval.eval_data, opts.eval.eval_text_limit)
        tokenizer = AutoTokenizer.from_pretrained(self.source, trust_remote_code=bool(opts.plan.get("trust_remote_code")))
        assert opts.eval.seq_len is not None  # CompareOptions sets one window for every scheme
        self.windows = self.scorer.token_windows(tokenizer, self.texts, opts.eval.seq_len, opts.eval.max_windows)
        self.cache = BaselineCache(comparison.root / CACHE_DIR)
        self.key: CacheKey = self.cache.key_for(self.source, tokenizer, self.texts, self.windows, opts.top_k)
        self._tasks: dict | None = None

    @property
    def tasks_key(self) -> str | None:
        """What the task scores depend on (None: no Tier 2 in this comparison)."""
        from quark_ptq_eval.flows.compare.tasks import cache_key

        return cache_key(self.opts, self.key.model_digest) if self.opts.eval.tasks else None

    def tasks(self) -> dict:
        """The baseline's lm-eval results with per-document scores: run at most once, then cached."""
        from quark_ptq_eval.flows.compare.tasks import baseline_tasks

        if self._tasks is None:
            self._tasks = baseline_tasks(self.cache.root, self.opts, self.source, self.key.model_digest, self.log)
        return self._tasks

    def entry(self) -> BaselineEntry:
        if not self.cache.has(self.key):
            stale = self.cache.stale_reason(self.key)
            if stale:
                self.log(f"baseline: {stale}")
            self._build()
        else:
            self.log(f"baseline: cache hit {self.key.id}")
        return self.cache.load(self.key)

    def _build(self) -> None:
        from quark_ptq_eval.runtime.loading import load_model

        loaded = load_model(self.source, self.opts.eval.device, bool(self.opts.plan.get("trust_remote_code")))
        vocab = loaded.model.get_output_embeddings().weight.shape[0]
        batch = self.opts.eval.batch_size or self.scorer.auto_batch_size(self.windows.shape[1], vocab, loaded.device)
        self.log(f"baseline: evaluating {self.source} once ({self.windows.shape[0]} windows) into the cache")
        self.cache.build(self.key, loaded.model, self.windows, batch, self.source, log=self.log)


def evaluate_scheme(comparison, opts: CompareOptions, scheme: str, baseline: BaselineSource, plan: PlanJson):
    """Score the scheme's quantized model against the cached baseline; write its eval report.
    ``plan``: the scheme's quant plan, as its recipe holds it."""
    from quark_ptq_eval.evaluate import EvalOptions
    from quark_ptq_eval.evaluate import report as report_files
    from quark_ptq_eval.evaluate.api import build_report  # the evaluation's own report builder: same verdicts
    from quark_ptq_eval.evaluate.context import ScoredText, TierInputs
    from quark_ptq_eval.runtime.loading import load_model

    entry = baseline.entry()
    base_tasks = baseline.tasks() if opts.eval.tasks else None  # before the scheme's model loads: one model at a time
    model_dir, workdir = comparison.output_dir(scheme), comparison.workdir(scheme)
    options = EvalOptions(tier=text_tier().name, baseline=baseline.source, **TIER1.values(opts.eval))
    started = time.perf_counter()
    quantized = load_model(model_dir, opts.eval.device, bool(opts.plan.get("trust_remote_code")))
    seq_len = opts.eval.seq_len
    assert seq_len is not None  # CompareOptions sets one window for every scheme
    scorer = baseline.scorer
    windows = scorer.token_windows(quantized.tokenizer, baseline.texts, seq_len, opts.eval.max_windows)
    if tuple(windows.shape) != tuple(entry.ids.shape) or not bool((windows == entry.ids).all()):
        raise UsageError(f"{model_dir} tokenizes the evaluation text differently from the baseline; "
                         "per-token KL needs the same tokenizer.")
    vocab = quantized.model.get_output_embeddings().weight.shape[0]
    batch = opts.eval.batch_size or scorer.auto_batch_size(seq_len, vocab, quantized.device)
    acc, bounds, tail = score_against_cache(quantized.model, windows, entry, batch, scorer.new_accumulator())
    outcome = scorer.text_outcome(ScoredText(
        acc, seq_len, batch, f"{quantized.loader} ({quantized.loader_reason})", f"baseline cache {entry.key.id}",
        kl_extra={"kl_cache_gap_bound_mean": float(bounds.mean()), "kl_cache_gap_bound_max": float(bounds.max()),
                  "baseline_tail_mass_mean": float(tail.mean())},
        baseline_cache={"key": entry.key.id, "top_k": entry.key.top_k, "path": str(entry.path),
                        "method": "KL against the cached top-K + tail mass (a lower bound; "
                                  "the gap to the full-logit KL is at most the stated bound)"}))
    ctx = TierInputs(model_dir, options, workdir, None, baseline.source, plan)
    report = build_report(ctx, outcome, None, time.perf_counter() - started)
    report_files.write_all(report)  # the recipe running this as its Phase 3 records the step
    if base_tasks is not None:
        from quark_ptq_eval.flows.compare.tasks import score_scheme

        score_scheme(quantized, workdir, model_dir, opts, base_tasks, comparison.ui.info)
    return report


def score_against_cache(model, windows, entry: BaselineEntry, batch_size: int, acc):
    """``acc`` (the text tier's accumulator) filled from the model's logits and the cached baseline, plus
    per token the bound on the cached KL's gap to the full-logit KL and the baseline's tail mass."""
    import torch

    from quark_ptq_eval.evaluate.ppl.baseline_cache import cached_token_stats
    from quark_ptq_eval.runtime.loading import require_finite

    bounds, tail, device = [], [], next(model.parameters()).device
    with torch.inference_mode():
        for i in range(0, windows.shape[0], batch_size):
            sl = slice(i, i + batch_size)
            batch = windows[sl].to(device)
            logits = model(batch).logits[:, :-1]
            require_finite(logits, "The quantized model")
            stats = cached_token_stats(logits, batch[:, 1:], entry.topk_logp[sl].to(device),
                                       entry.topk_ids[sl].to(device), entry.log_tail[sl].to(device), entry.nll[sl],
                                       entry.top1[sl].to(device))
            acc.add(stats, batch.shape[0])
            bounds.append(stats["kl_gap_bound"].reshape(-1).cpu())
            tail.append(stats["tail_mass"].reshape(-1).cpu())
    return acc, torch.cat(bounds), torch.cat(tail)
