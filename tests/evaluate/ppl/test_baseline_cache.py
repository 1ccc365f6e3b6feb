"""The cached baseline: its KL against full-logit KL (with the stated bound), its key and reuse."""

from __future__ import annotations

import shutil

import pytest
import torch

from quark_ptq_eval.evaluate.ppl.baseline_cache import (
    BaselineCache,
    baseline_token_stats,
    cached_token_stats,
    tokenizer_fingerprint,
)
from quark_ptq_eval.evaluate.ppl.tier import token_stats, token_windows
from quark_ptq_eval.runtime.loading import load_model

SEQ_LEN, WINDOWS = 128, 4


@pytest.fixture(scope="module")
def texts(corpus) -> list[str]:
    text = corpus.read_text(encoding="utf-8")
    return [text[len(text) // 3 : len(text) // 3 + 8_000]]


@pytest.fixture(scope="module")
def logits_pair(tiny_llama, texts):
    """Windows, the tiny model's logits and those of a copy with noisy weights (a stand-in for a
    quantized model that needs no Quark import)."""
    base = load_model(tiny_llama, "cpu")
    windows = token_windows(base.tokenizer, texts, SEQ_LEN, WINDOWS)
    with torch.inference_mode():
        p = base.model(windows).logits[:, :-1].clone()
        gen = torch.Generator().manual_seed(0)
        for param in base.model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.1 * param.abs().mean())
        q = base.model(windows).logits[:, :-1].clone()
    return windows, p, q


@pytest.mark.parametrize("top_k", [4, 32])
def test_cached_kl_is_the_full_kl_within_the_stated_bound(logits_pair, top_k):
    windows, p, q = logits_pair
    labels = windows[:, 1:]
    full = token_stats(q, labels, p)
    cache = baseline_token_stats(p, labels, top_k)
    cached = cached_token_stats(q, labels, cache["topk_logp"], cache["topk_ids"], cache["log_tail"], cache["nll"])
    gap = full["kl"] - cached["kl"]
    # The cached KL merges the tail into one bucket: never above the full KL, below it by at most the bound.
    assert bool((gap >= -1e-6).all())
    assert bool((gap <= cached["kl_gap_bound"] + 1e-6).all()), float((gap - cached["kl_gap_bound"]).max())
    assert float(full["kl"].mean()) > 1e-3  # the perturbation is visible: the check is not vacuous
    assert float(gap.mean()) <= float(cached["kl_gap_bound"].mean())
    print(f"K={top_k}: full KL {float(full['kl'].mean()):.6f}, cached {float(cached['kl'].mean()):.6f}, "
          f"gap {float(gap.mean()):.2e} <= bound {float(cached['kl_gap_bound'].mean()):.2e}")
    # NLLs and top-1 agreement are exact.
    torch.testing.assert_close(cached["nll"], full["nll"], rtol=0, atol=1e-9)
    torch.testing.assert_close(cached["base_nll"], full["base_nll"], rtol=0, atol=1e-6)
    assert torch.equal(cached["top1"], full["top1"])


def test_a_cache_holding_the_whole_vocabulary_gives_the_exact_kl(logits_pair):
    windows, p, q = logits_pair
    labels, vocab = windows[:, 1:], p.shape[-1]
    cache = baseline_token_stats(p, labels, vocab)
    cached = cached_token_stats(q, labels, cache["topk_logp"], cache["topk_ids"], cache["log_tail"], cache["nll"])
    torch.testing.assert_close(cached["kl"], token_stats(q, labels, p)["kl"], rtol=1e-5, atol=1e-6)
    assert float(cached["kl_gap_bound"].abs().max()) == 0.0


def test_cache_is_written_once_read_back_and_keyed_by_what_changes_it(tiny_llama, texts, tmp_path, copy_model):
    base = load_model(tiny_llama, "cpu")
    windows = token_windows(base.tokenizer, texts, SEQ_LEN, WINDOWS)
    cache = BaselineCache(tmp_path / "cache")
    key = cache.key_for(tiny_llama, base.tokenizer, texts, windows, 8)
    assert not cache.has(key)
    cache.build(key, base.model, windows, 2, tiny_llama, log=lambda _: None)
    entry = cache.load(key)
    assert (cache.writes, cache.hits) == (1, 1) and cache.has(key)
    assert torch.equal(entry.ids, windows) and tuple(entry.topk_ids.shape) == (WINDOWS, SEQ_LEN - 1, 8)
    meta = entry.meta
    assert meta["bytes"] < meta["full_logits_bytes"]
    with torch.inference_mode():
        reference = baseline_token_stats(base.model(windows).logits[:, :-1], windows[:, 1:], 8)
    torch.testing.assert_close(entry.nll, reference["nll"])
    # A second cache object on the same directory finds it (what a resumed comparison does).
    again = BaselineCache(tmp_path / "cache")
    assert again.has(key) and again.load(key) is not None and again.writes == 0

    other_len = cache.key_for(tiny_llama, base.tokenizer, texts, token_windows(base.tokenizer, texts, 64, 4), 8)
    other_text = cache.key_for(tiny_llama, base.tokenizer, [texts[0][:-10]], windows, 8)
    other_k = cache.key_for(tiny_llama, base.tokenizer, texts, windows, 16)
    changed = copy_model(tiny_llama, "changed")
    (changed / "config.json").write_text((changed / "config.json").read_text().replace("{", '{"x": 1,', 1))
    other_model = cache.key_for(changed, base.tokenizer, texts, windows, 8)
    ids = {k.id for k in (key, other_len, other_text, other_k, other_model)}
    assert len(ids) == 5 and not any(cache.has(k) for k in (other_len, other_text, other_k, other_model))


def test_tokenizer_fingerprint_survives_a_resave(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.save_pretrained(tmp_path / "resaved")
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path / "resaved")) == tokenizer_fingerprint(tok)
    shutil.rmtree(tmp_path / "resaved")
    tok.add_tokens(["<brand-new-token>"])
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_llama))
