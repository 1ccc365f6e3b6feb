"""`quark-ptq-eval card OUT`: write the export's model card again from its run's artifacts (after a
later `eval`, for example), and print the line that publishes it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quark_ptq_eval.base.errors import ExitCode


def add_card_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output_dir", type=Path, metavar="OUT", help="the exported model (its README.md is written)")
    p.add_argument("--workdir", type=Path, default=Path("."),
                   help="the work dir of the run that wrote OUT (its artifacts are read; default: .)")
    from quark_ptq_eval.publish.base_card import BASE_MODEL_HELP

    p.add_argument("--base-model", metavar="ORG/NAME", help=f"{BASE_MODEL_HELP} (default: the run's own --base-model)")
    p.add_argument("--repo-id", metavar="REPO",
                   help="the Hub repository the card and the upload line name (default: OUT's directory name)")
    p.add_argument("--json", action="store_true", help="print the card's path and the upload line as JSON")


def cmd_card(args: argparse.Namespace) -> int:
    from quark_ptq_eval.publish import upload_command, write_card

    path = write_card(args.workdir, args.output_dir, base_model=args.base_model, repo_id=args.repo_id)
    upload = upload_command(args.output_dir, args.repo_id)
    if args.json:
        print(json.dumps({"card": str(path), "upload": upload}, indent=2))
    else:
        print(f"Model card: {path}\nTo publish it on the Hugging Face Hub (not run): {upload}")
    return ExitCode.OK
