"""Tier 1's scoring kernels: per-token NLL, and against a baseline its NLL, KL and top-1, in one pass
over one batch's logits (nothing of the vocabulary outlives the batch).

With a baseline (``pair_stats``) the work per token is two float64 exponentials of each logit row
and a handful of float64 sums, in row blocks that stay in the CPU's cache:

    Z_b = sum exp(b),  Z_q = sum exp(q),  S = sum exp(b) * (b - q)
    KL(base || quant) = S / Z_b - log(Z_b / Z_q),   NLL = log Z - logit[label]

``b - q`` is exact in float64 (both are float32 values), and ``log(Z_b / Z_q)`` is a log of a
ratio, so no large logit offset is subtracted from another: the KL keeps ~1e-16 absolute precision
like a float64 log-softmax, at a fraction of its cost (bench/README.md). On a CPU the blocks run in
numpy (~1 us a call): each logit is widened to float64 once, into a block buffer that stays in the
cache, and the subtraction and both exps run on those in place; on an accelerator, torch in large chunks. No max is subtracted first: a row whose largest
logit is beyond +-600 (exp overflow) or any non-finite result sends the batch through
``token_stats``, the chunked float64 log-softmax that stays finite for any finite logits, after
``require_finite`` refused NaN/inf logits with its usual message. A NaN or inf logit always shows
as a non-finite Z or S, so no separate pass over the logits checks them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.allocator import release_freed_memory
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.runtime.loading import require_finite

if TYPE_CHECKING:
    import torch

    from quark_ptq_eval.evaluate.ppl.stats import Accumulator

ROW_CHUNK_ELEMENTS = 8 * 2**20  # float64 elements of the vocabulary softmax handled at once (memory bound)
CACHE_BLOCK_ELEMENTS = 2**16  # float64 elements per row block on a CPU: three such blocks stay in L2
TRIM_EVERY_WINDOWS = 32  # ~1 MiB a 2048-token window stays in glibc's arenas until trimmed
SAFE_LOGIT = 600.0  # exp(600) is finite in float64 (the limit is ~709): beyond it, the max-shifted path


def score_batch(model: torch.nn.Module, batch: torch.Tensor, acc: Accumulator,
                baseline: torch.nn.Module | None = None) -> None:
    """Score one batch of windows; with ``baseline``, also the same windows under it (one pass)."""
    import torch

    with torch.inference_mode():
        logits = model(batch).logits[:, :-1]
        labels = batch[:, 1:].to(logits.device)
        if baseline is None:
            require_finite(logits, "The quantized model")
            acc.add(token_stats(logits, labels), batch.shape[0])
            return
        base_logits = baseline(batch.to(_device_of(baseline))).logits[:, :-1].to(logits.device)
        if base_logits.shape[-1] != logits.shape[-1]:
            raise UsageError("The baseline's vocabulary differs from the quantized model's: KL is undefined.")
        acc.add(pair_stats(logits, labels, base_logits), batch.shape[0])
    release_every_few_windows(acc.windows - batch.shape[0], acc.windows)


def release_every_few_windows(before: int, after: int) -> None:
    """Each time the scored windows pass a multiple of ``TRIM_EVERY_WINDOWS``, the pages the batches freed
    go back to the OS: Tier 1's RSS then stays flat with the token count (base/allocator.py; 0.24 % of the
    scoring loop at 278 k tokens, bench/README.md)."""
    if after // TRIM_EVERY_WINDOWS != before // TRIM_EVERY_WINDOWS:
        release_freed_memory()


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def pair_stats(logits: torch.Tensor, labels: torch.Tensor, base_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per token ``[B, T]``: NLL, the baseline's NLL, KL(baseline || quantized), top-1 match (module docstring)."""
    fast = _pair_fast(logits, labels, base_logits)
    if fast is not None:
        return fast
    require_finite(logits, "The quantized model")
    require_finite(base_logits, "The baseline model")
    return token_stats(logits, labels, base_logits)


def _pair_fast(logits: torch.Tensor, labels: torch.Tensor, base_logits: torch.Tensor) -> dict[str, torch.Tensor] | None:
    import torch

    batch, tokens, vocab = logits.shape
    out = torch.empty(6, batch, tokens, dtype=torch.float64, device=logits.device)  # Z_b, Z_q, S, b_lab, q_lab, max
    top = torch.empty(2, batch, tokens, dtype=torch.int64, device=logits.device)
    if logits.device.type == "cpu":
        _pair_sums_numpy(logits.float(), base_logits.float(), labels, out.numpy(), top.numpy())
    else:
        _pair_sums_torch(logits, base_logits, labels, out, top)
    z_b, z_q, s, b_lab, q_lab, peak = out
    kl = (s / z_b - torch.log(z_b / z_q)).clamp_min_(0.0)  # clamp: rounding just below 0
    stats = {"nll": torch.log(z_q) - q_lab, "base_nll": torch.log(z_b) - b_lab, "kl": kl, "top1": top[0] == top[1]}
    finite = all(bool(torch.isfinite(v).all()) for v in (stats["nll"], stats["base_nll"], kl))
    return stats if finite and float(peak.max()) <= SAFE_LOGIT else None


def _pair_sums_numpy(logits: torch.Tensor, base_logits: torch.Tensor, labels: torch.Tensor, out: Any,
                     top: Any) -> None:
    """The CPU path in numpy: a call costs ~1 us against torch's ~10 us, so the row blocks that keep
    the work in the cache no longer cost their dispatch (bench/README.md)."""
    import numpy as np

    tokens, vocab = logits.shape[1:]
    step = max(16, CACHE_BLOCK_ELEMENTS // vocab)
    work = np.empty((3, min(step, tokens), vocab))  # exp(b), exp(q), b - q: float64, reused per block
    q_all, b_all, lab_all = logits.numpy(), base_logits.numpy(), labels.numpy()
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow sends the batch to token_stats: no warning
        for w in range(q_all.shape[0]):
            for start in range(0, tokens, step):
                rows = slice(start, start + step)
                _numpy_block(q_all[w, rows], b_all[w, rows], lab_all[w, rows], work, out[:, w, rows],
                             top[:, w, rows])


def _numpy_block(q: Any, b: Any, labels: Any, work: Any, out: Any, top: Any) -> None:
    """One block of rows: the three sums, the label logits, the largest |max logit| and both argmaxes."""
    import numpy as np

    n = q.shape[0]
    e_b, e_q, diff = work[0, :n], work[1, :n], work[2, :n]
    rows = np.arange(n)
    top[0], top[1] = q.argmax(1), b.argmax(1)  # the first largest, llama.cpp's rule
    out[3], out[4] = b[rows, labels], q[rows, labels]
    out[5] = np.maximum(np.abs(b[rows, top[1]]), np.abs(q[rows, top[0]]))
    # Each logit widened once (a ufunc given float32 casts its inputs again for every call: four
    # widenings a block, not two; 13 % of the kernel, bench/README.md), then float64 in place.
    e_b[...] = b
    e_q[...] = q
    np.subtract(e_b, e_q, out=diff)  # exact: both are float32 values
    np.exp(e_b, out=e_b)
    np.exp(e_q, out=e_q)
    e_b.sum(1, out=out[0])
    e_q.sum(1, out=out[1])
    np.einsum("ij,ij->i", e_b, diff, out=out[2])


def _pair_sums_torch(logits: torch.Tensor, base_logits: torch.Tensor, labels: torch.Tensor, out: torch.Tensor,
                     top: torch.Tensor) -> None:
    """An accelerator's path: large row chunks (its kernels are launched, not run, by Python)."""
    import torch

    batch, tokens, vocab = logits.shape
    step = max(1, ROW_CHUNK_ELEMENTS // vocab)
    buffers = torch.empty(3, min(step, tokens), vocab, dtype=torch.float64, device=logits.device)
    for w in range(batch):
        for start in range(0, tokens, step):
            rows = slice(start, start + step)
            _block(logits[w, rows], base_logits[w, rows], labels[w, rows], buffers, out[:, w, rows], top[:, w, rows])


def _block(q: torch.Tensor, b: torch.Tensor, labels: torch.Tensor, buffers: torch.Tensor, out: torch.Tensor,
           top: torch.Tensor) -> None:
    """One block of rows (torch): as ``_numpy_block``, with float64 copies of both logits."""
    import torch

    n = q.shape[0]
    x_b, x_q, e_b = buffers[0, :n], buffers[1, :n], buffers[2, :n]
    top[0], top[1] = q.argmax(-1), b.argmax(-1)
    x_b.copy_(b)
    x_q.copy_(q)
    picked = labels.unsqueeze(1)
    out[3], out[4] = x_b.gather(1, picked).squeeze(1), x_q.gather(1, picked).squeeze(1)
    out[5] = torch.maximum(x_b.gather(1, top[1].unsqueeze(1)).abs(), x_q.gather(1, top[0].unsqueeze(1)).abs()).squeeze(1)
    torch.exp(x_b, out=e_b)
    x_b.sub_(x_q)  # b - q, exact
    x_q.exp_()
    torch.sum(e_b, dim=-1, out=out[0])
    torch.sum(x_q, dim=-1, out=out[1])
    torch.bmm(e_b.unsqueeze(1), x_b.unsqueeze(2), out=out[2].view(n, 1, 1))


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
