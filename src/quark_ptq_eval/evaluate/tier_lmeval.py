"""Tier 2: the lm-eval library on the model loaded in this process (the right loader, no server).

The estimate counts the requests the chosen tasks will make (documents x choices, few-shot
context, generation budget) and times a forward pass of that shape on the real model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.context_window import model_context
from quark_ptq_eval.base.errors import QpeError, UsageError
from quark_ptq_eval.base.fsio import atomic_write_text
from quark_ptq_eval.evaluate.context import RuntimeEstimate, TierContext, TierOutcome, hardware_description
from quark_ptq_eval.evaluate.tier_ppl import synchronize
from quark_ptq_eval.evaluate.verdict import Z95
from quark_ptq_eval.runtime.loading import LoadedModel, load_model, model_size_bytes, require_finite

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from quark_ptq_eval.evaluate.options import EvalOptions

SAMPLE_DOCS = 16  # documents per task tokenized to estimate request lengths
DEFAULT_GEN_TOKS = 256  # lm-eval's own default generation budget
RESULTS_DIR = "lm_eval_results"
LOG_NAME = "lm_eval.log"  # under the work dir's logs/: lm-eval's own messages


@dataclass
class Workload:
    requests: int = 0
    context_tokens: int = 0
    generated_tokens: int = 0
    per_task: dict[str, int] = field(default_factory=dict)  # documents per task
    notes: list[str] = field(default_factory=list)


@dataclass
class LmEvalPrepared:
    ctx: TierContext
    quantized: LoadedModel
    task_names: list[str]
    workload: Workload
    estimate: RuntimeEstimate
    pilot_s: float


def _import_lm_eval() -> tuple[Any, Any]:  # (the lm_eval module, its TaskManager class): no stubs
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UsageError("Tier 2 needs the lm_eval library: pip install 'quark-ptq-eval[eval]'.") from None
    return lm_eval, TaskManager


def task_manager(include_path: Path | None) -> Any:  # an lm_eval TaskManager
    _, TaskManager = _import_lm_eval()
    if include_path is not None and not Path(include_path).is_dir():
        raise UsageError(f"--include-path {include_path} is not a directory of lm-eval task YAMLs.")
    return TaskManager(include_path=str(include_path) if include_path else None)


def check_tasks(manager: Any, tasks: list[str]) -> list[str]:
    if not tasks:
        raise UsageError(
            "Tier 2 needs --tasks, e.g. --tasks arc_easy,hellaswag (or a local task with --include-path)."
        )
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UsageError(
            f"lm-eval does not know the task(s) {', '.join(unknown)}; check the names or --include-path."
        )
    return tasks


def load_task_objects(manager: Any, tasks: list[str]) -> dict[str, Any]:
    from lm_eval.tasks import get_task_dict

    try:
        return _flatten(get_task_dict(tasks, manager))
    except Exception as exc:  # noqa: BLE001 - dataset download/offline errors surface here
        raise UsageError(
            f"lm-eval could not load the data of {', '.join(tasks)} ({type(exc).__name__}: {str(exc)[:200]}); "
            "offline, use local task YAMLs with --include-path."
        ) from None


def _flatten(task_dict: dict[str, Any]) -> dict[str, Any]:
    flat = {}
    for key, value in task_dict.items():
        if isinstance(value, dict):
            flat.update(_flatten(value))
        elif value is not None:
            flat[getattr(key, "group_name", None) or str(key)] = value
    return flat


def count_workload(task_objects: dict[str, Any], tokenizer: PreTrainedTokenizerBase, options: EvalOptions) -> Workload:
    workload = Workload()
    for name, task in task_objects.items():
        try:
            _count_task(name, task, tokenizer, options, workload)
        except Exception as exc:  # noqa: BLE001 - an exotic task must not block the estimate
            workload.notes.append(f"{name}: request sizes not estimated ({type(exc).__name__}).")
    return workload


def _count_task(name: str, task: Any, tokenizer: PreTrainedTokenizerBase, options: EvalOptions,
                workload: Workload) -> None:
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


def pilot(loaded: LoadedModel, workload: Workload, batch_size: int) -> tuple[float, float, float]:
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


def resolution_warning(workload: Workload, options: EvalOptions) -> str | None:
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


def prepare(ctx: TierContext) -> LmEvalPrepared:
    options = ctx.options
    manager = task_manager(options.include_path)
    tasks = check_tasks(manager, options.tasks)
    started = time.perf_counter()
    task_objects = load_task_objects(manager, tasks)  # fails (offline, typos) before any model loads
    task_setup_s = time.perf_counter() - started  # lm-eval pays it again for every model it evaluates
    quantized = load_model(ctx.model_dir, options.device, options.trust_remote_code)
    ctx.log(f"loaded {ctx.model_dir} with the {quantized.loader} loader ({quantized.loader_reason})")
    workload = count_workload(task_objects, quantized.tokenizer, options)
    batch_size = options.batch_size or 1
    per_ctx, per_gen, pilot_s = pilot(quantized, workload, batch_size)
    models = 2 if options.baseline else 1
    seconds = models * (
        task_setup_s + workload.context_tokens * per_ctx + workload.generated_tokens * per_gen
    )
    seconds += quantized.load_s * (models - 1)  # the baseline loads after the quantized run
    estimate = RuntimeEstimate(
        tier="2 (lm_eval)",
        seconds=seconds,
        hardware=hardware_description(quantized.device),
        model_bytes=quantized.size_bytes + (model_size_bytes(options.baseline) if options.baseline else 0),
        data=(
            f"{sum(workload.per_task.values()):,} documents ({', '.join(f'{k}: {v}' for k, v in workload.per_task.items())}), "
            f"~{workload.requests:,} requests, ~{workload.context_tokens:,} context tokens"
            + (f", up to {workload.generated_tokens:,} generated tokens" if workload.generated_tokens else "")
        ),
        basis=(
            f"pilot forward of {batch_size} x {max(8, workload.context_tokens // max(1, workload.requests))} tokens: "
            f"{1 / per_ctx:,.0f} tokens/s"
            + (f"; decoding {1 / per_gen:,.1f} tokens/s" if per_gen else "")
            + (" (x2 for the baseline)" if models == 2 else "")
        ),
        warning=(
            "Full lm-eval benchmarks can take hours; use --limit N for a smoke run."
            if options.limit is None
            else resolution_warning(workload, options)
        ),
        threshold_s=options.confirm_above_s,
    )
    return LmEvalPrepared(ctx, quantized, tasks, workload, estimate, pilot_s)


def run_lm_eval(loaded: LoadedModel, prepared: LmEvalPrepared, label: str) -> dict[str, Any]:
    return evaluate_tasks(loaded, prepared.ctx, prepared.task_names, label)


def evaluate_tasks(loaded: LoadedModel, ctx: TierContext, task_names: list[str], label: str) -> dict[str, Any]:
    """lm-eval on ``loaded``; its results document (less the logged samples) is written to
    RESULTS_DIR/<label>.json and the per-sample scores to RESULTS_DIR/<label>.samples.json."""
    lm_eval, _ = _import_lm_eval()
    from lm_eval.models.huggingface import HFLM

    options = ctx.options
    ctx.log(f"lm-eval on the {label} model: {', '.join(task_names)}")
    with lm_eval_chatter_to(ctx.workdir / "logs" / LOG_NAME):
        lm = HFLM(
            pretrained=loaded.model,
            tokenizer=loaded.tokenizer,
            batch_size=options.batch_size or 1,
            max_length=model_context(loaded.model.config.to_dict())[0],  # RoPE scaling included
        )
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=task_names,
            num_fewshot=options.num_fewshot,
            limit=options.limit,
            task_manager=task_manager(options.include_path),
            log_samples=True,  # the per-document scores the paired tests need
            gen_kwargs={"max_gen_toks": options.max_gen_toks} if options.max_gen_toks else None,
            bootstrap_iters=1000,
        )
    if not results or not results.get("results"):
        raise QpeError(f"lm-eval returned no results for the {label} model.")
    samples = per_sample_scores(results.pop("samples", None) or {})
    path = ctx.workdir / RESULTS_DIR / f"{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(results, indent=2, default=str))  # lm-eval's own document, kept whole
    atomic_write_text(samples_path(ctx.workdir, label), json.dumps(samples, indent=1))
    results["per_sample"] = samples
    document: dict[str, Any] = results
    return document


def samples_path(workdir: Path, label: str) -> Path:
    return Path(workdir) / RESULTS_DIR / f"{label}.samples.json"


def per_sample_scores(samples: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, dict[str, float]]]:
    """lm-eval's logged samples as ``{task: {metric: {doc_id: score}}}``, scalar scores only (a rolling
    perplexity's per-document (loglikelihood, length) pairs are aggregated, not averaged: no paired
    test applies). A filter other than "none" is kept in the metric's name as in scores_from."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for task, rows in samples.items():
        for row in rows:
            flt = row.get("filter", "none")
            for metric in row.get("metrics", []):
                value = row.get(metric)
                if not isinstance(value, int | float):  # bool is an int: a right/wrong score counts as 0/1
                    continue
                name = metric if flt == "none" else f"{metric},{flt}"
                out.setdefault(task, {}).setdefault(name, {})[str(row["doc_id"])] = float(value)
    return out


# ---------------------------------------------------------------- paired significance

BOOTSTRAP_ITERS = 10_000
ALPHA = 0.05


def mcnemar(b: int, c: int) -> dict[str, float]:
    """McNemar's exact test on the discordant pairs: ``b`` documents right for the baseline only,
    ``c`` right for the scheme only. Under H0 each discordant pair is a fair coin, so with n = b + c
    the two-sided exact p is 2·P(X <= min(b, c)) (capped at 1) and the mid-p subtracts P(X = min)."""
    n, k = b + c, min(b, c)
    if n == 0:
        return {"p_value": 1.0, "mid_p_value": 1.0}
    pmf = [math.comb(n, i) / 2**n for i in range(k + 1)]
    tail = sum(pmf)
    return {"p_value": min(1.0, 2 * tail), "mid_p_value": min(1.0, 2 * tail - pmf[k])}


def paired_bootstrap(base: list[float], ours: list[float], iters: int = BOOTSTRAP_ITERS, seed: int = 0) -> float:
    """Two-sided p of the paired mean difference: resample documents, count resampled differences at
    least as far from the observed one as the observed one is from 0 (the shifted-null bootstrap)."""
    import numpy as np

    diffs = np.asarray(ours, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    n = diffs.size
    if n == 0:
        return 1.0
    observed = float(diffs.mean())
    if observed == 0 and np.all(diffs == 0):
        return 1.0
    rng, far, done = np.random.default_rng(seed), 0, 0
    chunk = max(1, 2**22 // n)  # resamples drawn at once (memory bound)
    while done < iters:
        m = min(chunk, iters - done)
        means = diffs[rng.integers(0, n, size=(m, n))].mean(axis=1)
        far += int(np.count_nonzero(np.abs(means - observed) >= abs(observed)))
        done += m
    return (far + 1) / (iters + 1)


def paired_tests(baseline: dict[str, Any], quantized: dict[str, Any], directions: dict[str, Any] | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """Per task and metric, the paired test between two per-sample score sets (per_sample_scores):
    McNemar (exact mid-p) where every score is 0/1, else a paired bootstrap of the mean difference."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for task, metrics in quantized.items():
        for metric, ours in metrics.items():
            theirs = (baseline.get(task) or {}).get(metric) or {}
            docs = sorted(set(ours) & set(theirs), key=lambda d: (len(d), d))
            if not docs:
                continue
            q, b = [ours[d] for d in docs], [theirs[d] for d in docs]
            entry: dict[str, Any] = {"documents": len(docs), "baseline_mean": sum(b) / len(b),
                                     "mean": sum(q) / len(q), "higher_is_better": (directions or {}).get(task, {}).get(metric)}
            if all(v in (0.0, 1.0) for v in q + b):
                lost = sum(1 for x, y in zip(b, q, strict=True) if x == 1 and y == 0)
                gained = sum(1 for x, y in zip(b, q, strict=True) if x == 0 and y == 1)
                exact = mcnemar(lost, gained)
                entry.update(test="McNemar exact (mid-p)", baseline_only=lost, scheme_only=gained,
                             p_value=exact["mid_p_value"], exact_p_value=exact["p_value"])
            else:
                entry.update(test=f"paired bootstrap ({BOOTSTRAP_ITERS} resamples)", p_value=paired_bootstrap(b, q))
            entry["significant"] = entry["p_value"] < ALPHA
            out.setdefault(task, {})[metric] = entry
    return out


@contextlib.contextmanager
def lm_eval_chatter_to(log_path: Path) -> Iterator[None]:
    """lm-eval's own messages go to ``log_path``, not the terminal: its logger (e.g. "`pretrained`
    model kwarg is not of type `str`", expected: we hand it the loaded model) and the `git describe`
    it runs for its results' git_hash (git's "fatal: not a git repository" outside a repository)."""
    import lm_eval.evaluator as evaluator

    log_path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("lm_eval")
    saved = logger.handlers[:], logger.propagate, evaluator.get_git_commit_hash
    handler = logging.FileHandler(log_path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(name)s] %(message)s"))
    logger.handlers, logger.propagate = [handler], False
    evaluator.get_git_commit_hash = lambda: _git_hash(log_path)
    try:
        with contextlib.redirect_stdout(handler.stream):  # its print()s ("bootstrapping for stddev: ...")
            yield
    finally:
        logger.handlers, logger.propagate, evaluator.get_git_commit_hash = saved
        handler.close()


def _git_hash(log_path: Path) -> str | None:
    """lm-eval's git_hash field (the current directory's commit), with git's stderr in the log."""
    with open(log_path, "a", encoding="utf-8") as log:
        try:
            proc = subprocess.run(["git", "describe", "--always"], stdout=subprocess.PIPE, stderr=log,
                                  text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def scores_from(results: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """({task: {metric: value}}, {task: {metric: stderr}}, {task: {metric: higher_is_better}})."""
    scores: dict[str, Any] = {}
    stderrs: dict[str, Any] = {}
    directions: dict[str, Any] = {}
    for task, metrics in results["results"].items():
        better = (results.get("higher_is_better") or {}).get(task, {})
        for key, value in metrics.items():
            if "," not in key or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            metric, filter_name = key.split(",", 1)
            target = stderrs if metric.endswith("_stderr") else scores
            metric = metric.removesuffix("_stderr")
            name = metric if filter_name == "none" else f"{metric},{filter_name}"
            target.setdefault(task, {})[name] = float(value)
            if metric in better and better[metric] is not None:
                directions.setdefault(task, {})[name] = bool(better[metric])
    return scores, stderrs, directions


def run(prepared: LmEvalPrepared) -> TierOutcome:
    ctx = prepared.ctx
    quantized_results = run_lm_eval(prepared.quantized, prepared, "quantized")
    quantized, q_stderr, directions = scores_from(quantized_results)
    details: dict[str, Any] = {
        "stderr": {"quantized": q_stderr},
        "workload": prepared.workload.__dict__,
        "loader": f"{prepared.quantized.loader} ({prepared.quantized.loader_reason})",
        "lm_eval_version": quantized_results.get("lm_eval_version"),
    }
    artifacts = {"lm_eval quantized results": str(ctx.workdir / RESULTS_DIR / "quantized.json")}
    baseline = None
    if ctx.options.baseline:
        _release(prepared)
        base_model = load_model(ctx.options.baseline, ctx.options.device, ctx.options.trust_remote_code)
        baseline_results = run_lm_eval(base_model, prepared, "baseline")
        baseline, b_stderr, _ = scores_from(baseline_results)
        details["stderr"]["baseline"] = b_stderr
        details["paired_tests"] = paired_tests(baseline_results["per_sample"], quantized_results["per_sample"],
                                               directions)
        artifacts["lm_eval baseline results"] = str(ctx.workdir / RESULTS_DIR / "baseline.json")
    notes = list(prepared.workload.notes)
    for task, metrics in quantized.items():
        for metric, value in metrics.items():
            if not math.isfinite(value):
                notes.append(f"{task}:{metric} is not finite ({value}).")
    details["noise"] = noise_from_stderr(q_stderr, details["stderr"].get("baseline"))
    # A task asked for that produced no score at all must not vanish from the verdict.
    details["required"] = {t: ["results"] for t in prepared.task_names if t not in quantized}
    return TierOutcome(
        quantized=quantized,
        baseline=baseline,
        directions=directions,
        details=details,
        notes=notes,
        artifacts=artifacts,
    )


def noise_from_stderr(quantized: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, dict[str, dict[str, Any]]]:
    """lm-eval's standard errors as the verdict's noise input: {task: {metric: {stderr, baseline_stderr}}}."""
    noise: dict[str, dict[str, dict[str, Any]]] = {}
    for task, metrics in quantized.items():
        for metric, se in metrics.items():
            entry = {"stderr": se}
            other = (baseline or {}).get(task, {}).get(metric)
            if other is not None:
                entry["baseline_stderr"] = other
            noise.setdefault(task, {})[metric] = entry
    return noise


def _release(prepared: LmEvalPrepared) -> None:
    """Free the quantized model before the baseline loads: only one model in memory at a time."""
    import gc

    prepared.quantized.model = None
    gc.collect()
