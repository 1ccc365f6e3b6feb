"""docs/cli.md is generated from the parser: it must be up to date and cover every command and exit code."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from quark_ptq_eval.base.errors import ExitCode
from quark_ptq_eval.cli import docs_gen
from quark_ptq_eval.cli.main import build_parser

CLI_MD = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_cli_md_is_up_to_date():
    assert CLI_MD.read_text(encoding="utf-8") == docs_gen.render(), (
        "docs/cli.md differs from the parser: run `make docs` and commit the result"
    )


def test_every_subcommand_and_option_is_documented():
    parser = build_parser()
    text = docs_gen.render(parser)
    subs = docs_gen._subparsers(parser)
    assert {"run", "resume", "status", "validate", "eval", "execute"} <= set(subs)
    for name, sub in subs.items():
        assert f"## `quark-ptq-eval {name}`" in text
        for action in sub._actions:
            if action.help == argparse.SUPPRESS:
                continue  # hidden aliases (quark-cli spellings) stay out of the docs
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in text, f"{name} {flag} missing"


def test_exit_codes_cover_every_code_with_a_meaning():
    rows = docs_gen.exit_codes()
    codes = {v for k, v in vars(ExitCode).items() if k.isupper()}
    assert {value for _, value, _ in rows} == codes
    assert all(meaning for _, _, meaning in rows)


def test_output_does_not_depend_on_terminal_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = docs_gen.render()
    monkeypatch.setenv("COLUMNS", "250")
    assert docs_gen.render() == narrow


def test_value_and_default_rendering():
    parser = build_parser()
    run = docs_gen._subparsers(parser)["run"]
    text = "\n".join(docs_gen.command_section("run", run))
    assert "| `--layer-quant-scheme` `PATTERN SCHEME` |" in text
    assert "`--exclude` `PATTERN [PATTERN ...]`" in text
    assert "`--baseline` `[SRC]`" in text
    assert "| `model` | required |" in text
    assert "| `--workdir` `WORKDIR` | `.` |" in text


def test_check_mode(tmp_path):
    out = tmp_path / "cli.md"
    assert docs_gen.main([str(out), "--check"]) == 1
    assert docs_gen.main([str(out)]) == 0
    assert docs_gen.main([str(out), "--check"]) == 0


def test_generating_imports_nothing_heavy(tmp_path):
    probe = (
        "import json, sys; from quark_ptq_eval.cli import docs_gen; docs_gen.render(); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'quark', 'transformers', 'lm_eval', 'datasets'))))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
