"""`quark-ptq-eval engine-host --socket PATH`: keep torch, transformers and Quark imported and fork each
engine of the runs that name this host."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", required=True, type=Path, help="the path the runs name in $QUARK_PTQ_EVAL_ENGINE_HOST")


def run(args: argparse.Namespace) -> int:
    from quark_ptq_eval.execute.engine_host import main as host_main

    return host_main(["--socket", str(args.socket)])
