"""Generate the CLI reference (docs/cli.md) from the real argparse parser, so it is never written twice.

``python -m quark_ptq_eval.cli.docs_gen docs/cli.md`` (what ``make docs`` runs) writes one section per
subcommand (description, usage, one options table per argument group) and the exit codes, read
from :class:`quark_ptq_eval.base.errors.ExitCode`. ``--check`` exits 1 when the file is stale. The output
does not depend on the terminal width, and nothing heavy (torch, Quark) is imported.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

from quark_ptq_eval.base.errors import ExitCode

HEADER = """# CLI reference

<!-- Generated from quark_ptq_eval.cli.main.build_parser() by `make docs`
     (python -m quark_ptq_eval.cli.docs_gen docs/cli.md). Do not edit by hand:
     tests/cli/test_docs_gen.py fails when this file and the parser disagree. -->
"""
NOTE = ("Options without a value are switches. An empty default means the option is not set: the plan "
        "recommends a value (shown with its reason in quant_plan.json) or an earlier run's value in the same "
        "--workdir is reused (`resume`). `-h` prints the same help on the terminal.")
EXIT_CODE_DEFAULT_MEANING = {"OK": "done: the command (or the step asked for) finished"}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _subcommand_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _value(action: argparse.Action) -> str:
    """How the option's value is written: ``NAME``, ``{a,b}``, ``[SRC]``, ``PATTERN [PATTERN ...]``."""
    if action.nargs == 0:
        return ""
    if action.choices is not None and action.metavar is None:
        name = "{" + ",".join(map(str, action.choices)) + "}"
    elif isinstance(action.metavar, tuple):
        return " ".join(action.metavar)
    else:
        name = action.metavar or (action.dest if not action.option_strings else action.dest.upper())
    return {"?": f"[{name}]", "*": f"[{name} ...]", "+": f"{name} [{name} ...]"}.get(str(action.nargs), name)


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.default in (None, "", argparse.SUPPRESS) or action.nargs == 0 or action.default is False:
        return ""
    return f"`{action.default}`"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {**vars(action), "prog": "", "default": action.default}
    if action.nargs == "?" and action.const is not None and action.option_strings:
        text += f" (flag alone: `{action.const}`)"
    if isinstance(action, argparse._AppendAction):
        text += " (repeatable)" if "repeatable" not in text else ""
    return text


def _flags(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings) if action.option_strings else f"`{action.dest}`"
    value = _value(action)
    return f"{names} `{value}`" if value and action.option_strings else names


def _options_table(actions: list[argparse.Action]) -> list[str]:
    lines = ["| option | default | description |", "|---|---|---|"]
    for a in actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) or a.help == argparse.SUPPRESS:
            continue
        lines.append(f"| {_cell(_flags(a))} | {_cell(_default(a))} | {_cell(_help(a))} |")
    return lines if len(lines) > 2 else []


def _usage(parser: argparse.ArgumentParser) -> str:
    """A short synopsis: the options are in the tables below it."""
    positionals = []
    for a in parser._positionals._group_actions:
        name = "COMMAND ..." if isinstance(a, argparse._SubParsersAction) else a.dest
        positionals.append(f"[{name}]" if a.nargs == "?" else name)
    return " ".join([parser.prog, "[options]", *positionals])


def _group_title(title: str | None) -> str:
    return {"positional arguments": "arguments", "options": "options", "optional arguments": "options"}.get(
        title or "", title or "options")


def command_section(name: str, parser: argparse.ArgumentParser) -> list[str]:
    out = [f"## `quark-ptq-eval {name}`", "", parser.description or "", "", "```", _usage(parser), "```"]
    for group in parser._action_groups:
        table = _options_table(group._group_actions)
        if table:
            out += ["", f"**{_group_title(group.title)}**", "", *table]
    return [*out, ""]


def exit_codes() -> list[tuple[str, int, str]]:
    """(name, value, meaning) from ExitCode; meanings are the comments next to each constant."""
    pattern = re.compile(r"^\s+([A-Z_]+)\s*=\s*(\d+)\s*(?:#\s*(.*))?$")
    rows = []
    for line in inspect.getsource(ExitCode).splitlines():
        m = pattern.match(line)
        if m:
            rows.append((m[1], int(m[2]), m[3] or EXIT_CODE_DEFAULT_MEANING.get(m[1], "")))
    return sorted(rows, key=lambda r: r[1])


def render(parser: argparse.ArgumentParser | None = None) -> str:
    if parser is None:
        from quark_ptq_eval.cli.main import build_parser

        parser = build_parser()
    subs, helps = _subparsers(parser), _subcommand_help(parser)
    out = [HEADER, parser.description or "", "", "```", _usage(parser), "```", "",
           "| command | what it does |", "|---|---|"]
    out += [f"| [`{n}`](#quark-ptq-eval-{n}) | {_cell(helps.get(n, ''))} |" for n in subs]
    out += ["", *_options_table(parser._actions), "", NOTE, ""]
    for name, sub in subs.items():
        out += command_section(name, sub)
    out += ["## Exit codes", "", "| code | name | meaning |", "|---|---|---|"]
    out += [f"| {value} | `{name}` | {_cell(meaning)} |" for name, value, meaning in exit_codes()]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m quark_ptq_eval.cli.docs_gen", description=__doc__.splitlines()[0])
    p.add_argument("output", type=Path, nargs="?", default=Path("docs/cli.md"))
    p.add_argument("--check", action="store_true", help="exit 1 if OUTPUT differs from the parser instead of writing")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run `make docs`.", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
