"""sensitivity_report.md / .json / .png: layers ranked, a block x module-type heat map, per-type summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quark_ptq_eval.base.fsio import atomic_write_text, write_json, write_png

TOP = 20  # layers listed in the markdown ranking and the chart


def aggregate(result: dict[str, Any]) -> dict[str, Any]:
    """Sum and max of per-layer KL per block and per module type, and the block x type grid."""
    by_block: dict[str, dict[str, float]] = {}
    by_type: dict[str, dict[str, float]] = {}
    grid: dict[str, dict[str, float]] = {}
    for row in result["layers"]:
        block = "head" if row["block"] is None else str(row["block"])
        for table, key in ((by_block, block), (by_type, row["module_type"])):
            entry = table.setdefault(key, {"sum_kl": 0.0, "max_kl": 0.0, "layers": 0})
            entry["sum_kl"] += row["kl"]
            entry["max_kl"] = max(entry["max_kl"], row["kl"])
            entry["layers"] += 1
        grid.setdefault(block, {})[row["module_type"]] = row["kl"]
    return {"per_block": by_block, "per_module_type": by_type, "grid": grid}


def write_reports(out_dir: Path, result: dict[str, Any], proposal: dict[str, Any] | None, command: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = aggregate(result)
    data = {**{k: v for k, v in result.items() if k != "cache_hit"}, **summary, "proposal": proposal,
            "command": command}
    paths = {"json": write_json(out_dir / "sensitivity_report.json", data)}
    chart = _chart(out_dir / "sensitivity_report.png", result, summary)
    if chart:
        paths["png"] = chart
    paths["md"] = atomic_write_text(out_dir / "sensitivity_report.md", _markdown(result, summary, proposal,
                                                                                 command, chart))
    return paths


def _markdown(result: dict[str, Any], summary: dict[str, Any], proposal: dict[str, Any] | None, command: str, chart: Path | None) -> str:
    cost = result["cost"]
    lines = [
        "# Sensitivity scan", "",
        f"- model: `{result['model']}`", f"- scheme: `{result['scheme']}`",
        f"- calibration: {result['calibration']['samples']} x {result['calibration']['seq_len']} tokens of "
        f"`{result['calibration']['source']}`",
        "- measure: KL(unquantized || only this layer quantized), mean per token, Quark fake-quant",
        f"- whole model quantized: KL {result['whole_model_kl']:.4g}",
        f"- cost: 1 calibration + 1 reference pass + {cost['measurement_passes']} model-pass equivalents for "
        f"{cost['layers']} layers ({result['method']}); {cost['scan_s']} s",
        *_share_md(result), *_experts_md(result),
        f"- command: `{command}`", "",
    ]
    if proposal:
        lines += _proposal_md(proposal)
    ranked = sorted(result["layers"], key=lambda r: -r["kl"])
    lines += ["## Layers ranked (most sensitive first)", "", "| # | layer | KL | params |", "|---|---|---|---|"]
    lines += [f"| {i} | `{r.get('pattern', r['layer'])}` | {r['kl']:.4g} | {r['params']:,} |"
              for i, r in enumerate(ranked[:TOP], 1)]
    if len(ranked) > TOP:
        lines.append(f"| ... | {len(ranked) - TOP} more in sensitivity_report.json | | |")
    lines += ["", "## Per module type", "", "| type | layers | sum KL | max KL |", "|---|---|---|---|"]
    for name, e in sorted(summary["per_module_type"].items(), key=lambda kv: -kv[1]["sum_kl"]):
        lines.append(f"| {name} | {e['layers']} | {e['sum_kl']:.4g} | {e['max_kl']:.4g} |")
    lines += ["", "## Per block", "", "| block | layers | sum KL | max KL |", "|---|---|---|---|"]
    for name, e in summary["per_block"].items():
        lines.append(f"| {name} | {e['layers']} | {e['sum_kl']:.4g} | {e['max_kl']:.4g} |")
    if chart:
        lines += ["", f"![sensitivity chart]({chart.name})"]
    return "\n".join(lines) + "\n"


def _share_md(result: dict[str, Any]) -> list[str]:
    share = result.get("quantized_share") or {}
    if not share.get("matrix_params"):
        return []
    return [f"- quantized share of matrix parameters: {share['share']:.1%} ({share['quantized_params']:,} of "
            f"{share['matrix_params']:,}, counted as validation counts an export's headers)"]


def _experts_md(result: dict[str, Any]) -> list[str]:
    experts = result.get("experts") or {}
    if not experts.get("moe_layers"):
        return []
    unreached = experts.get("unreached") or {}
    missing = sum(len(v) for v in unreached.values())
    where = "; ".join(f"`{k}`: {', '.join(map(str, v))}" for k, v in unreached.items())
    return [f"- MoE: {experts['moe_layers']} layer(s), {experts['experts']} routed experts, measured per "
            f"{UNIT_WORDS.get(result.get('expert_units', 'group'), 'group')}; {experts['routing']}",
            f"- experts no calibration token reached: {missing}{f' ({where})' if where else ''}; "
            f"{experts['unreached_treatment']}"]


UNIT_WORDS = {"group": "MoE layer (routed experts as one unit, shared experts as another)",
              "expert": "expert", "projection": "projection type across each layer's experts"}


def _proposal_md(p: dict[str, Any]) -> list[str]:
    from quark_ptq_eval.evaluate.options import Thresholds
    from quark_ptq_eval.sensitivity.proposal import default_max_kl

    healthy = f"the healthy threshold, {Thresholds().healthy_pct:g} % perplexity factor"
    source = healthy if abs(p["max_kl"] - default_max_kl()) < 1e-12 else "--max-kl"
    lines = ["## Proposal", "", f"Budget: KL <= {p['max_kl']:.4g} ({source}).", ""]
    if not p["exclude"]:
        return lines + ["The whole model quantized already meets the budget: no exclusion needed.", ""]
    lines += [f"Keep out of the scheme ({len(p['exclude'])} layers, {p['params_kept']:,} params; unquantized: "
              f"+{p['extra_bytes'] / 2**20:.2f} MiB = +{p['extra_pct']:.1f} % of the quantized layers):", ""]
    lines += [f"- `{n}`" for n in p["exclude"]]
    measured = "not re-measured" if p["measured_kl"] is None else f"{p['measured_kl']:.4g}"
    lines += ["", f"KL: whole model {p['whole_model_kl']:.4g} -> predicted {p['predicted_kl']:.4g}, "
                  f"measured {measured}: {'meets' if p['met'] else 'does NOT meet'} the budget.", ""]
    if w := p.get("wider"):
        verdict = ("**chosen**: the plan keeps them in `layer_quant_config` at this scheme" if w["chosen"] else
                   f"not chosen: {w['refused']}" if w.get("refused") else
                   "not chosen: it misses what keeping them unquantized reaches")
        lines += [f"The same layers at `{w['scheme']}` ({w['bits']:g} bits per weight) instead: measured KL "
                  f"{w['measured_kl']:.4g} for +{w['extra_bytes'] / 2**20:.2f} MiB (+{w['extra_pct']:.1f} %); "
                  f"{verdict}.", ""]
    return lines


def _chart(path: Path, result: dict[str, Any], summary: dict[str, Any]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the chart is optional: the markdown and JSON hold every number
        return None
    ranked = sorted(result["layers"], key=lambda r: -r["kl"])[:TOP]
    types = sorted(summary["per_module_type"])
    blocks = list(summary["grid"])
    fig, axes = plt.subplots(1, 3, figsize=(16, max(4, 0.3 * len(ranked))))
    axes[0].barh([r["layer"] for r in ranked][::-1], [r["kl"] for r in ranked][::-1])
    axes[0].set_title("KL per layer (top)")
    grid = [[summary["grid"][b].get(t, float("nan")) for t in types] for b in blocks]
    im = axes[1].imshow(grid, aspect="auto", cmap="magma_r")
    axes[1].set_xticks(range(len(types)), types, rotation=45, ha="right")
    axes[1].set_yticks(range(len(blocks)), blocks)
    axes[1].set_title("KL: block x module type")
    fig.colorbar(im, ax=axes[1])
    axes[2].bar(types, [summary["per_module_type"][t]["sum_kl"] for t in types])
    axes[2].set_title("sum of KL per module type")
    axes[2].tick_params(axis="x", rotation=45)
    fig.suptitle(f"{Path(result['model']).name} · {result['scheme']}")
    fig.tight_layout()
    write_png(fig, path, dpi=90)
    return path
