"""`quark-ptq-eval sweep`: its arguments and its command (cheap to import: no torch, no ray here)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quark_ptq_eval.base.errors import ExitCode
from quark_ptq_eval.base.ui import noise_to_log
from quark_ptq_eval.cli.args import add_gate_flags, add_ray_flag, approver


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("grid", type=Path, help="YAML or JSON: models (paths, or label: path), schemes, optional goals, "
                                           "and options (compare's, by keyword: calib_data, eval_data, ...)")
    p.add_argument("-o", "--output-root", dest="out_root", type=Path, required=True,
                   help="one comparison directory per model (and goal) under it, and the summary table")
    add_gate_flags(p)
    add_ray_flag(p, "every comparison's cells, each")
    from quark_ptq_eval.publish import BASE_MODEL_HELP

    p.add_argument("--base-model", dest="base_models", action="append", default=None, metavar="[LABEL=]ORG/NAME",
                   help=BASE_MODEL_HELP + "; one per model: LABEL=ORG/NAME (ORG/NAME alone for a grid of one "
                        "model), or `base_models` in the grid")
    p.add_argument("--speed", action="store_true",
                   help="every comparison also measures its schemes' and its baseline's serving speed, once each "
                        "(compare --speed; name the vLLM in the grid's options: vllm_python, or "
                        "$QUARK_PTQ_EVAL_VLLM_PYTHON)")
    p.add_argument("--json", action="store_true", help="print sweep_summary.json on stdout")
    p.add_argument("--quiet", "-q", action="store_true")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from quark_ptq_eval.flows.sweep import load_grid, sweep

    grid = load_grid(args.grid)
    if args.speed:  # as `speed: true` in the grid's options: every comparison runs compare --speed
        grid = replace(grid, options={**grid.options, "speed": True})
    with noise_to_log(Path(args.out_root).resolve() / "logs" / "sweep.log"):
        summary = sweep(grid, args.out_root, approver=approver(args), quiet=args.quiet or args.json, ray=args.ray,
                        base_models=args.base_models)
    if args.json:
        print(json.dumps(summary, indent=2))
    return ExitCode.OK
