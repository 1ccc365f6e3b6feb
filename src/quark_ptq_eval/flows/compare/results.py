"""comparison.json, comparison_report.md and the Pareto chart, read back from every scheme's own files
(so a resumed comparison reports the schemes done before the interruption the same way)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.fsio import atomic_write_text, read_json, write_json
from quark_ptq_eval.base.state import RunState
from quark_ptq_eval.evaluate.report import json_safe
from quark_ptq_eval.evaluate.verdict import BEYOND_NOISE
from quark_ptq_eval.flows.compare.options import CompareOptions
from quark_ptq_eval.flows.compare.recommend import pareto_front, recommend, speed_front
from quark_ptq_eval.plan.targets import priority

SCHEMA = "quark-ptq-eval/comparison/1"
JSON_NAME, REPORT_NAME, CHART_NAME = "comparison.json", "comparison_report.md", "comparison_pareto.png"
SPEED_CHART_NAME = "comparison_speed_pareto.png"  # compare --speed: accuracy against measured throughput


def _bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def _source_params(source: Path) -> int:
    from quark_ptq_eval.base.safetensors_io import read_model_headers

    return sum(math.prod(t.shape) for t in read_model_headers(source).values())


def scheme_row(comparison, scheme: str, source_bytes: int, params: int) -> dict[str, Any]:
    record = comparison.state.steps.get(f"scheme:{scheme}", {})
    wd, out = comparison.workdir(scheme), comparison.output_dir(scheme)
    steps = RunState.load(wd).steps
    row: dict[str, Any] = {"scheme": scheme, "status": record.get("status", "not run"),
                           "validation": steps.get("validate", {}).get("status"),
                           "model_dir": str(out), "workdir": str(wd)}
    if record.get("status") == "failed":
        row.update(failed_step=record.get("failed_step"), error=record.get("error"), hint=record.get("hint"))
    runs = _manifest_runs(wd)
    if runs:
        row["quantize_s"] = runs[-1].get("seconds")
    if out.is_dir() and _bytes(out):
        size = _bytes(out)
        row.update(size_bytes=size, compression_ratio=source_bytes / size, bits_per_weight=8 * size / params)
        row.update(_serving_fields(comparison, wd, size))
    results = wd / "eval_results.json"
    if record.get("status") == "evaluated" and results.is_file():
        row.update(_eval_fields(read_json(results, "evaluation results")))
        if record.get("tasks_key"):
            from quark_ptq_eval.flows.compare.tasks import read_rows, worst_drop

            row["tasks"] = read_rows(wd)
            row["task_drop_pct"] = worst_drop(row["tasks"])
    return row


def _serving_fields(comparison, wd: Path, size: int) -> dict[str, Any]:
    """Whether the measured export fits the goal's serving budget ("fit one MI300X with 32k context"),
    as the plan sized it (plan/resources.py serving_fit), when the goal states one."""
    from quark_ptq_eval.base.artifacts import ModelAnalysis, QuantPlan
    from quark_ptq_eval.plan import resources

    plan = QuantPlan.load(wd) if QuantPlan.path_in(wd).exists() else None
    target = plan.target if plan else {}
    if plan is None or not (target.get("budget") and target.get("memory_gb")):
        return {}
    fit = resources.serving_fit(ModelAnalysis.load(comparison.root), size, plan.kv_cache_scheme, target["memory_gb"],
                                target["budget"])
    return {"fits_serving_budget": fit.fits_budget,
            "serving_fit_text": resources.serving_text(fit, str(target.get("label") or target.get("name")), plan.kv_cache_scheme)}


def _manifest_runs(wd: Path) -> list[dict]:
    from quark_ptq_eval.base.artifacts import RunManifest

    try:
        return RunManifest.load(wd).runs if RunManifest.path_in(wd).exists() else []
    except Exception:  # noqa: BLE001 - a damaged manifest only costs the time column
        return []


def export_row(eval_doc: dict, model_dir: Path, source: Path) -> dict[str, Any]:
    """A run's own export as a comparison row: its size and Tier 1 results (eval_results.json's ``eval_doc``)."""
    size = _bytes(model_dir)
    return {"status": "evaluated", "model_dir": str(model_dir), "size_bytes": size,
            "bits_per_weight": 8 * size / _source_params(source), **_eval_fields(eval_doc)}


def _eval_fields(doc: dict) -> dict[str, Any]:
    d = doc.get("details") or {}
    q, b, kl, paired = d.get("quantized", {}), d.get("baseline", {}), d.get("kl", {}), d.get("paired", {})
    ppl, base = q.get("perplexity"), b.get("perplexity")
    return {
        "perplexity": ppl, "perplexity_ci95": [q.get("perplexity_ci95_low"), q.get("perplexity_ci95_high")],
        "baseline_perplexity": base,
        "ppl_increase_pct": 100 * (ppl / base - 1) if ppl and base else None,
        "delta_nll": paired.get("delta_nll"), "delta_nll_stderr": paired.get("delta_nll_stderr"),
        "delta_nll_ci95": [paired.get("delta_nll_ci95_low"), paired.get("delta_nll_ci95_high")],
        "significant": paired.get("noise") == BEYOND_NOISE if paired.get("noise") else None,
        "noise": paired.get("noise"),
        "kl_mean": kl.get("kl_divergence"), "kl_p50": kl.get("kl_p50"), "kl_p99": kl.get("kl_p99"),
        "kl_max": kl.get("kl_max"), "kl_cache_gap_bound_mean": kl.get("kl_cache_gap_bound_mean"),
        "baseline_tail_mass_mean": kl.get("baseline_tail_mass_mean"),
        "top1_agreement": kl.get("top1_agreement"), "verdict": doc.get("verdict"),
        "windows": q.get("windows"), "tokens": q.get("tokens"),
        "kld_report": {k: v for k, v in (d.get("kld_report") or {}).items() if k != "definitions"} or None,
    }


def write_comparison(comparison, opts: CompareOptions, baseline) -> dict[str, Any]:
    root, source = comparison.root, baseline.source
    source_bytes, params = _bytes(source), _source_params(source)
    rows = [scheme_row(comparison, s, source_bytes, params) for s in opts.schemes]
    speed = _add_speed(comparison, rows, source) if opts.speed else None
    budget, ev = opts.budget, opts.eval
    rec = recommend(rows, budget, priority(str(opts.plan.get("goal") or "")))  # the goal's, as the plan reads it
    cache = baseline.cache
    meta_path = cache.path_for(baseline.key) / "meta.json"
    meta = read_json(meta_path, "baseline cache") if meta_path.is_file() else {}
    fronts = {"kl_mean": pareto_front(rows, "kl_mean"), "perplexity": pareto_front(rows, "perplexity")}
    doc: dict[str, Any] = {
        "schema": SCHEMA, "model": opts.model, "source_bytes": source_bytes, "source_params": params,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {"eval_data": str(ev.eval_data or "wikitext-2-raw-v1 test"), "seq_len": ev.seq_len,
                     "windows": baseline.key.windows, "top_k": opts.top_k, "device": ev.device,
                     "algorithm": opts.plan.get("algorithm"), "tasks": list(ev.tasks), "limit": ev.limit,
                     "num_fewshot": ev.num_fewshot},
        "budget": budget, "schemes": rows, "recommendation": rec,
        "pareto_front": fronts,
        "speed": speed,
        "baseline_cache": {"key": baseline.key.id, "path": str(cache.path_for(baseline.key)),
                           "bytes": meta.get("bytes"), "full_logits_bytes": meta.get("full_logits_bytes"),
                           "built_seconds": meta.get("seconds"), "writes_this_run": cache.writes,
                           "hits_this_run": cache.hits},
    }
    from quark_ptq_eval.flows.compare.chart import write_pareto_chart

    chart = write_pareto_chart(rows, fronts, root / CHART_NAME)
    doc["artifacts"] = {"report": str(root / REPORT_NAME), "json": str(root / JSON_NAME),
                        "chart": str(chart) if chart else None}
    if speed is not None:
        from quark_ptq_eval.flows.compare.chart import SPEED_PANELS, write_speed_chart

        speed["pareto_front"] = {m: speed_front(rows, m) for m, _ in SPEED_PANELS}
        drawn = write_speed_chart(rows, speed, root / SPEED_CHART_NAME)
        doc["artifacts"]["speed_chart"] = str(drawn) if drawn else None
    write_json(root / JSON_NAME, json_safe(doc))
    atomic_write_text(root / REPORT_NAME, markdown(doc))
    comparison.ui.table("Comparison", [(r["scheme"], _cell_status(r), _fmt(r.get("size_bytes"), "mib"),
                                        _fmt(r.get("perplexity")), _fmt(r.get("kl_mean"))) for r in rows],
                        ("scheme", "status", "size", "perplexity", "KL mean"))
    comparison.ui.info(f"Recommendation: {rec['reason']}\nReport: {root / REPORT_NAME}")
    return doc


def _add_speed(comparison, rows: list[dict[str, Any]], source: Path) -> dict[str, Any] | None:
    """compare --speed: each evaluated row's measured speed and gain over the baseline (speed.py's
    records), and the comparison's speed summary (the baseline, the workload, the vLLM)."""
    from quark_ptq_eval.flows.compare.speed import (
        BASELINE,
        BASELINE_DIR,
        SPEED_DIR,
        SpeedCell,
        read_record,
        speed_fields,
        speed_summary,
    )

    base = read_record(SpeedCell(BASELINE, source, comparison.root / BASELINE_DIR, None))
    for row in rows:
        if row["status"] == "evaluated":
            cell = SpeedCell(row["scheme"], Path(row["model_dir"]), comparison.workdir(row["scheme"]) / SPEED_DIR, None)
            row.update(speed_fields(read_record(cell), base))
            row["predicted_speedup"] = _plan_prediction(comparison.workdir(row["scheme"]))
    return speed_summary(base)


def _plan_prediction(wd: Path) -> float | None:
    """The decode speed-up the scheme's plan predicted on its target (plan/decode_speed.py)."""
    from quark_ptq_eval.base.artifacts import QuantPlan

    if not QuantPlan.path_in(wd).exists():
        return None
    predicted = (QuantPlan.load(wd).target or {}).get("decode_speedup") or {}
    return predicted.get("speedup")


def _fmt(value, kind: str = "num") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if kind == "mib":
        return f"{value / 2**20:.2f} MiB"
    if kind == "pct":
        return f"{value:.1%}"
    return f"{value:.4g}"


def _with(value, suffix: str) -> str:
    return "-" if value is None else f"{_fmt(value)}{suffix}"


def _ppl_cell(r: dict) -> str:
    ci = r.get("perplexity_ci95") or [None, None]
    return "-" if r.get("perplexity") is None else f"{_fmt(r['perplexity'])} ({_fmt(ci[0])}–{_fmt(ci[1])})"


def _dnll_cell(r: dict) -> str:
    return "-" if r.get("delta_nll") is None else f"{_fmt(r['delta_nll'])} ± {_fmt(r.get('delta_nll_stderr'))}"


def _cell_status(row: dict) -> str:
    if row["status"] == "failed":
        return f"failed at {row.get('failed_step')}"
    return row["status"]


def markdown(doc: dict) -> str:
    rec = doc["recommendation"]
    lines = [f"# Scheme comparison — {doc['model']}", "",
             f"**Recommendation:** {rec['reason']}", "",
             f"Budget: {', '.join(f'{k} = {v:g}' for k, v in doc['budget'].items())}. "
             f"Evaluation: {doc['settings']['windows']} windows of {doc['settings']['seq_len']} tokens of "
             f"{doc['settings']['eval_data']}; baseline evaluated once (cache {doc['baseline_cache']['key']}).", "",
             "| scheme | status | validation | bits/weight | size | ratio | perplexity (95 % CI) | ΔNLL ± SE | "
             "significant | KL mean | KL p50 | KL p99 | KL max | top-1 | quantize |"
             + (" output tok/s (gain) | TPOT p50 ms |" if doc.get("speed") else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if doc.get("speed") else "")]
    for r in doc["schemes"]:
        lines.append(
            f"| {r['scheme']}{' ★' if r['scheme'] == rec['scheme'] else ''} | {_cell_status(r)} | "
            f"{r.get('validation') or '-'} | {_fmt(r.get('bits_per_weight'))} | {_fmt(r.get('size_bytes'), 'mib')} | "
            f"{_with(r.get('compression_ratio'), '×')} | {_ppl_cell(r)} | {_dnll_cell(r)} | "
            f"{'-' if r.get('significant') is None else ('yes' if r['significant'] else 'no')} | "
            f"{_fmt(r.get('kl_mean'))} | {_fmt(r.get('kl_p50'))} | {_fmt(r.get('kl_p99'))} | {_fmt(r.get('kl_max'))} | "
            f"{_fmt(r.get('top1_agreement'), 'pct')} | {_with(r.get('quantize_s'), ' s')} |"
            + (f" {_tput_cell(r)} | {_fmt(r.get('tpot_ms_p50'))} |" if doc.get("speed") else ""))
    lines += ["", f"Pareto front (size vs mean KL): {', '.join(doc['pareto_front']['kl_mean']) or '-'}; "
                  f"(size vs perplexity): {', '.join(doc['pareto_front']['perplexity']) or '-'}.",
              f"Chart: {doc['artifacts']['chart'] or 'not drawn (no evaluated scheme)'}", ""]
    lines += _speed_lines(doc)
    lines += _llama_cpp_lines(doc)
    lines += _task_lines(doc)
    failed = [r for r in doc["schemes"] if r["status"] == "failed"]
    if failed:
        lines += ["## Failed schemes", ""]
        lines += [f"- **{r['scheme']}** at {r.get('failed_step')}: {r.get('error')}"
                  + (f" ({r['hint']})" if r.get("hint") else "") for r in failed]
        lines.append("")
    c = doc["baseline_cache"]
    lines += ["## How the numbers are computed", "",
              "- Perplexity: exp of the mean next-token NLL over non-overlapping windows (the same as `run`'s "
              "Tier 1); 95 % interval from the per-window NLLs. ΔNLL: per-window quantized − baseline, paired; "
              "significant when its 95 % interval excludes 0.",
              f"- KL(baseline ‖ scheme) per token from the cached top-{doc['settings']['top_k']} baseline "
              "log-probabilities plus the tail mass as one bucket. This never exceeds the full-logit KL; the gap "
              "is at most r·log(min(p_K, r)·q_T / (r·q_min)) per token (r: baseline tail mass, p_K: its K-th "
              "probability, q_T, q_min: the scheme's tail mass and smallest tail probability); its mean is "
              "`kl_cache_gap_bound_mean` in comparison.json. It is a worst case over every possible baseline "
              "tail: small when the tail mass (`baseline_tail_mass_mean`) is small; raise --top-k otherwise.",
              f"- Baseline probability mass outside the top-{doc['settings']['top_k']}, mean over tokens: "
              f"{_fmt(next((r['baseline_tail_mass_mean'] for r in doc['schemes'] if r.get('baseline_tail_mass_mean') is not None), None))}.",
              f"- Baseline cache: {_fmt(c.get('bytes'), 'mib')} against {_fmt(c.get('full_logits_bytes'), 'mib')} "
              f"of full float32 logits; this run built it {c['writes_this_run']}× and read it "
              f"{c['hits_this_run']}×.", ""]
    return "\n".join(lines)


def _tput_cell(r: dict) -> str:
    if r.get("output_tokens_per_s") is None:
        return "not served" if r.get("speed_refused") else "-"
    gain = r.get("throughput_gain")
    return f"{_fmt(r['output_tokens_per_s'])}" + (f" ({gain:.2f}×)" if gain is not None else "")


def _gain_cell(r: dict) -> str:
    if r.get("throughput_gain") is None:
        return "-"
    low, high = r["throughput_gain_ci95"]
    return f"{r['throughput_gain']:.3f}× ({low:.3f}–{high:.3f})"


def _speed_lines(doc: dict) -> list[str]:
    """compare --speed: each model's measured serving speed, the gain over the baseline, the refusals."""
    speed = doc.get("speed")
    if not speed:
        return []
    w, base = speed.get("workload") or {}, speed.get("baseline") or {}
    lines = ["## Serving speed (vLLM's own serving benchmark, each model served once)", "",
             f"{w.get('prompts')} random prompts of {w.get('input_len')} → {w.get('output_len')} tokens (ignore_eos) "
             f"at concurrency {w.get('concurrency')}, one warm-up then {w.get('repeats')} repeats per model; "
             f"{speed.get('vllm_version') or '-'} on {speed.get('hardware') or '-'}. Medians over the repeats; the gain "
             "is the median output tokens/s over the baseline's, its 95 % interval Welch's t on log throughput; "
             "predicted: the decode speed-up the scheme's plan expects on its target from the bytes moved per "
             "generated token (plan/decode_speed.py), beside the measured gain.", "",
             "| model | output tok/s | gain (95 % interval) | predicted (plan) | req/s | TPOT p50 ms | TPOT p99 ms | "
             "TTFT p50 ms | spread tok/s | not measured |", "|---|---|---|---|---|---|---|---|---|---|",
             f"| baseline | {_fmt(base.get('output_tokens_per_s'))} | 1 | 1 | {_fmt(base.get('requests_per_s'))} | "
             f"{_fmt(base.get('tpot_ms_p50'))} | {_fmt(base.get('tpot_ms_p99'))} | {_fmt(base.get('ttft_ms_p50'))} | - | "
             f"{speed.get('baseline_refused') or ''} |"]
    for r in doc["schemes"]:
        if r["status"] == "evaluated":
            spread = r.get("output_tokens_per_s_spread_pct")
            lines.append(f"| {r['scheme']} | {_fmt(r.get('output_tokens_per_s'))} | {_gain_cell(r)} | "
                         f"{_with(r.get('predicted_speedup'), '×')} | "
                         f"{_fmt(r.get('requests_per_s'))} | {_fmt(r.get('tpot_ms_p50'))} | {_fmt(r.get('tpot_ms_p99'))} | "
                         f"{_fmt(r.get('ttft_ms_p50'))} | {_with(spread, ' %')} | {r.get('speed_refused') or ''} |")
    fronts = speed.get("pareto_front") or {}
    lines += ["", "Pareto front (throughput vs accuracy, fastest first): "
              + "; ".join(f"{m}: {', '.join(f) or '-'}" for m, f in fronts.items()) + ".",
              f"Chart: {doc['artifacts'].get('speed_chart') or 'not drawn (no measured scheme)'}", ""]
    return lines


def _pm(r: dict, key: str, scale: float = 1.0, suffix: str = "") -> str:
    value, unc = r.get(key), r.get(f"{key}_unc")
    return "-" if value is None else f"{_fmt(scale * value)} ± {_fmt(None if unc is None else scale * unc)}{suffix}"


def _llama_cpp_lines(doc: dict) -> list[str]:
    """llama.cpp's KL-divergence report figures per scheme (evaluate/ppl/stats.py has the definitions)."""
    rows = [(r["scheme"], r["kld_report"]) for r in doc["schemes"] if r.get("kld_report")]
    if not rows:
        return []
    lines = ["## llama.cpp-style statistics (`perplexity --kl-divergence` definitions)", "",
             "Over every scored token; ± are llama.cpp's per-token uncertainties. KLD here is from the cached "
             "top-K baseline (a lower bound, see below); Δp and same top p are exact.", "",
             "| scheme | PPL(Q)/PPL(base) | Cor(ln PPL) | KLD mean | KLD 99.9 % | KLD median | Δp mean | Δp 1 % / 99 % | "
             "RMS Δp | same top p |", "|---|---|---|---|---|---|---|---|---|---|"]
    for scheme, r in rows:
        lines.append(f"| {scheme} | {_pm(r, 'ppl_ratio')} | {_fmt(r.get('cor_ln_ppl'), 'pct')} | {_pm(r, 'kld_mean')} | "
                     f"{_fmt(r.get('kld_p99_9'))} | {_fmt(r.get('kld_median'))} | {_pm(r, 'dp_mean', 100, ' %')} | "
                     f"{_fmt(100 * r['dp_p1'])} / {_fmt(100 * r['dp_p99'])} % | {_pm(r, 'dp_rms', 100, ' %')} | "
                     f"{_pm(r, 'same_top_p', 100, ' %')} |")
    return [*lines, ""]


def _task_lines(doc: dict) -> list[str]:
    """Tier 2: per scheme, task and metric, the scores and the paired test against the baseline."""
    rows = [(r["scheme"], t) for r in doc["schemes"] for t in r.get("tasks") or []]
    if not rows:
        return []
    s = doc["settings"]
    lines = ["## Task scores (Tier 2, lm-eval)", "",
             f"Tasks {', '.join(s['tasks'])}" + (f", {s['limit']:g} documents per task" if s.get("limit") else "")
             + ". Paired on the same documents: McNemar's exact mid-p for 0/1 scores (documents only the "
               "baseline / only the scheme got right), a paired bootstrap otherwise; significant at 5 % when "
               "p < 0.05.", "",
             "| scheme | task | metric | baseline | scheme | drop % | test | only base / only scheme | p | "
             "significant at 5 % |", "|---|---|---|---|---|---|---|---|---|---|"]
    for scheme, t in rows:
        pair = "-" if t.get("baseline_only") is None else f"{t['baseline_only']} / {t['scheme_only']}"
        sig = "-" if t.get("significant") is None else ("yes" if t["significant"] else "no")
        lines.append(f"| {scheme} | {t['task']} | {t['metric']} | {_fmt(t.get('baseline'))} | {_fmt(t.get('score'))} | "
                     f"{_fmt(t.get('drop_pct'))} | {t.get('test') or 'none (aggregate-only metric)'} | {pair} | "
                     f"{_fmt(t.get('p_value'))} | {sig} |")
    return [*lines, ""]
