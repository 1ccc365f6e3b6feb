"""The card's evaluation and serving sections: the figures eval_results.json holds (ours beside
the base model's, with their intervals and the verdict) and what vLLM was run with."""

from __future__ import annotations

import shlex
from typing import Any

from quark_ptq_eval.evaluate.tiers import TIERS
from quark_ptq_eval.publish.base_card import json_or_empty
from quark_ptq_eval.publish.facts import RunFacts

# the serving check's flags that belong to that one local start, not to serving the model
LOCAL_FLAGS = {"--model": 1, "--port": 1, "--host": 1, "--served-model-name": 1}


def evaluation_section(facts: RunFacts) -> list[str]:
    ev = facts.evaluation
    head = ["## Evaluation", ""]
    if ev is None:
        return [*head, f"Not evaluated: {_why_not_evaluated(facts)}. This card states no results."]
    if not ev.get("quantized"):
        return [*head, f"Tier `{ev.get('tier')}` was not run on this host (verdict `{ev.get('verdict')}`): "
                       "no results. This card states none."]
    qualifier = f", {ev['verdict_qualifier']}" if ev.get("verdict_qualifier") else ""
    tier = TIERS[ev["tier"]] if ev.get("tier") in TIERS.names() else None
    what = f"Tier {tier.number} (`{tier.name}`: {tier.method})" if tier else f"Tier `{ev.get('tier')}`"
    lines = [*head, f"{what}; {_settings(ev)}; verdict **{ev.get('verdict')}**{qualifier} (`eval_results.json`).", "",
             "| task | metric | this model | compared with | change | 95 % CI of the change | noise | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [_delta_row(d) for d in ev.get("deltas") or []]
    if not ev.get("baseline"):
        lines += ["", "The base model was not evaluated in this run (no `--baseline`): no figure of its own is beside ours."]
    notes = [f"- {d['task']} {d['metric']}: {d['note']}" for d in ev.get("deltas") or [] if d.get("note")]
    return lines + (["", *notes] if notes else []) + speed_lines(ev)


def speed_lines(ev: dict[str, Any]) -> list[str]:
    """The speed tier's line: what it measured, on which workload, hardware and vLLM (none: no speed tier)."""
    speed = (ev.get("details") or {}).get("speed")
    if not isinstance(speed, dict) or not speed.get("workload"):
        return []
    w = speed["workload"]
    measured = "; ".join(f"{label} {speed[label]['output_tokens_per_s']:.4g} output tokens/s, TPOT p50 "
                         f"{speed[label]['tpot_ms_p50']:.3g} ms" for label in ("quantized", "baseline")
                         if isinstance(speed.get(label), dict))
    p = speed.get("precision")  # measured alternately until a precision (evaluate/speed/precision.py)
    runs = (f"a warm-up, a pilot and {p['pairs']} pairs of repeats, quantized and baseline alternately" if p else
            f"a warm-up and {w['repeats']} repeats")
    return ["", f"Serving speed (vLLM's own benchmark, `vllm bench serve`): {str(speed.get('verdict')).rstrip('.')} "
                f"({measured or 'nothing measured'}). Workload: {p['repeat_prompts'] if p else w['prompts']} random "
                f"prompts of {w['input_len']} -> {w['output_len']} tokens at concurrency {w['concurrency']}, {runs}; "
                f"hardware: {speed.get('hardware') or '-'}; {speed.get('vllm_version') or 'no vLLM'}."]


def _why_not_evaluated(facts: RunFacts) -> str:
    if any(n.startswith("eval_results.json") for n in facts.left_out):
        return "the work dir's eval_results.json is about another model"
    step = json_or_empty(facts.workdir / "run_state.json").get("steps", {}).get("eval") or {}
    if step.get("status") == "skipped":
        return "evaluation was skipped (`--eval-tier skip`); `quark-ptq-eval eval` then `quark-ptq-eval card` add it"
    return "the run did not evaluate this export"


def _settings(ev: dict[str, Any]) -> str:
    s = ev.get("settings") or {}
    shown = {k: s[k] for k in ("eval_data", "seq_len", "max_windows", "tasks", "limit", "num_fewshot") if s.get(k)}
    return ", ".join(f"{k} {v}" for k, v in shown.items()) or "default settings"


def _delta_row(d: dict[str, Any]) -> str:
    against = {"baseline": "base model", "ideal": "ideal", "reference": "published"}.get(str(d.get("compared_to")), "-")
    other = f"{against} {_num(d.get('other'))}" if d.get("compared_to") else "-"
    change = f"{d['degradation_pct']:+.3g} %" if isinstance(d.get("degradation_pct"), (int, float)) else "-"
    ci = d.get("ci95_pct")
    interval = f"[{ci[0]:+.3g}, {ci[1]:+.3g}] %" if isinstance(ci, list) and len(ci) == 2 else "-"
    return (f"| {d.get('task')} | {d.get('metric')} | {_num(d.get('value'))} | {other} | {change} | {interval} | "
            f"{d.get('noise') or '-'} | {d.get('verdict')} |")


def _num(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def serving_section(facts: RunFacts, repo_id: str) -> list[str]:
    lines = ["## Serving", ""]
    check = ((facts.validation or {}).get("checks") or {}).get(serving_check()) or {}
    argv = (check.get("stats") or {}).get("argv")
    if argv:
        stats = check["stats"]
        outcome = "served it (healthy)" if stats.get("served") else "did not serve it"
        lines += [f"The serving check ({stats.get('vllm', 'vLLM')}) {outcome}. Its command as a `vllm serve` line "
                  "(less the local port, host and served name of that one start):", "", "```bash",
                  serve_line(argv, repo_id), "```"]
        lines += [f"- {f.get('message')}" for f in check.get("findings") or []]
    else:
        reason = check.get("skipped_reason") or "the run holds no serving check"
        lines.append(f"Not served by this run's serving check ({reason}).")
    planned = plan_serve_line(facts, repo_id)
    lines += ["", "For the plan's target:", "", "```bash", planned, "```", "", *_target(facts)]
    return lines


def serving_check() -> str:
    """The name of the validation check that starts vLLM on the export (its row in validate/checks.py)."""
    from quark_ptq_eval.validate.checks import CHECKS
    from quark_ptq_eval.validate.servecheck import check_serving

    return next(c.name for c in CHECKS.where(lambda c: c.run is check_serving))


def serve_line(argv: list[str], repo_id: str) -> str:
    """``vllm serve REPO`` with the serving check's own flags (less those of its local start)."""
    flags, skip = [], 0
    start = argv.index("--model") if "--model" in argv else len(argv)
    for arg in argv[start:]:
        if skip:
            skip -= 1
        elif arg in LOCAL_FLAGS:
            skip = LOCAL_FLAGS[arg]
        else:
            flags.append(arg)
    return shlex.join(["vllm", "serve", repo_id, *flags])


def plan_serve_line(facts: RunFacts, repo_id: str) -> str:
    """The plan's serving fit as vLLM flags (tensor parallelism, KV-cache dtype, the goal's context)."""
    from quark_ptq_eval.evaluate.serving.commands import served_models

    model = served_models(facts.export, None, facts.plan.as_json())[0][0]
    flags = [*(["--tensor-parallel-size", str(model.tensor_parallel)] if model.tensor_parallel else []),
             *(["--kv-cache-dtype", model.kv_cache_dtype] if model.kv_cache_dtype else []),
             *(["--max-model-len", str(model.max_model_len)] if model.max_model_len else []),
             *(["--trust-remote-code"] if facts.plan.trust_remote_code else [])]
    return shlex.join(["vllm", "serve", repo_id, *flags])


def _target(facts: RunFacts) -> list[str]:
    target = facts.plan.target or {}
    fit = next((d for d in facts.plan.decisions if d.get("decision") == "serving fit"), None)
    lines = [f"- target: {target.get('label') or 'this host'} ({target.get('source') or 'no target named'})"]
    if fit:
        return [*lines, f"- serving fit: {fit.get('value')}: {fit.get('reason')}"]
    return [*lines, "- serving fit: none computed (the plan names no target device; give one in --goal)"]
