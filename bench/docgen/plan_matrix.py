"""The plan matrix: every deployment target the planner knows x every priority, on representative families.

Per cell the goal names the target and the priority (``"accuracy first for MI300X"``, ``"for A100"``);
the plan made from that goal runs for real through the recipe, as the family matrix drives it (bench/docgen/matrix.py:
the Quark-API engine -> validate with the load check -> Tier 1 perplexity with baseline -> the
quantized share), or is refused at the plan step with its reason. Cells whose plans are the same
(scheme, algorithm, KV cache, exclusions, overrides) share one run: the result is that plan's.

    python -m bench.docgen.plan_matrix [--families llama,phi3] [--targets mi300x,h100] [--priorities size]

Results go to ``<work>/plan-results.json``; ``docs/targets.md`` is regenerated from them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path

from bench.docgen.matrix import (
    ROOT,
    Cell,
    Setup,
    build,
    cell_options,
    cell_recipe,
    log,
    offline_workdir,
    prepare,
    run_recipe,
)

# dense, tied embeddings, fused QKV, MoE with fused experts, MLA (+ MoE)
FAMILIES = ("llama", "gemma2", "phi3", "qwen3_moe", "deepseek_v3")
PRIORITIES = ("accuracy", "speed", "size", "balanced")
MULTINODE_RESULTS = "plan-multinode.json"  # the multi-node serving cells (--multinode)
GOAL_WORDS = {"accuracy": "accuracy first", "speed": "fastest", "size": "smallest", "balanced": ""}


def goal_for(target_label: str, priority: str) -> str:
    return f"{GOAL_WORDS[priority]} for {target_label}".strip()


def _plan_key(plan) -> str:
    return json.dumps([plan.global_scheme, plan.algorithm, plan.kv_cache_scheme, sorted(plan.exclude_layers),
                       sorted(plan.layer_quant_config.items())])


def run_goal_cell(setup: Setup, family: str, model_dir: Path, target: str, priority: str, runs: dict) -> dict:
    """One cell: the recipe up to the plan from the goal, then (once per distinct plan) the rest of it,
    resumed in the same work dir (later cells of the same plan share that run)."""
    from quark_ptq_eval.base.errors import UsageError
    from quark_ptq_eval.plan.targets import TARGETS

    goal = goal_for(TARGETS[target].label, priority)
    base = setup.work / "plan-cells" / family / target / priority
    recipe = cell_recipe(setup, base)
    opts = cell_options(setup, model_dir, base, {"goal": goal})
    t0 = time.monotonic()
    row = {"family": family, "target": target, "priority": priority, "goal": goal}
    try:
        recipe.run(opts, "plan")
    except UsageError as exc:
        return {**row, "outcome": "refused", "stage": "plan", "message": f"{exc.message} {exc.hint or ''}".strip(),
                "seconds": round(time.monotonic() - t0, 1)}
    plan = recipe.flow.parts["plan"]
    scheme_row = next(d for d in plan.decisions if d["decision"] == "global_scheme")
    row.update(scheme=plan.global_scheme, kv=plan.kv_cache_scheme, algorithm=plan.algorithm,
               why=scheme_row["reason"])
    key = _plan_key(plan)
    if key not in runs:
        runs[key] = asdict(run_recipe(setup, Cell(family, f"{target}/{priority}"), recipe, opts))
        row["ran"] = True
    run = runs[key]
    row.update(outcome=run["outcome"], stage=run["stage"], cause=run["cause"], message=run["message"],
               verdict=run["verdict"], ppl=run["ppl"], ppl_base=run["ppl_base"], share=run["share_measured"],
               run_of=run["column"], seconds=round(time.monotonic() - t0, 1))
    return row


def run_plan_matrix(setup: Setup, families: list[str], targets: list[str], priorities: list[str],
                    on_row=None) -> list[dict]:
    rows: list[dict] = []
    for family in families:
        model_dir, why = build(setup, family)
        runs: dict = {}
        for target in targets:
            for priority in priorities:
                if model_dir is None:
                    row = {"family": family, "target": target, "priority": priority, "outcome": "failed",
                           "stage": "build", "message": why, "seconds": 0.0}
                else:
                    row = run_goal_cell(setup, family, model_dir, target, priority, runs)
                rows.append(row)
                log(f"{family:<12} {target:<7} {priority:<9} {row['outcome']:<8} {row.get('scheme', '-'):<12} "
                    f"kv={row.get('kv')} {row['seconds']:6.1f}s {row.get('stage', '')} {row.get('message', '')[:160]}")
                if on_row:
                    on_row(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    from quark_ptq_eval.plan.targets import TARGETS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--priorities", default=",".join(PRIORITIES))
    p.add_argument("--work", default=str(ROOT / ".matrix"))
    p.add_argument("--out", default=str(ROOT / "docs" / "targets.md"), help="the table doc ('' for none)")
    p.add_argument("--calib-samples", type=int, default=4)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--tag", default="main", help="results file plan-results-TAG.json (parallel runners use distinct tags)")
    p.add_argument("--doc-only", action="store_true", help="only regenerate the doc from every plan-results-*.json")
    p.add_argument("--multinode", action="store_true",
                   help="only the multi-node serving cells (plan_matrix_multinode.py: BF16 baselines wider than a node)")
    args = p.parse_args(argv)
    work = offline_workdir(args.work)
    if args.multinode:
        from bench.docgen.plan_matrix_multinode import run_cells

        rows = run_cells(work / "multinode")
        (work / MULTINODE_RESULTS).write_text(json.dumps(rows, indent=1))
        for r in rows:
            log(f"{r['cell']}: {r['outcome']} " + "; ".join(f"{k} {v['layout']}" for k, v in r["servers"].items()))
        return 0 if all(r["outcome"] == "green" for r in rows) else 1
    if args.doc_only:
        write_targets_doc(Path(args.out), merged_results(work), prepare(work, args.calib_samples, args.windows))
        return 0
    t0 = time.monotonic()
    import quark.torch  # noqa: F401 - paid once for the whole matrix
    setup = prepare(work, args.calib_samples, args.windows)
    results = work / f"plan-results-{args.tag}.json"
    data = json.loads(results.read_text()) if results.exists() else {"cells": {}, "runs": []}

    def save(row: dict) -> None:
        data["cells"][f"{row['family']}/{row['target']}/{row['priority']}"] = row
        results.write_text(json.dumps(data, indent=1))

    rows = run_plan_matrix(setup, args.families.split(","), args.targets.split(","), args.priorities.split(","), save)
    wall = time.monotonic() - t0
    engine_runs = sum(bool(r.get("ran")) for r in rows)
    log(f"{len(rows)} cells ({engine_runs} engine runs) in {wall:.0f}s wall")
    data["runs"].append({"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cells": len(rows),
                         "engine_runs": engine_runs, "wall_s": round(wall, 1)})
    results.write_text(json.dumps(data, indent=1))
    if args.out:
        write_targets_doc(Path(args.out), merged_results(work), setup)
    return 0 if all(r["outcome"] != "failed" for r in rows) else 1


def merged_results(work: Path) -> dict:
    """Every runner's cells (a later file's cell replaces an earlier one) and runs, in order."""
    data: dict = {"cells": {}, "runs": []}
    for path in sorted(work.glob("plan-results*.json"), key=lambda p: p.stat().st_mtime):
        part = json.loads(path.read_text())
        data["cells"].update(part["cells"])
        data["runs"] += part["runs"] or [{  # a runner stopped before its summary
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime)), "cells": len(part["cells"]),
            "engine_runs": sum(bool(c.get("ran")) for c in part["cells"].values()),
            "wall_s": sum(c.get("seconds", 0.0) for c in part["cells"].values()), "interrupted": True}]
    data["runs"].sort(key=lambda r: r["when"])
    return data


def _multinode_lines(path: Path) -> list[str]:
    """The multi-node serving cells' table (plan_matrix.py --multinode), when they have run."""
    if not path.is_file():
        return []
    lines = ["## Multi-node serving (Tier 3 over Ray)", "",
             "BF16 baselines at real size (sparse checkpoints) with an fp8 plan for the target; Tier 3's own "
             "command planning sizes each server (`bench/docgen/plan_matrix_multinode.py`).", "",
             "| cell | parameters | server | layout | outcome |", "|---|---|---|---|---|"]
    for r in json.loads(path.read_text()):
        for label, s in r["servers"].items():
            lines.append(f"| {r['cell']} | {r['params'] / 1e9:.0f} B | {label} | {s['layout']} | {r['outcome']} |")
    return lines + [""]


def _cell_text(row: dict) -> str:
    if row["outcome"] == "refused":
        return "refused"
    text = f"{row['scheme']}{'+kv ' + row['kv'] if row.get('kv') else ''}{'+' + row['algorithm'] if row.get('algorithm') else ''}"
    return text + ("" if row["outcome"] == "green" else f" FAIL ({row['stage']})")


def write_targets_doc(path: Path, data: dict, setup: Setup) -> None:
    """docs/targets.md: per family, targets x priorities, each cell the plan's scheme and its outcome."""
    from quark_ptq_eval.plan.targets import TARGETS

    cells = list(data["cells"].values())
    counts = {k: sum(c["outcome"] == k for c in cells) for k in ("green", "refused", "failed")}
    lines = ["# Deployment targets × priorities, run for real", "",
             "Generated by `bench/docgen/plan_matrix.py`; do not edit by hand. "
             f"amd-quark {version('amd-quark')}, transformers {version('transformers')}, torch {version('torch')}, "
             "CPU (2 cores shared with other jobs: loaded-machine times).", ""]
    lines += ["Runs (runners in parallel, each on its families): " + "; ".join(
        f"{r['when']}: {r['cells']} cells, {r['engine_runs']} engine runs, {r['wall_s']:.0f} s "
        + ("of cell time (stopped before its summary)" if r.get("interrupted") else "wall") for r in data["runs"])
        + ".", ""]
    lines += [f"**{len(cells)} cells: {counts['green']} green, {counts['refused']} refused at the plan step, "
              f"{counts['failed']} failed.**", "",
              "Each cell's goal names the target and the priority (`accuracy first for MI300X`, `fastest for H100`, "
              "`smallest for B200`, `for A100`); the plan made from it (scheme, KV cache, algorithm: the cell's "
              "text) runs through the Quark-API engine, validation with the load check and Tier 1 perplexity with "
              f"baseline ({setup.windows} windows of 64 tokens), calibrating on {setup.calib_samples} × 64 tokens, "
              "on the family matrix's tiny models (tests/fixtures/families.py: hidden 128, MoE intermediate 64, MLA's "
              "kv_lora_rank 64). Cells with the same plan share one run. A green cell passed every stage.", ""]
    for family in dict.fromkeys(c["family"] for c in cells):
        prios = [p for p in PRIORITIES if any(c["priority"] == p for c in cells if c["family"] == family)]
        lines += [f"## {family}", "", "| target | " + " | ".join(prios) + " |", "|---|" + "---|" * len(prios)]
        for target in TARGETS:
            row = [data["cells"].get(f"{family}/{target}/{p}") for p in prios]
            if any(row):
                lines.append(f"| {TARGETS[target].label} | " + " | ".join(_cell_text(r) if r else "-" for r in row)
                             + " |")
        lines.append("")
    lines += _multinode_lines(setup.work / MULTINODE_RESULTS)
    lines += ["## Refusals, fallbacks and failures", ""]
    notes = [c for c in cells if c["outcome"] != "green" or " instead of " in c.get("why", "")]
    lines += [f"- **{c['family']} / {c['target']} / {c['priority']}** (`{c['goal']}`): {c['outcome']}"
              f"{' at ' + c['stage'] if c['outcome'] != 'green' else ''}. "
              f"{c.get('message') or c.get('why', '')}" for c in notes] or ["None."]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
