"""`quark-ptq-eval preflight`: detect the environment and write the context files."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from quark_ptq_eval.base.errors import ExitCode
from quark_ptq_eval.cli.args import add_run_control


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--deep", action="store_true",
                   help="also start quark-cli and build the capability catalog (pays the one-time costs now)")
    add_run_control(p)
    p.add_argument("model", nargs="?")
    p.add_argument("-o", "--output-dir")


def run(args: argparse.Namespace) -> int:
    from quark_ptq_eval.context import preflight

    args.workdir.mkdir(parents=True, exist_ok=True)
    ctx = preflight.gather(args.workdir.resolve(), {k: getattr(args, k) for k in preflight.CONTEXT_KINDS},
                           preflight.SessionAsk("", args.offline, args.execution_mode),
                           preflight.WorkspaceAsk(args.model or "", Path(args.model).resolve() if args.model else None,
                                                  Path(args.output_dir or "").resolve()))
    checks = preflight.host_checks(ctx, args.workdir.resolve(), deep=args.deep)
    data = {"env_context": ctx.env, "pytorch_install_result": ctx.pytorch, "quark_install_result": ctx.quark,
            "checks": [dataclasses.asdict(c) for c in checks]}
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(preflight.render_checks(checks, args.workdir.resolve()))
    return ExitCode.OK
