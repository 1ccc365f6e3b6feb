"""Tier 1 throughput against its peers on the same model and text, printed as ratios.

Peers: Quark's own ``quark.contrib.llm_eval.evaluation.ppl_eval`` (one 2048-token window at a
time) and lm-eval's rolling-loglikelihood perplexity (``HFLM.loglikelihood_rolling``). All three
score the same pre-tokenized text with the same in-memory model; tokenization and model loading
are outside the timed region (lm-eval's own re-tokenization of the text is inside its). The three
are interleaved, five rounds (one with ``--quick``); the ratio is of the medians, the best-of
ratio is printed next to it. ``--profile`` instead times the pieces of one Tier 1 run with a
baseline (tokenization, model load, forward, NLL, baseline forward, KL) on the same model and text.
``--rss TOKENS`` runs Tier 1 with a baseline over that many tokens and prints the peak RSS.
Run: ``python -m bench.benchmarks.bench_ppl [--quick | --profile | --rss TOKENS]``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")  # Quark's and lm-eval's progress bars: one per window

SEQ_LEN = 2048  # Quark's ppl_eval is fixed to 2048-token windows
ASSETS = Path(tempfile.gettempdir()) / "qpe-bench-assets"


def build_assets() -> tuple[Path, Path]:
    from quark_ptq_eval.flows.demo import build_corpus, build_tiny_model

    corpus = ASSETS / "corpus.txt"
    if not corpus.exists():
        build_corpus(corpus)
    model = ASSETS / "tiny-llama"
    if not (model / "config.json").exists():
        build_tiny_model(model, corpus)
    return model, corpus


def time_ours(model, windows) -> tuple[float, float]:
    from quark_ptq_eval.evaluate.ppl import tier as tier_ppl

    batch = tier_ppl.auto_batch_size(SEQ_LEN, model.get_output_embeddings().weight.shape[0], "cpu")
    acc = tier_ppl.Accumulator()
    started = time.perf_counter()
    for start in range(0, windows.shape[0], batch):
        tier_ppl.score_batch(model, windows[start : start + batch], acc)
    elapsed = time.perf_counter() - started
    return elapsed, tier_ppl.perplexity_stats(acc.window_nll, SEQ_LEN - 1)["perplexity"]


def time_ours_before(model, windows) -> tuple[float, float]:
    """Tier 1's scoring before issue 12, for the before/after row: batches of up to 8 windows on a
    CPU and the float64 log-softmax of every row (what ``token_stats`` still does with a baseline)."""
    import torch

    from quark_ptq_eval.evaluate.ppl import tier as tier_ppl

    window_nll = []
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in windows.split(8):
            logits = model(batch).logits[:, :-1]
            tier_ppl.require_finite(logits, "model")
            log_q = torch.log_softmax(logits.double(), dim=-1)
            window_nll += (-log_q.gather(-1, batch[:, 1:].unsqueeze(-1))).squeeze(-1).mean(dim=1).tolist()
    elapsed = time.perf_counter() - started
    return elapsed, tier_ppl.perplexity_stats(window_nll, SEQ_LEN - 1)["perplexity"]


def time_quark(model, encoding) -> tuple[float, float]:
    from quark.contrib.llm_eval.evaluation import ppl_eval

    started = time.perf_counter()
    ppl = float(ppl_eval(model, encoding, "cpu"))
    return time.perf_counter() - started, ppl


def time_lm_eval(model, tokenizer, text: str) -> tuple[float, float]:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, max_length=SEQ_LEN)
    request = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    started = time.perf_counter()
    (logprob,) = lm.loglikelihood_rolling([request], disable_tqdm=True)
    elapsed = time.perf_counter() - started
    tokens = len(tokenizer(text).input_ids)
    return elapsed, math.exp(-logprob / tokens)


def run(quick: bool) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quark_ptq_eval.evaluate.ppl import tier as tier_ppl

    model_dir, corpus = build_assets()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    text = corpus.read_text(encoding="utf-8")[: 60_000 if quick else 120_000]
    windows = tier_ppl.token_windows(tokenizer, [text], SEQ_LEN)
    # Quark and ours score the very same token ids; lm-eval re-tokenizes the covered text itself.
    encoding = SimpleNamespace(input_ids=windows.reshape(1, -1))
    scored_text = tokenizer.decode(windows.reshape(-1))
    tokens = windows.numel()
    import quark.contrib.llm_eval.evaluation  # noqa: F401 - import cost outside the timed regions

    with torch.inference_mode():
        model(windows[:1])  # warm-up shared by all contenders
    contenders = {
        "ours": lambda: time_ours(model, windows),
        "ours_before": lambda: time_ours_before(model, windows),
        "quark": lambda: time_quark(model, encoding),
        "lm_eval": lambda: time_lm_eval(model, tokenizer, scored_text),
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for _ in range(1 if quick else 5):  # interleaved: a shared machine's noise hits all alike
        for name, measure in contenders.items():
            runs[name].append(measure())
    ours_s, ours_ppl = statistics.median(s for s, _ in runs["ours"]), runs["ours"][0][1]
    rows = []
    peers = (("ours_before", "ours before issue 12 (batches of 8, float64 log-softmax)"),
             ("quark", "quark ppl_eval"), ("lm_eval", "lm-eval loglikelihood_rolling"))
    for name, peer in peers:
        peer_s, peer_ppl = statistics.median(s for s, _ in runs[name]), runs[name][0][1]
        rows.append(
            {
                "benchmark": f"tier1 perplexity, {tokens:,} tokens, seq_len {SEQ_LEN}",
                "ours_s": round(ours_s, 4),
                "peer": peer,
                "peer_s": round(peer_s, 4),
                "ratio": round(peer_s / ours_s, 3),
                "best_of_ratio": round(min(s for s, _ in runs[name]) / min(s for s, _ in runs["ours"]), 3),
                "ours_tokens_per_s": round(tokens / ours_s),
                "peer_tokens_per_s": round(tokens / peer_s),
                "ours_perplexity": ours_ppl,
                "peer_perplexity": peer_ppl,
                "perplexity_rel_diff": abs(ours_ppl - peer_ppl) / peer_ppl,
            }
        )
    return rows


def profile() -> list[tuple[str, float, float]]:
    """One Tier 1 run with a baseline (the tiny model against a copy of itself with its weights
    perturbed by 1 %, so the KL is not 0), its pieces timed apart; the scoring as it is now (one
    pass: pair kernel + streamed statistics) and as it was before issue 34 (finite checks of both
    logits + float64 log-softmax token_stats) on the same logits."""
    import torch

    from quark_ptq_eval.evaluate.ppl import tier as tier_ppl
    from quark_ptq_eval.runtime.loading import load_model

    model_dir, corpus = build_assets()
    pieces: dict[str, float] = {}

    def timed(piece: str, fn):
        started = time.perf_counter()
        result = fn()
        pieces[piece] = pieces.get(piece, 0.0) + time.perf_counter() - started
        return result

    quantized = timed("model load (quantized)", lambda: load_model(model_dir, "cpu"))
    baseline = timed("model load (baseline)", lambda: load_model(model_dir, "cpu"))
    _perturb(quantized.model)
    text = corpus.read_text(encoding="utf-8")[:120_000]
    windows = timed("tokenization", lambda: tier_ppl.token_windows(quantized.tokenizer, [text], SEQ_LEN))
    acc = tier_ppl.Accumulator()
    with torch.inference_mode():
        for window in windows.split(1):
            logits = timed("forward (quantized)", lambda w=window: quantized.model(w).logits[:, :-1])
            base = timed("forward (baseline)", lambda w=window: baseline.model(w).logits[:, :-1])
            labels = window[:, 1:]
            timed(SCORING_NOW, lambda lg=logits, b=base, lb=labels: _score_now(acc, lg, lb, b))
            timed(SCORING_BEFORE, lambda lg=logits, b=base, lb=labels: _before(lg, lb, b))
    timed("statistics (llama.cpp report, percentiles)", lambda: tier_ppl.outcome_from(acc, SEQ_LEN, _Scored()))
    total = sum(v for k, v in pieces.items() if k != SCORING_BEFORE)
    return [(k, v, 100 * v / total) for k, v in pieces.items()] + [("total (without the 'before' row)", total, 100.0)]


SCORING_NOW = "scoring now (pair kernel + statistics + trim)"
SCORING_BEFORE = "scoring before issue 34 (finite x2 + float64)"


def _score_now(acc, logits, labels, base) -> None:
    """What score_batch does after the two forwards: the pair kernel, the streamed statistics and the
    periodic return of freed memory to the OS."""
    from quark_ptq_eval.evaluate.ppl import tier as tier_ppl
    from quark_ptq_eval.evaluate.ppl.kernels import release_every_few_windows

    acc.add(tier_ppl.pair_stats(logits, labels, base), 1)
    release_every_few_windows(acc.windows - 1, acc.windows)


def _before(logits, labels, base) -> None:
    from quark_ptq_eval.evaluate.ppl import tier as tier_ppl

    tier_ppl.require_finite(logits, "model")
    tier_ppl.require_finite(base, "baseline")
    tier_ppl.token_stats(logits, labels, base)


def _perturb(model) -> None:
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.01 * torch.randn(p.shape, generator=generator))


class _Scored:
    batch_size = 1
    quantized = SimpleNamespace(loader="hf", loader_reason="bench")
    baseline = SimpleNamespace(loader="hf", loader_reason="bench")


def peak_rss(tokens: int) -> tuple[int, float]:
    """Tier 1 with a baseline over ``tokens`` tokens (the corpus repeated), statistics included;
    returns (scored tokens, peak RSS in MiB of this process)."""
    import resource

    from quark_ptq_eval.evaluate.ppl import tier as tier_ppl
    from quark_ptq_eval.runtime.loading import load_model

    model_dir, corpus = build_assets()
    quantized, baseline = load_model(model_dir, "cpu"), load_model(model_dir, "cpu")
    _perturb(quantized.model)
    text = corpus.read_text(encoding="utf-8")
    ids = tier_ppl.token_windows(quantized.tokenizer, [text], SEQ_LEN).reshape(-1)
    ids = ids.repeat(math.ceil(tokens / ids.numel()))[: (tokens // SEQ_LEN) * SEQ_LEN].view(-1, SEQ_LEN)
    acc = tier_ppl.Accumulator()
    trims = _timed_trims()
    started = time.perf_counter()
    for window in ids.split(1):
        tier_ppl.score_batch(quantized.model, window, acc, baseline.model)
    loop_s = time.perf_counter() - started
    outcome = tier_ppl.outcome_from(acc, SEQ_LEN, _Scored())
    print(f"tier1 scoring loop {loop_s:.2f} s; returning freed memory: {trims['calls']} calls, "
          f"{trims['seconds']:.3f} s ({100 * trims['seconds'] / loop_s:.2f} % of the loop)")
    return outcome.details["kld_report"]["tokens"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed_trims() -> dict[str, float]:
    """Count and time ppl_kernels' calls to release_freed_memory (bench instrumentation only)."""
    from quark_ptq_eval.evaluate.ppl import kernels as ppl_kernels

    seen = {"calls": 0, "seconds": 0.0}
    release = ppl_kernels.release_freed_memory

    def timed_release() -> bool:
        started = time.perf_counter()
        try:
            return release()
        finally:
            seen["calls"] += 1
            seen["seconds"] += time.perf_counter() - started

    ppl_kernels.release_freed_memory = timed_release
    return seen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="less text, one repetition")
    parser.add_argument("--profile", action="store_true", help="where one Tier 1 run's time goes")
    parser.add_argument("--rss", type=int, metavar="TOKENS", help="peak RSS of Tier 1 with a baseline over TOKENS")
    args = parser.parse_args(argv)
    load = "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.rss:
        scored, mib = peak_rss(args.rss)
        print(f"tier1 peak RSS: {scored:,} scored tokens, {mib:.1f} MiB ({load})")
        return
    if args.profile:
        rows = profile()
        for piece, seconds, share in rows:
            print(f"tier1 profile: {piece:<46} {seconds:8.3f} s  {share:5.1f} %")
        t = {k: v for k, v, _ in rows}
        forwards = t["forward (quantized)"] + t["forward (baseline)"]
        now = t[SCORING_NOW] + t["statistics (llama.cpp report, percentiles)"]
        print(f"tier1 scoring overhead over the two forwards: now {100 * now / forwards:.1f} %, "
              f"before issue 34 {100 * t[SCORING_BEFORE] / forwards:.1f} % ({load})")
        return
    for row in run(args.quick):
        print(
            f"{row['benchmark']}: ours {row['ours_s']:.2f} s ({row['ours_tokens_per_s']:,} tok/s, "
            f"ppl {row['ours_perplexity']:.6f}) vs {row['peer']} {row['peer_s']:.2f} s "
            f"({row['peer_tokens_per_s']:,} tok/s, ppl {row['peer_perplexity']:.6f}, "
            f"rel. diff {row['perplexity_rel_diff']:.1e}): {row['ratio']:.2f}x median, "
            f"{row['best_of_ratio']:.2f}x best-of"
        )


if __name__ == "__main__":
    main()
