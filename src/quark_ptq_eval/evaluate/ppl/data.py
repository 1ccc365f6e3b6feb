"""Tier 1's text: the documents to score, their token windows and how many windows go in one batch.

Windowing matches Quark's ``quark.contrib.llm_eval.evaluation.ppl_eval``: the text is joined with
blank lines, tokenized once, cut into ``len // seq_len`` full windows (the tail is dropped).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from quark_ptq_eval.base.errors import UsageError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

LOGIT_BUDGET = 64 * 2**20  # logits elements per batch when --batch-size is not given
MAX_AUTO_BATCH = 8
CPU_TOKENS_PER_BATCH = 2048  # on a CPU larger batches only add cache misses (bench/README.md)


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
