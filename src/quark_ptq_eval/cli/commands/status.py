"""`quark-ptq-eval status`: where the run in --workdir stands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quark_ptq_eval.base.errors import ExitCode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", type=Path, default=Path("."))
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from quark_ptq_eval.flows.recipe.status import describe_status

    report = describe_status(args.workdir)
    print(json.dumps(report, indent=2) if args.json else report["text"])
    return ExitCode.OK
