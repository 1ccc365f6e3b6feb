"""The unquantized model's Tier 1 outputs, computed once and reused by every scheme it is compared with.

Per window the cache holds the baseline's token NLLs (float64, exact) and a compact next-token
distribution: the top-K log-probabilities with their token ids, and the log of the remaining
tail mass ``r = 1 - sum(top-K probabilities)`` (a logsumexp over the tail, so small tails keep
their precision). It is keyed by the source model's content digest, the tokenizer's fingerprint
(vocabulary and special tokens, not its file bytes: exports re-save tokenizer files), the hash of
the evaluation text, the window length, the window count and K.

KL from the cache. With S the baseline's top-K tokens, T the rest, p the baseline and q a scheme:

    KL_cached = sum_{v in S} p_v log(p_v / q_v) + r log(r / q_T),   q_T = sum_{v in T} q_v

is the KL between the two distributions with the tail merged into one bucket. By the log-sum
inequality it never exceeds the full KL, and the gap is exactly ``r * KL(p|T || q|T)``. Every tail
probability is at most ``m = min(p_K, r)`` (p_K the K-th largest baseline probability), so

    0 <= KL_full - KL_cached <= r * log(m * q_T / (r * q_min)),   q_min = min_{v in T} q_v,

which is computable from the cache and the scheme's full logits: it is reported per token
(``kl_cache_gap_bound``) next to the KL. It is a worst case over every tail the baseline could
have: tight when r is small, loose when much mass lies outside the top K (raise K then); the
tail mass itself is reported too. Top-1 agreement, both NLLs and so Δp (llama.cpp's token
probability statistics) are exact; the cache keeps the baseline's argmax (``top1``) by the same
first-maximum rule as Tier 1's live scoring.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.fsio import atomic_write_bytes, write_json
from quark_ptq_eval.base.state import digest
from quark_ptq_eval.evaluate.ppl.kernels import (
    ROW_CHUNK_ELEMENTS,  # one bound on the float64 rows held at once
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# 2: adds ``top1`` (the first argmax of the float32 logits, Tier 1's own top-1 rule, for llama.cpp's
# "same top p"). An entry of another format is rebuilt, never read (``stale_reason``).
CACHE_FORMAT = "quark-ptq-eval/baseline_cache/2"
DEFAULT_TOP_K = 64
META_FILE = "meta.json"
TENSORS_FILE = "baseline.safetensors"
_HASH_CHUNK = 16 * 2**20


@dataclass(frozen=True)
class CacheKey:
    model_digest: str
    tokenizer_fingerprint: str
    data_hash: str
    seq_len: int
    windows: int
    top_k: int

    @property
    def id(self) -> str:
        return digest(asdict(self))


@dataclass
class BaselineEntry:
    """One cached baseline: ``ids`` [n, seq_len]; ``nll``, ``log_tail`` [n, seq_len-1]; ``topk_*`` [.., K]."""

    key: CacheKey
    path: Path
    ids: Any
    nll: Any
    topk_logp: Any
    topk_ids: Any
    log_tail: Any
    meta: dict[str, Any]
    top1: Any = None


# ---------------------------------------------------------------- the key


def model_digest(model_dir: Path) -> str:
    """sha256 over config.json and every weight file's bytes (the weights decide the baseline)."""
    from quark_ptq_eval.base.safetensors_io import weight_files

    h = hashlib.sha256()
    for path in [Path(model_dir) / "config.json", *weight_files(model_dir)]:
        h.update(path.name.encode())
        with open(path, "rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """What tokenization depends on, independent of how the files were serialised."""
    specials = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    return digest({"vocab": sorted(tokenizer.get_vocab().items()), "specials": specials})


def data_hash(texts: list[str]) -> str:
    return hashlib.sha256("\n\n".join(texts).encode("utf-8")).hexdigest()[:16]


# ---------------------------------------------------------------- scoring


def baseline_token_stats(logits: torch.Tensor, labels: torch.Tensor, top_k: int) -> dict[str, Any]:
    """Per token ``[B, T]``: the baseline's NLL and log tail mass, and its top-K log-probs/ids ``[B, T, K]``."""
    import torch

    vocab = logits.shape[-1]
    k = min(top_k, vocab)
    rows, flat = logits.reshape(-1, vocab), labels.reshape(-1, 1)
    parts: dict[str, list[Any]] = {"nll": [], "topk_logp": [], "topk_ids": [], "log_tail": [], "top1": []}
    step = max(1, ROW_CHUNK_ELEMENTS // vocab)
    for start in range(0, rows.shape[0], step):
        sl = slice(start, start + step)
        parts["top1"].append(rows[sl].argmax(-1).int())  # first maximum, as ppl.tier's live scoring
        log_p = torch.log_softmax(rows[sl].double(), dim=-1)
        values, ids = log_p.topk(k, dim=-1)
        parts["nll"].append(-log_p.gather(1, flat[sl]).squeeze(1))
        parts["topk_logp"].append(values.float())
        parts["topk_ids"].append(ids.int())
        parts["log_tail"].append(log_p.scatter(1, ids, -math.inf).logsumexp(-1))
    shape = tuple(labels.shape)
    return {
        "nll": torch.cat(parts["nll"]).view(shape),
        "topk_logp": torch.cat(parts["topk_logp"]).view(*shape, k),
        "topk_ids": torch.cat(parts["topk_ids"]).view(*shape, k),
        "log_tail": torch.cat(parts["log_tail"]).view(shape),
        "top1": torch.cat(parts["top1"]).view(shape),
    }


class CachedTokenStats(TypedDict):
    """A scheme's per-token statistics against the cached baseline, each ``[B, T]`` float64 (``top1``: bool)."""

    nll: torch.Tensor  # the scheme's
    base_nll: torch.Tensor  # the baseline's, from the cache
    kl: torch.Tensor  # KL(baseline || scheme) over the cached top-K and one tail bucket: a lower bound
    kl_gap_bound: torch.Tensor  # how far below the full-logit KL that can be (module docstring)
    top1: torch.Tensor  # the scheme's argmax is the baseline's
    tail_mass: torch.Tensor  # the baseline's probability outside its cached top-K


def cached_token_stats(logits: torch.Tensor, labels: torch.Tensor, topk_logp: torch.Tensor, topk_ids: torch.Tensor,
                       log_tail: torch.Tensor, base_nll: torch.Tensor,
                       base_top1: torch.Tensor | None = None) -> CachedTokenStats:
    """A scheme's per-token NLL, and against the cached baseline: its NLL, KL (cached), top-1 match and
    the bound on the KL's gap to the full-logit KL (module docstring). All ``[B, T]``, float64."""
    import torch

    vocab = logits.shape[-1]
    shape = tuple(labels.shape)
    rows, flat = logits.reshape(-1, vocab), labels.reshape(-1, 1)
    lp_all, ids_all = topk_logp.reshape(-1, topk_logp.shape[-1]).double(), topk_ids.reshape(-1, topk_ids.shape[-1])
    lr_all = log_tail.reshape(-1).double()
    top_all = (topk_ids[..., 0] if base_top1 is None else base_top1).reshape(-1).long()
    step = max(1, ROW_CHUNK_ELEMENTS // vocab)
    parts: dict[str, list[Any]] = {"nll": [], "kl": [], "top1": [], "kl_gap_bound": [], "tail_mass": []}
    for start in range(0, rows.shape[0], step):
        sl = slice(start, start + step)
        log_q = torch.log_softmax(rows[sl].double(), dim=-1)
        lp, ids, lr = lp_all[sl], ids_all[sl].long(), lr_all[sl]
        parts["nll"].append(-log_q.gather(1, flat[sl]).squeeze(1))
        lq_top = log_q.gather(1, ids)
        tail_q = log_q.scatter(1, ids, math.inf)  # +inf marks the top-K: ignored by min, masked for logsumexp
        lq_tail = tail_q.masked_fill(tail_q.isinf(), -math.inf).logsumexp(-1)
        lq_min = tail_q.min(-1).values
        r = lr.exp()
        parts["tail_mass"].append(r)
        kl_top = (lp.exp() * (lp - lq_top)).sum(-1)
        kl_tail = torch.where(r > 0, r * (lr - lq_tail), 0.0)
        parts["kl"].append((kl_top + kl_tail).clamp_min(0.0))
        log_m = torch.minimum(lp[:, -1], lr)
        bound = torch.where(r > 0, r * (log_m + lq_tail - lr - lq_min), 0.0)
        parts["kl_gap_bound"].append(bound.clamp_min(0.0).nan_to_num(0.0))  # no tail (K = vocab): no gap
        parts["top1"].append(rows[sl].argmax(-1) == top_all[sl])
    out = {k: torch.cat(v).view(shape) for k, v in parts.items()}
    return CachedTokenStats(nll=out["nll"], base_nll=base_nll.to(out["nll"].device).double(), kl=out["kl"],
                            kl_gap_bound=out["kl_gap_bound"], top1=out["top1"], tail_mass=out["tail_mass"])


# ---------------------------------------------------------------- the store


class BaselineCache:
    """A directory of cached baselines, one sub-directory per key. ``writes`` and ``hits`` count
    what this object did (a comparison reports them)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.writes = 0
        self.hits = 0

    def key_for(self, source: Path, tokenizer: PreTrainedTokenizerBase, texts: list[str], windows: torch.Tensor,
                top_k: int) -> CacheKey:
        return CacheKey(model_digest(source), tokenizer_fingerprint(tokenizer), data_hash(texts),
                        int(windows.shape[1]), int(windows.shape[0]), int(top_k))

    def path_for(self, key: CacheKey) -> Path:
        return self.root / key.id

    def has(self, key: CacheKey) -> bool:
        meta = self._meta(key)
        return bool(meta and meta.get("key") == asdict(key) and meta.get("format") == CACHE_FORMAT)

    def stale_reason(self, key: CacheKey) -> str | None:
        """Why an entry stored under ``key`` is not used (an older format), or None."""
        meta = self._meta(key)
        if meta and meta.get("key") == asdict(key) and meta.get("format") != CACHE_FORMAT:
            return (f"the cached baseline {key.id} was written in format {meta.get('format')!r}, which lacks what "
                    f"Tier 1's statistics now need ({CACHE_FORMAT}): recomputing it")
        return None

    def _meta(self, key: CacheKey) -> dict[str, Any] | None:
        meta = self.path_for(key) / META_FILE
        if not meta.is_file() or not (self.path_for(key) / TENSORS_FILE).is_file():
            return None
        try:
            loaded = json.loads(meta.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # a damaged entry is rebuilt
        return loaded if isinstance(loaded, dict) else None

    def load(self, key: CacheKey) -> BaselineEntry:
        from safetensors.torch import load_file

        path = self.path_for(key)
        if not self.has(key):
            raise UsageError(f"No cached baseline for key {key.id} in {self.root}.", "Build it first (ensure()).")
        t = load_file(str(path / TENSORS_FILE))
        self.hits += 1
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
        return BaselineEntry(key, path, t["ids"], t["nll"], t["topk_logp"], t["topk_ids"], t["log_tail"], meta,
                             t["top1"])

    def build(self, key: CacheKey, model: PreTrainedModel, windows: torch.Tensor, batch_size: int, source: Path,
              log: Callable[[str], None] = print) -> Path:
        """Score ``windows`` with the baseline ``model`` and store the result (atomically)."""
        import torch
        from safetensors.torch import save

        from quark_ptq_eval.runtime.loading import require_finite

        started, chunks = time.perf_counter(), []
        device = next(model.parameters()).device
        with torch.inference_mode():
            for i in range(0, windows.shape[0], batch_size):
                batch = windows[i : i + batch_size].to(device)
                logits = model(batch).logits[:, :-1]
                require_finite(logits, "The baseline model")
                chunks.append({k: v.cpu() for k, v in baseline_token_stats(logits, batch[:, 1:], key.top_k).items()})
        tensors = {k: torch.cat([c[k] for c in chunks]).contiguous() for k in chunks[0]}
        tensors["ids"] = windows.to(torch.int64).contiguous()
        path = self.path_for(key)
        # fsio's writer: fsynced and renamed, and a full disk is one sentence naming the file, no temporary left
        atomic_write_bytes(path / TENSORS_FILE, save(tensors))
        seconds = time.perf_counter() - started
        write_json(path / META_FILE, {"format": CACHE_FORMAT, "key": asdict(key), "source_model": str(source),
                                      "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                      "seconds": round(seconds, 2), "bytes": (path / TENSORS_FILE).stat().st_size,
                                      "full_logits_bytes": full_logits_bytes(key, model)})
        self.writes += 1
        log(f"baseline cached: {windows.shape[0]} windows, top-{key.top_k} in {seconds:.1f} s -> {path}")
        return path


def full_logits_bytes(key: CacheKey, model: PreTrainedModel) -> int:
    """What storing the baseline's full float32 logits for the same windows would take."""
    vocab: int = model.get_output_embeddings().weight.shape[0]
    return key.windows * (key.seq_len - 1) * vocab * 4
