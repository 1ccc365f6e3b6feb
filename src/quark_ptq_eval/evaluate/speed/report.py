"""The speed tier's section of eval_report.md: the workload, each model's medians, the throughput gain with its
interval beside what the bytes moved per token predict, and what was not measured."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quark_ptq_eval.evaluate.eval_report import EvalReport


def section(report: EvalReport) -> list[str]:
    speed = report.details.get("speed") or {}
    lines = ["## Serving speed (vLLM's own benchmark)", "", f"**{speed.get('verdict', '-')}**", ""]
    w, p = speed.get("workload") or {}, speed.get("precision")
    on = f"{speed.get('vllm_version') or 'no vLLM'} on {speed.get('hardware') or '-'}"
    if w and p:
        pilot = ", ".join(f"{s:.2f} s ({label})" for label, s in p["pilot"]["duration_s"].items())
        lines += [f"- workload: random prompts of {w['input_len']} tokens -> {w['output_len']} tokens (ignore_eos), "
                  f"concurrency {w['concurrency']}; one warm-up of {w['warmup_prompts']} and a pilot of "
                  f"{p['pilot']['prompts']} ({pilot}), then {p['repeat_prompts']} prompts a repeat (at least "
                  f"{p['pilot']['min_repeat_s']:g} s); {on}",
                  f"- precision: {p['pairs']} pairs of repeats, quantized and baseline alternately (the order turned "
                  f"each pair), in {p['elapsed_s']:.0f} s; the interval reaches +-{p['reached_pct']:.1f} % of the "
                  f"median gain; stopped "
                  + (f"within the +-{p['target_pct']:g} % asked (--speed-precision)" if p["stopped"] == "precision"
                     else f"at its cap (--speed-max-s {p['max_s']:g}), short of the +-{p['target_pct']:g} % asked"), ""]
    elif w:
        lines += [f"- workload: {w['prompts']} random prompts of {w['input_len']} tokens -> {w['output_len']} "
                  f"tokens (ignore_eos), concurrency {w['concurrency']}; one warm-up of {w['warmup_prompts']}, then "
                  f"{w['repeats']} repeats; {on}", ""]
    sides = [s for s in ("quantized", "baseline") if isinstance(speed.get(s), dict)]
    if sides:
        lines += ["| model | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | "
                  "spread tok/s | KV cache (tokens) | max concurrency |", "|---|" + "---:|" * 9]
        for s in sides:
            v, mem = speed[s], speed[s].get("server_memory") or {}
            spread = v["spread_pct"]["output_tokens_per_s"]
            lines.append(f"| {s} | {v['output_tokens_per_s']:.1f} | {v['requests_per_s']:.3f} | {v['ttft_ms_p50']:.1f} "
                         f"| {v['ttft_ms_p99']:.1f} | {v['tpot_ms_p50']:.2f} | {v['tpot_ms_p99']:.2f} | "
                         f"{'-' if spread is None else f'{spread:.1f} %'} | {mem.get('kv_cache_tokens', '-')} | "
                         f"{mem.get('max_concurrency', '-')} |")
        lines.append("")
    if speed.get("throughput_gain") is not None:
        lo, hi = speed["throughput_gain_ci95"]
        lines += [f"- throughput gain (median quantized / median baseline output tok/s): "
                  f"{speed['throughput_gain']:.3f}x, 95 % interval {lo:.3f}-{hi:.3f}x ({speed['ci95_method']})"]
        lines += _predicted_lines(speed)
    for label, why in (speed.get("refused") or {}).items():
        lines.append(f"- {label}: not measured: {why}")
    for label, files in (speed.get("result_files") or {}).items():
        lines.append(f"- vLLM's result files ({label}): " + ", ".join(f"`{f}`" for f in files))
    return [*lines, ""]


def _predicted_lines(speed: dict[str, Any]) -> list[str]:
    """The prediction from the bytes moved per generated token beside the measured gain."""
    predicted = speed.get("predicted") or {}
    lines = []
    if predicted.get("this_run"):
        lines.append(f"- predicted decode speed-up for this run (bytes moved per generated token, "
                     f"plan/decode_speed.py): {predicted['this_run']['text']}; measured: "
                     f"{speed['throughput_gain']:.2f}x")
    if predicted.get("plan"):
        lines.append(f"- the plan's prediction for its target: {predicted['plan']['text']}")
    return lines
