"""Tier 2's estimate: the requests the chosen tasks will make (documents x choices, few-shot
context, generation budget), a forward pass of that shape timed on the real model, and whether
--limit leaves enough documents to resolve the healthy threshold."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.evaluate.ppl.tier import synchronize
from quark_ptq_eval.evaluate.verdict import Z95
from quark_ptq_eval.runtime.loading import require_finite

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from quark_ptq_eval.evaluate.options import EvalOptions
    from quark_ptq_eval.runtime.loading import LoadedModel

SAMPLE_DOCS = 16  # documents per task tokenized to estimate request lengths
DEFAULT_GEN_TOKS = 256  # lm-eval's own default generation budget


@dataclass
class LmEvalWorkload:
    """What lm-eval will be asked to do: its requests and tokens, counted on a sample of each task's documents."""

    requests: int = 0
    context_tokens: int = 0
    generated_tokens: int = 0
    per_task: dict[str, int] = field(default_factory=dict)  # documents per task
    notes: list[str] = field(default_factory=list)


def count_workload(task_objects: dict[str, Any], tokenizer: PreTrainedTokenizerBase, options: EvalOptions) -> LmEvalWorkload:
    workload = LmEvalWorkload()
    for name, task in task_objects.items():
        try:
            _count_task(name, task, tokenizer, options, workload)
        except Exception as exc:  # noqa: BLE001 - an exotic task must not block the estimate
            workload.notes.append(f"{name}: request sizes not estimated ({type(exc).__name__}).")
    return workload


def _count_task(name: str, task: Any, tokenizer: PreTrainedTokenizerBase, options: EvalOptions,
                workload: LmEvalWorkload) -> None:
    docs = list(task.eval_docs)
    limit = options.limit
    n = (
        len(docs)
        if limit is None
        else (math.ceil(len(docs) * limit) if limit < 1 else min(len(docs), int(limit)))
    )
    workload.per_task[name] = n
    sample = docs[: min(n, SAMPLE_DOCS)]
    if not sample:
        return
    shots = options.num_fewshot if options.num_fewshot is not None else (task.config.num_fewshot or 0)
    output_type = task.OUTPUT_TYPE
    lengths: list[float] = []
    choices: list[int] = []
    gen = 0
    for doc in sample:
        if output_type == "loglikelihood_rolling":
            lengths.append(_tokens(tokenizer, task.doc_to_target(doc)))
            choices.append(1)
            continue
        context = _tokens(tokenizer, task.doc_to_text(doc)) * (1 + shots)
        options_list = task.doc_to_choice(doc) if output_type == "multiple_choice" else [""]
        choices.append(len(options_list))
        lengths.append(context + statistics.mean(_tokens(tokenizer, c) for c in options_list))
    per_doc_requests = statistics.mean(choices)
    workload.requests += round(n * per_doc_requests)
    workload.context_tokens += round(n * per_doc_requests * statistics.mean(lengths))
    if output_type == "generate_until":
        gen = options.max_gen_toks or (task.config.generation_kwargs or {}).get(
            "max_gen_toks", DEFAULT_GEN_TOKS
        )
        workload.generated_tokens += n * int(gen)


def _tokens(tokenizer: PreTrainedTokenizerBase, text: Any) -> int:
    if isinstance(text, list):
        text = text[0] if text else ""
    return len(tokenizer(str(text)).input_ids) if text else 0


def pilot(loaded: LoadedModel, workload: LmEvalWorkload, batch_size: int) -> tuple[float, float, float]:
    """(seconds per context token, seconds per generated token, pilot seconds) on the real model."""
    import torch

    started = time.perf_counter()
    length = max(8, min(2048, workload.context_tokens // max(1, workload.requests)))
    ids = torch.randint(
        0,
        min(loaded.tokenizer.vocab_size, 30000),
        (batch_size, length),
        generator=torch.Generator().manual_seed(0),
    )
    ids = ids.to(loaded.device)
    with torch.inference_mode():
        loaded.model(ids[:, : min(length, 16)])  # warm-up
        timed = _clock(loaded.device)
        logits = loaded.model(ids).logits
        per_context_token = (_clock(loaded.device) - timed) / ids.numel()
        require_finite(logits, "The model")
        per_generated_token = 0.0
        if workload.generated_tokens:
            timed = _clock(loaded.device)
            loaded.model.generate(
                ids[:1, :length],
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
                pad_token_id=loaded.tokenizer.pad_token_id or loaded.tokenizer.eos_token_id,
            )
            per_generated_token = (_clock(loaded.device) - timed) / 8
    return per_context_token, per_generated_token, _clock(loaded.device) - started


def _clock(device: str) -> float:
    """perf_counter after the device's queued work is done: GPU kernels run asynchronously."""
    synchronize(device)
    return time.perf_counter()


def resolution_warning(workload: LmEvalWorkload, options: EvalOptions) -> str | None:
    """Said at the checkpoint when --limit leaves too few documents to resolve the healthy threshold.

    A 0/1 score near 50 % has a per-document standard deviation of half its mean, so its relative
    95 % half-width over n documents is 100 * z / sqrt(n) percent (sqrt(2) more for a difference
    with an unpaired baseline).
    """
    if options.limit is None or not workload.per_task:
        return None
    healthy = options.thresholds.healthy_pct
    pairs = 2 if options.baseline else 1
    needed = math.ceil(pairs * (100 * Z95 / healthy) ** 2) if healthy > 0 else math.inf
    fewest = min(workload.per_task.values())
    if fewest >= needed:
        return None
    half = 100 * Z95 * math.sqrt(pairs / max(1, fewest))
    against = "the difference with the baseline" if options.baseline else "a score"
    return (
        f"--limit {options.limit:g} is too small to resolve the healthy threshold: with {fewest} documents "
        f"the 95 % interval of {against} near 50 % is about ±{half:.0f} % (relative), wider than "
        f"--healthy-pct {healthy:g}; about {needed:,} documents per task would resolve it, so expect "
        "'watch' rather than 'healthy'."
    )
