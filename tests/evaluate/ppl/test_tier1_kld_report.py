"""Tier 1's llama.cpp-style statistics against an independent numpy computation over the full saved
logits of a few windows of a real export and its baseline; the baseline cache's format guard."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from quark_ptq_eval.base.gates import FlagApprover
from quark_ptq_eval.evaluate import EvalOptions, evaluate

pytestmark = pytest.mark.slow
SEQ_LEN, WINDOWS = 128, 6


@pytest.fixture(scope="module")
def eval_text(corpus, tmp_path_factory) -> Path:
    text = corpus.read_text(encoding="utf-8")
    path = tmp_path_factory.mktemp("kldtext") / "eval.txt"
    path.write_text(text[len(text) // 3 : len(text) // 3 + 8_000], encoding="utf-8")
    return path


def full_logits(model_dir: Path, windows) -> np.ndarray:
    """The model's float32 logits for every window, ``[n, seq_len - 1, vocab]``, saved whole."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        return np.stack([model(w[None]).logits[0, :-1].float().numpy() for w in windows])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _mean_unc(v: np.ndarray) -> tuple[float, float]:
    """llama.cpp's mean ± sqrt((<x^2> - <x>^2) / (n - 1))."""
    n = v.size
    var = np.mean(v * v) - np.mean(v) ** 2
    return float(np.mean(v)), float(math.sqrt(var / (n - 1))) if var > 0 and n > 10 else 0.0


def independent_report(q_logits: np.ndarray, b_logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Every figure of llama.cpp's KL-divergence report, written from its definitions in numpy float64."""
    lq, lb = _log_softmax(q_logits), _log_softmax(b_logits)
    nll = -np.take_along_axis(lq, labels[..., None], -1)[..., 0].ravel()
    nllb = -np.take_along_axis(lb, labels[..., None], -1)[..., 0].ravel()
    kld = (np.exp(lb) * (lb - lq)).sum(-1).ravel()
    dp = np.exp(-nll) - np.exp(-nllb)
    same = float(np.mean(q_logits.argmax(-1) == b_logits.argmax(-1)))
    n = nll.size
    mq, uq = _mean_unc(nll)
    mb, ub = _mean_unc(nllb)
    cov = (np.mean(nll * nllb) - mq * mb) / (n - 1)
    ratio_unc = math.sqrt(uq**2 + ub**2 - 2 * cov)
    pq, pb = math.exp(mq), math.exp(mb)
    mse, mse_unc = _mean_unc(dp * dp)
    out = {
        "ppl_q": pq, "ppl_q_unc": pq * uq, "ppl_base": pb, "ppl_base_unc": pb * ub, "cor_ln_ppl": cov / (uq * ub),
        "ln_ppl_ratio": mq - mb, "ln_ppl_ratio_unc": ratio_unc, "ppl_ratio": math.exp(mq - mb),
        "ppl_ratio_unc": math.exp(mq - mb) * ratio_unc, "ppl_diff": pq - pb,
        "ppl_diff_unc": math.sqrt((pq * uq) ** 2 + (pb * ub) ** 2 - 2 * pq * pb * cov),
        "kld_mean": _mean_unc(kld)[0], "kld_mean_unc": _mean_unc(kld)[1], "kld_max": kld.max(), "kld_min": kld.min(),
        "dp_mean": _mean_unc(dp)[0], "dp_mean_unc": _mean_unc(dp)[1], "dp_max": dp.max(), "dp_min": dp.min(),
        "dp_rms": math.sqrt(mse), "dp_rms_unc": 0.5 / math.sqrt(mse) * mse_unc,
        "same_top_p": same, "same_top_p_unc": math.sqrt(same * (1 - same) / (n - 1)), "tokens": n,
    }
    for name, f in (("p99_9", 99.9), ("p99", 99), ("p95", 95), ("p90", 90), ("median", 50), ("p10", 10),
                    ("p5", 5), ("p1", 1), ("p0_1", 0.1)):
        out[f"kld_{name}"] = np.percentile(kld, f)
        out[f"dp_{name}"] = np.percentile(dp, f)
    out["dp_p75"], out["dp_p25"] = np.percentile(dp, 75), np.percentile(dp, 25)
    return {k: float(v) for k, v in out.items()}


def test_every_llama_cpp_statistic_matches_an_independent_numpy_computation(quantized, tiny_llama, eval_text,
                                                                              tmp_path):
    from transformers import AutoTokenizer

    from quark_ptq_eval.evaluate.ppl.tier import eval_texts, token_windows

    export = quantized("int8")
    options = EvalOptions(tier="ppl", eval_data=eval_text, seq_len=SEQ_LEN, max_windows=WINDOWS, device="cpu",
                          baseline=tiny_llama, batch_size=4)  # 2 batches: the sums and values stream per batch
    report = evaluate(export, options, tmp_path, FlagApprover(), source_model=tiny_llama)
    ours = report.details["kld_report"]
    windows = token_windows(AutoTokenizer.from_pretrained(export), eval_texts(eval_text), SEQ_LEN, WINDOWS)
    q_logits, b_logits = full_logits(export, windows), full_logits(tiny_llama, windows)
    theirs = independent_report(q_logits, b_logits, windows[:, 1:].numpy())
    assert theirs["tokens"] == WINDOWS * (SEQ_LEN - 1) and 0 < theirs["kld_min"] < theirs["kld_median"]
    assert theirs["dp_min"] < 0 < theirs["dp_max"] and 0 < theirs["same_top_p"] < 1  # a real, imperfect export
    # 1e-6 relative; the 1e-15 absolute floor is far below any figure here (KLD min is ~3e-5)
    mismatched = {k: (ours[k], v) for k, v in theirs.items() if ours[k] != pytest.approx(v, rel=1e-6, abs=1e-15)}
    assert not mismatched
    kl = report.details["kl"]  # our kept keys agree with the same computation
    assert kl["kl_divergence"] == pytest.approx(theirs["kld_mean"], rel=1e-6)
    assert kl["kl_p50"] == pytest.approx(theirs["kld_median"], rel=1e-6)
    assert kl["kl_max"] == pytest.approx(theirs["kld_max"], rel=1e-6)
    assert kl["top1_agreement"] == pytest.approx(theirs["same_top_p"], abs=1e-12)
    results = json.loads((tmp_path / "eval_results.json").read_text())
    assert results["details"]["kld_report"]["kld_p99_9"] == pytest.approx(theirs["kld_p99_9"], rel=1e-6)
    assert sum(results["details"]["distribution"]["token_dp_histogram"]["counts"]) == theirs["tokens"]
    text = (tmp_path / "eval_report.md").read_text()
    assert "====== KL divergence statistics ======" in text and "Same top p:" in text
    assert f"{100 * theirs['same_top_p']:6.3f}" in text


def test_a_cache_of_the_previous_format_is_recomputed_never_read(tiny_llama, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quark_ptq_eval.evaluate.ppl.baseline_cache import CACHE_FORMAT, META_FILE, BaselineCache

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    windows = torch.randint(0, len(tokenizer), (2, 32))
    cache = BaselineCache(tmp_path)
    key = cache.key_for(tiny_llama, tokenizer, ["text"], windows, 8)
    cache.build(key, model, windows, 2, tiny_llama, log=lambda _: None)
    entry = cache.load(key)
    with torch.inference_mode():
        logits = model(windows).logits[:, :-1]
    assert bool((entry.top1 == logits.argmax(-1)).all()) and cache.stale_reason(key) is None
    meta_path = cache.path_for(key) / META_FILE
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(meta | {"format": "quark-ptq-eval/baseline_cache/1"}))
    assert not cache.has(key)
    reason = cache.stale_reason(key)
    assert reason and "baseline_cache/1" in reason and CACHE_FORMAT in reason and "recomputing" in reason


def test_the_pair_kernel_equals_the_float64_log_softmax_and_falls_back_where_exp_overflows():
    import torch

    from quark_ptq_eval.base.errors import QpeError
    from quark_ptq_eval.evaluate.ppl.kernels import pair_stats, token_stats

    generator = torch.Generator().manual_seed(0)
    q = 4 * torch.randn(2, 300, 97, generator=generator)  # 300 rows: several row blocks per window
    b = q + 0.05 * torch.randn(q.shape, generator=generator)
    labels = torch.randint(0, 97, (2, 300), generator=generator)
    fast, slow = pair_stats(q, labels, b), token_stats(q, labels, b)
    for name in ("nll", "base_nll"):
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fast["kl"], slow["kl"], rtol=1e-9, atol=1e-15)
    assert bool((fast["top1"] == slow["top1"]).all())
    huge = q.clone()
    huge[0, 3, 5] = 1e30  # exp overflows: the max-shifted float64 path answers, finite
    out = pair_stats(huge, labels, b)
    assert bool(torch.isfinite(out["kl"]).all()) and out["kl"][0, 3] > 1e29
    broken = q.clone()
    broken[1, 7, 2] = float("nan")
    with pytest.raises(QpeError, match="non-finite logits"):
        pair_stats(broken, labels, b)
