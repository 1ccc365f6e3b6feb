"""`quark-ptq-eval card OUT`: the export's model card (README.md) written again from its run's artifacts."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from quark_ptq_eval.publish.cli import add_card_arguments

    add_card_arguments(p)


def run(args: argparse.Namespace) -> int:
    from quark_ptq_eval.publish.cli import cmd_card

    return cmd_card(args)
