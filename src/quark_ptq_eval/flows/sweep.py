"""`quark-ptq-eval sweep GRID`: models x schemes (x goals) from a YAML or JSON file, one comparison
per model (and goal), each through compare's own flow (locally, or its cells as Ray tasks with
``--ray``), one report per comparison and one summary table.

    models: {llama: ./tiny-llama, qwen3: ./tiny-qwen3}   # or a list of paths
    schemes: [int8, int4_wo_128]
    goals: ["accuracy first"]                             # optional: one comparison per goal
    options: {calib_data: calib.txt, eval_data: eval.txt, max_windows: 8}   # compare's keywords
    base_models: {llama: acme/tiny-llama}                 # optional: each model's Hub id, for its card

``--base-model LABEL=ORG/NAME`` (or ``ORG/NAME`` when the grid has one model) names them too.

Relative paths in the grid are read from the grid file's folder. Every grid cell is a recipe run
like any other: its gates approved by name (``--approve``), its output claimed. A comparison that
stops at a gate does not stop the others; the sweep then exits at that checkpoint (3) with the
command that continues it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import CheckpointPending, QpeError, UsageError
from quark_ptq_eval.base.fsio import atomic_write_text, write_json
from quark_ptq_eval.base.gates import Approver, FlagApprover
from quark_ptq_eval.flows.compare.document import SweepSummary

SUMMARY_JSON, SUMMARY_MD = "sweep_summary.json", "sweep_summary.md"
PATH_OPTIONS = ("calib_data", "eval_data", "include_path")


@dataclass(frozen=True)
class Grid:
    models: dict[str, str]  # label -> local model directory
    schemes: list[str]
    goals: list[str]  # [""]: no goal given
    options: dict[str, Any]
    base_models: dict[str, str] = field(default_factory=dict)  # label -> the model's Hub id, for its card


def _label(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "model"


def _read(path: Path) -> Any:
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"Cannot read the sweep grid {path}: {exc.strerror or exc}.") from None
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise UsageError(f"The sweep grid {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                         f"{str(exc).splitlines()[0]}.") from None


def load_grid(path: str | Path) -> Grid:
    from quark_ptq_eval.flows.compare.options import keywords

    path = Path(path).expanduser().resolve()
    doc = _read(path)
    if not isinstance(doc, dict) or not doc.get("models") or not doc.get("schemes"):
        raise UsageError(f"The sweep grid {path} needs `models` and `schemes`.",
                         "See `quark-ptq-eval sweep --help` for the grid's form.")
    models = doc["models"]
    if isinstance(models, list):
        models = {_label(Path(str(m)).name): m for m in models}
    here = path.parent
    models = {_label(str(k)): str((here / str(v)).resolve()) for k, v in models.items()}
    schemes = doc["schemes"].split(",") if isinstance(doc["schemes"], str) else [str(s) for s in doc["schemes"]]
    options = dict(doc.get("options") or {})
    unknown = set(options) - keywords()
    if unknown:
        raise UsageError(f"Unknown option(s) in the sweep grid {path}: {', '.join(sorted(unknown))}.",
                         f"A grid takes compare's options: {', '.join(sorted(keywords()))}.")
    for key in PATH_OPTIONS:
        if options.get(key):
            options[key] = str((here / str(options[key])).resolve())
    goals = [str(g) for g in doc.get("goals") or []] or [""]
    named = doc.get("base_models") or {}
    if not isinstance(named, dict):
        raise UsageError(f"`base_models` in the sweep grid {path} must map model labels to Hub ids.")
    if options.get("base_model"):  # compare's keyword names the one model's base
        named = {"": options.pop("base_model"), **named}
    grid = Grid(models, [s.strip() for s in schemes if s.strip()], goals, options)
    return with_base_models(grid, [f"{k}={v}" if k else str(v) for k, v in named.items()], str(path))


def with_base_models(grid: Grid, given: list[str], where: str = "--base-model") -> Grid:
    """``grid`` with each ``LABEL=ORG/NAME`` (or ``ORG/NAME`` alone, for a grid of one model) as the
    Hub id its model's card names."""
    from quark_ptq_eval.publish import check_base_model

    named = dict(grid.base_models)
    for item in given:
        label, _, hub_id = item.rpartition("=")
        label = _label(label) if label else ""
        if not label:
            if len(grid.models) != 1:
                raise UsageError(f"{where}: base model {hub_id} names no model, and the grid has "
                                 f"{len(grid.models)} ({', '.join(grid.models)}).",
                                 "Name it for one: --base-model LABEL=ORG/NAME (or `base_models` in the grid).")
            label = next(iter(grid.models))
        if label not in grid.models:
            raise UsageError(f"{where}: {label} is none of the grid's models ({', '.join(grid.models)}).")
        check_base_model(hub_id)
        named[label] = hub_id
    return replace(grid, base_models=named)


def sweep(grid: str | Path | Grid, out_root: str | Path, *, approver: Approver | None = None, quiet: bool = True,
          ray: str | None = None, progress: Callable[[str, str], None] | None = None,
          base_models: list[str] | None = None) -> SweepSummary:
    """Every comparison of the grid (resumed where it stopped); returns sweep_summary.json's content.
    Raises ``CheckpointPending`` after the last comparison when any of them waits at a gate.
    ``base_models``: ``LABEL=ORG/NAME`` each (``ORG/NAME`` alone for a grid of one model). The grid's options
    are compare's: ``speed: true`` (and ``vllm_python``) measures every comparison's cells' and baseline's
    serving speed (compare --speed)."""
    from quark_ptq_eval.flows.compare import compare

    given = with_base_models(grid if isinstance(grid, Grid) else load_grid(grid), base_models or [])
    root = Path(out_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for label, model in given.models.items():
        for goal in given.goals:
            name = label + (f"-{_label(goal)}" if goal else "")
            entry: dict[str, Any] = {"model": label, "goal": goal or None, "root": str(root / name)}
            options = {**given.options, **({"goal": goal} if goal else {}), **({"ray": ray} if ray else {}),
                       **({"base_model": given.base_models[label]} if label in given.base_models else {})}
            try:
                doc = compare(model, given.schemes, root / name, approver=approver or FlagApprover(), quiet=quiet,
                              progress=progress, **options)
                entry.update(status="done", report=doc["artifacts"]["report"], schemes=doc["schemes"],
                             recommendation=doc["recommendation"].get("scheme"), cluster=doc.get("cluster"))
            except CheckpointPending as exc:
                entry.update(status="waiting", message=exc.message, hint=exc.hint)
            except QpeError as exc:
                entry.update(status="failed", message=exc.message, hint=exc.hint)
            entries.append(entry)
    summary: SweepSummary = {"schema": "quark-ptq-eval/sweep/1", "schemes": given.schemes, "comparisons": entries}
    write_json(root / SUMMARY_JSON, summary)
    atomic_write_text(root / SUMMARY_MD, summary_markdown(summary))
    waiting = [e for e in entries if e["status"] == "waiting"]
    if waiting:
        raise CheckpointPending(f"{len(waiting)} of the sweep's {len(entries)} comparisons wait at a checkpoint "
                                f"({'; '.join(e['message'] for e in waiting)}).",
                                f"Approve and re-run the sweep: quark-ptq-eval sweep GRID -o {root} --approve GATES "
                                f"(their reports so far: {root / SUMMARY_MD}).")
    return summary


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _speed_cell(row: dict[str, Any]) -> str:
    """compare --speed's measured throughput and gain over the baseline ("-": not measured)."""
    if row.get("output_tokens_per_s") is None:
        return "not served" if row.get("speed_refused") else "-"
    gain = row.get("throughput_gain")
    return f"{row['output_tokens_per_s']:.1f}" + (f" ({gain:.2f}x)" if gain is not None else "")


def summary_markdown(summary: SweepSummary) -> str:
    lines = ["# Sweep summary", "", "| model | goal | scheme | status | size MiB | bits/weight | ppl +% | KL mean | "
             "output tok/s (gain) | node | recommended |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary["comparisons"]:
        if e["status"] != "done":
            lines.append(f"| {e['model']} | {e['goal'] or '-'} | - | {e['status']}: {e['message']} | | | | | | | |")
            continue
        cells = (e.get("cluster") or {}).get("cells", {})
        for r in e["schemes"]:
            status = r["status"] if r["status"] != "failed" else f"failed at {r.get('failed_step')}: {r.get('error')}"
            cell = cells.get(r["scheme"], {})
            node = (cell.get("node") or "-") + (" (retried)" if cell.get("retried") else "")
            size = r.get("size_bytes") / 2**20 if r.get("size_bytes") else None
            lines.append(f"| {e['model']} | {e['goal'] or '-'} | {r['scheme']} | {status} | {_num(size, '.2f')} | "
                         f"{_num(r.get('bits_per_weight'), '.2f')} | {_num(r.get('ppl_increase_pct'), '.2f')} | "
                         f"{_num(r.get('kl_mean'), '.4f')} | {_speed_cell(r)} | {node} | "
                         f"{'yes' if e['recommendation'] == r['scheme'] else ''} |")
    lines += ["", "One report per comparison:", ""]
    lines += [f"- {e['model']}{' / ' + e['goal'] if e['goal'] else ''}: {e.get('report') or e['root']}"
              for e in summary["comparisons"]]
    return "\n".join(lines) + "\n"
