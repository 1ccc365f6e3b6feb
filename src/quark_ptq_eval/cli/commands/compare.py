"""`quark-ptq-eval compare`: its arguments and its command (cheap to import: no torch here)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quark_ptq_eval.base.errors import ExitCode
from quark_ptq_eval.base.ui import noise_to_log
from quark_ptq_eval.cli.args import add_gate_flags, approver


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of compare/options.py's parts (the options are declared on their dataclasses' fields)."""
    from quark_ptq_eval.flows.compare.options import (
        BUDGET_PART,
        CACHE_PART,
        CARD_PART,
        MEASURE_PART,
        PLAN,
        RUN_PART,
        SERVING_PART,
        SPEED_WORKLOAD,
        TASKS,
        TIER1,
    )

    p.add_argument("model", nargs="?", help="local model directory (kept from the first call)")
    p.add_argument("--schemes", help="comma-separated Quark schemes, e.g. fp8,int8,int4_wo_128,mxfp4")
    p.add_argument("-o", "--output-root", dest="out_root", type=Path, required=True,
                   help="the comparison's directory: models, work dirs, baseline cache and the report")
    PLAN.add_flags(p.add_argument_group("quantization (every scheme)"))
    g = p.add_argument_group("evaluation (Tier 1 against a baseline evaluated once)")
    TIER1.add_flags(g)
    CACHE_PART.add_flags(g)
    TASKS.add_flags(p.add_argument_group("task scores (Tier 2: lm-eval per scheme, paired tests against the baseline)"))
    g = p.add_argument_group("serving speed (--speed: vLLM's own serving benchmark, each model once)")
    for part in (MEASURE_PART, SERVING_PART, SPEED_WORKLOAD):
        part.add_flags(g)
    BUDGET_PART.add_flags(p.add_argument_group("recommendation (accuracy budget)"))
    CARD_PART.add_flags(p.add_argument_group("the recommended scheme's model card"))
    g = p.add_argument_group("run control")
    add_gate_flags(g)
    RUN_PART.add_flags(g)  # --overwrite, --offline, --ray
    g.add_argument("--json", action="store_true", help="print comparison.json on stdout")
    g.add_argument("--quiet", "-q", action="store_true")


def run(args: argparse.Namespace) -> int:
    from quark_ptq_eval.flows.compare import compare
    from quark_ptq_eval.flows.compare.options import keywords

    given = {k: getattr(args, k) for k in keywords() if getattr(args, k, None) is not None}
    with noise_to_log(Path(args.out_root).resolve() / "logs" / "compare.log"):  # library chatter: the log
        result = compare(args.model, args.schemes, args.out_root, approver=approver(args), quiet=args.quiet or args.json,
                         **given)
    if args.json:
        print(json.dumps(result, indent=2))
    return ExitCode.OK
