"""The card's text: base model, quantization, validation, evaluation, serving, each from the
artifact that proved it. Deterministic given the same artifacts: no clock, no timings."""

from __future__ import annotations

from typing import Any

from quark_ptq_eval.base.calibration_text import describe_used
from quark_ptq_eval.publish.base_card import CARD_MARK
from quark_ptq_eval.publish.facts import RunFacts
from quark_ptq_eval.publish.results import evaluation_section, serving_section


def card_body(facts: RunFacts, repo_id: str) -> str:
    sections = [_title(facts, repo_id), _base(facts), _quantization(facts), _validation(facts),
                evaluation_section(facts), serving_section(facts, repo_id), _comparison(facts), _footer(facts)]
    return "\n\n".join("\n".join(lines) for lines in sections if lines) + "\n"


def _title(facts: RunFacts, repo_id: str) -> list[str]:
    plan, quark = facts.plan, facts.versions.get("quark") or "?"
    base = facts.base.hub_id or facts.base.path
    done = ["made", *(["validated"] if facts.validation else []),
            *(["evaluated"] if facts.evaluation and facts.evaluation.get("quantized") else [])]
    how = ", ".join(done[:-1]) + f" and {done[-1]}" if len(done) > 1 else done[0]
    return [f"# {repo_id}", "",
            f"`{plan.global_scheme}` quantization of `{base}` with AMD Quark {quark}, {how} by quark-ptq-eval. "
            "Every statement below comes from the run's artifacts."]


def _base(facts: RunFacts) -> list[str]:
    base = facts.base
    if base.hub_id:
        who = f"[{base.hub_id}](https://huggingface.co/{base.hub_id}) (Hub id: {base.hub_id_from})"
    else:
        who = f"`{base.path}` (no Hub id known: {base.hub_id_from})"
    lines = ["## Base model", "", f"- base model: {who}", f"- license: `{base.license}` ({base.license_from})"]
    if base.card:
        carried = [*base.carried, *(["tags"] if base.tags else [])]
        what = f"its {', '.join(carried)} carried over" if carried else "it states no metadata to carry over"
        lines.append(f"- the base model's own card: {base.link} ({what}; its text and results describe the base "
                     "model, not this one, and are not copied)")
    else:
        lines.append("- the base model has no card of its own (no README.md)")
    return lines


def _quantization(facts: RunFacts) -> list[str]:
    plan, versions = facts.plan, facts.versions
    reasons = {d["decision"]: d.get("reason", "") for d in plan.decisions}
    rows = [("scheme", f"`{plan.global_scheme}`", reasons.get("global_scheme", "")),
            ("algorithm", f"`{plan.algorithm}`" if plan.algorithm else "none (plain PTQ)", reasons.get("algorithm", "")),
            ("KV cache", f"`{plan.kv_cache_scheme}`" if plan.kv_cache_scheme else "model dtype (not quantized)",
             reasons.get("kv_cache_scheme", "")),
            ("calibration", describe_used(plan), reasons.get("calibration", "")),
            ("calibration size", f"{plan.calibration.num_samples} samples x "
                                 f"{plan.calibration.seq_len} tokens", reasons.get("calibration size", ""))]
    exclusions = ", ".join(f"`{p}`" for p in plan.exclude_layers) or "none (every linear layer quantized)"
    rows.append(("kept unquantized", exclusions, f"{reasons.get('exclude_layers', '')} (from: {plan.exclude_source})"))
    for pattern, scheme in sorted(plan.layer_quant_config.items()):
        rows.append(("override", f"`{pattern}` → `{scheme}`", reasons.get("layer_quant_config", "")))
    rows.append(("engine", plan.engine.name, reasons.get("engine", "")))
    rows.append(("versions", ", ".join(f"{k} {v or 'unknown'}" for k, v in versions.items()),
                 "Quark from the manifest, torch from the install check, transformers from the export's config.json"))
    lines = ["## Quantization", "", "| | value | why |", "|---|---|---|"]
    lines += [f"| {a} | {_cell(b)} | {_cell(c)} |" for a, b, c in rows]
    return [*lines, "", "The exact command the run approved and ran (`run_manifest.yaml`):", "",
            "```bash", str(facts.manifest.command.get("shell", "")), "```"]


def _validation(facts: RunFacts) -> list[str]:
    report = facts.validation
    if report is None:
        return ["## Validation", "", "Not validated: the work dir holds no validation report for this export."]
    checks: dict[str, Any] = report.get("checks") or {}
    lines = ["## Validation", "", f"Verdict: **{report.get('status')}** (`validation_report.json`). What was checked:", ""]
    lines += [f"- {c.get('title', name)}: {c.get('summary', c.get('status'))}" for name, c in checks.items()]
    fixes = report.get("applied_fixes") or []
    return lines + [f"- fix applied after approval: {f}" for f in fixes]


def _comparison(facts: RunFacts) -> list[str]:
    chosen = facts.comparison
    if not chosen:
        return []
    return ["## Chosen by a comparison", "", f"{chosen.reason}", "",
            f"Compared: {', '.join(chosen.schemes)} (report: `{chosen.report}`)."]


def _footer(facts: RunFacts) -> list[str]:
    lines = ["---", "", f"{CARD_MARK} `{facts.workdir}`; "
             f"`quark-ptq-eval card {facts.export} --workdir {facts.workdir}` writes it again "
             "(after a later `eval`, for example)."]
    return lines + [f"Left out: {note}." for note in facts.left_out]


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
