"""The `quark-ptq-eval` command line: a thin layer over the Python API.

Exit codes: 0 done, 1 failed, 2 usage/bad input, 3 stopped at a checkpoint, 4 validation
failed, 5 work dir locked, 130 interrupted. Expected failures print one sentence (and a hint),
never a traceback. No torch or Quark import happens before a command needs it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from types import FrameType

from quark_ptq_eval import __version__
from quark_ptq_eval.base.errors import CheckpointPending, ExitCode, QpeError


def build_parser() -> argparse.ArgumentParser:
    """The parser: one subparser per row of ``COMMANDS``, its arguments added by the command's module."""
    from quark_ptq_eval.cli.commands import COMMANDS

    parser = argparse.ArgumentParser(prog="quark-ptq-eval", description=__doc__.split("\n")[0],
                                     epilog="Exit codes: 0 done, 1 failed, 2 usage, 3 checkpoint, "
                                            "4 validation failed, 5 locked, 130 interrupted.")
    parser.add_argument("--version", action="version", version=f"quark-ptq-eval {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        p.set_defaults(command=command.name)
        command.module.add_arguments(p)
    return parser


def _terminate(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    from quark_ptq_eval.cli.commands import BY_NAME
    from quark_ptq_eval.cli.quark_cli_flags import rewrite_model_dir

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(rewrite_model_dir(argv) if argv[:1] != ["import-command"] else argv)
    handler = BY_NAME[args.command].module.run
    from quark_ptq_eval.base.options import apply_offline

    apply_offline(getattr(args, "offline", None))  # every command, before anything could reach the Hub
    signal.signal(signal.SIGTERM, _terminate)  # SIGTERM stops as cleanly as Ctrl-C (exit 130)
    try:
        return handler(args)
    except CheckpointPending as exc:
        print(f"⏸  {exc.message}\n   {exc.hint}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"status": "waiting", "message": exc.message, "continue": exc.hint}))
        return exc.exit_code
    except QpeError as exc:
        print(f"error: {exc.message}" + (f"\n  hint: {exc.hint}" if exc.hint else ""), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED


def entry() -> None:
    """The `quark-ptq-eval` console script: main(), then out without the interpreter's teardown
    (base/process_exit.py)."""
    from quark_ptq_eval.base.process_exit import exit_now
    from quark_ptq_eval.execute.engine_client import forward_command

    forwarded = forward_command(sys.argv[1:])  # forked by a warm engine host where the user asked for it
    if forwarded is not None and forwarded < 0:  # ended by a signal: this stand-in ends the same way
        signal.signal(-forwarded, signal.SIG_DFL)
        os.kill(os.getpid(), -forwarded)
    exit_now(main() if forwarded is None else forwarded)


if __name__ == "__main__":
    entry()
