"""Tier 2's use of lm-eval: its tasks (checked and loaded before any model), a run on a model
loaded in this process (its own messages to the log) and its results read back as scores,
standard errors and per-document scores."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.context_window import model_context
from quark_ptq_eval.base.errors import QpeError, UsageError
from quark_ptq_eval.base.fsio import atomic_write_text

if TYPE_CHECKING:
    from quark_ptq_eval.evaluate.context import TierInputs
    from quark_ptq_eval.runtime.loading import LoadedModel

RESULTS_DIR = "lm_eval_results"
LOG_NAME = "lm_eval.log"  # under the work dir's logs/: lm-eval's own messages


def _import_lm_eval() -> tuple[Any, Any]:  # (the lm_eval module, its TaskManager class): no stubs
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UsageError("Tier 2 needs the lm_eval library: pip install 'quark-ptq-eval[eval]'.") from None
    return lm_eval, TaskManager


def task_manager(include_path: Path | None) -> Any:  # an lm_eval TaskManager
    """lm-eval's index of its ~15,000 task YAMLs and ours (8 s to build on a 2-core host), built once per
    process: a Tier 2 run asks for it to check the tasks, then for each model it scores. It is read-only
    once built; an edited, added or removed YAML under ``include_path`` makes a new one."""
    _import_lm_eval()  # the one-sentence error when lm_eval is missing
    if include_path is not None and not Path(include_path).is_dir():
        raise UsageError(f"--include-path {include_path} is not a directory of lm-eval task YAMLs.")
    return _indexed(str(include_path) if include_path else None, _yaml_stamp(include_path))


@functools.lru_cache(maxsize=4)
def _indexed(include_path: str | None, stamp: tuple[tuple[str, int, int], ...]) -> Any:
    _, TaskManager = _import_lm_eval()
    return TaskManager(include_path=include_path)


def _yaml_stamp(include_path: Path | None) -> tuple[tuple[str, int, int], ...]:
    """What the index of ``include_path`` was built from: each YAML's path, size and modification time."""
    if include_path is None:
        return ()
    files = sorted(p for p in Path(include_path).rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
    return tuple((str(p), (st := p.stat()).st_size, st.st_mtime_ns) for p in files)


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


def evaluate_tasks(loaded: LoadedModel, ctx: TierInputs, task_names: list[str], label: str) -> dict[str, Any]:
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
