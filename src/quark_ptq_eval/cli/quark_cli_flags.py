"""For people who come from ``quark-cli``: its flag spellings, and its pasted command lines.

One table (``QUARK_CLI_FLAGS``) says how each ``quark-cli torch-llm-ptq`` flag maps onto ours. It
serves twice: as hidden aliases on our plan commands (``--num_calib_data`` works like
``--num-calib-samples``, hidden from ``--help`` and docs/cli.md), and to translate a whole pasted
``quark-cli torch-llm-ptq ...`` line into the equivalent ``quark-ptq-eval run ... --execution-mode
plan_only``, which goes through the normal analysis and plan checkpoints.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.context.quark_cli import SUBCOMMAND
from quark_ptq_eval.evaluate.tiers import NO_EVALUATION

# quark-cli 0.13's own defaults for the calibration size: a pasted line that omits them ran with these.
QUARK_CLI_DEFAULTS = {"--num_calib_data": "512", "--seq_len": "512"}


@dataclass(frozen=True)
class Flag:
    quark: tuple[str, ...]  # quark-cli spellings
    ours: str  # our option ("" for the positional MODEL)
    dest: str  # argparse dest in our parser
    kwargs: dict[str, Any] = field(default_factory=dict)  # how the quark-cli flag takes its value
    eval_only: bool = False  # only on commands that also evaluate (run, resume)


class _ExcludeLayers(argparse.Action):
    """quark-cli's ``--exclude_layers`` with no value means "exclude nothing": our --no-exclusions."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ARG002
        if values:
            namespace.exclude_layers = list(values)
        else:
            namespace.no_exclusions = True


QUARK_CLI_FLAGS: tuple[Flag, ...] = (
    Flag(("--output_dir",), "--output-dir", "output_dir"),
    Flag(("--quant_scheme",), "--scheme", "scheme"),
    Flag(("--quant_algo",), "--algorithm", "algorithm"),
    Flag(("--kv_cache_dtype", "--kv_cache_quant_scheme"), "--kv-cache-scheme", "kv_cache_scheme"),
    Flag(("--exclude_layers",), "--exclude", "exclude_layers", {"nargs": "*", "action": _ExcludeLayers}),
    Flag(("--layer_quant_scheme",), "--layer-quant-scheme", "layer_quant_config",
         {"nargs": 2, "action": "append", "metavar": ("PATTERN", "SCHEME")}),
    Flag(("--num_calib_data",), "--num-calib-samples", "num_calib_samples", {"type": int}),
    Flag(("--seq_len",), "--calib-seq-len", "calib_seq_len", {"type": int}),
    Flag(("--batch_size",), "--batch-size", "batch_size", {"type": int}),
    Flag(("--dataset",), "--calib-dataset", "calib_dataset"),
    Flag(("--multi_device",), "--multi-device", "multi_device", {"action": "store_true", "default": None}),
    Flag(("--no_trust_remote_code",), "", "trust_remote_code",
         {"action": "store_const", "const": False, "default": None}),
    Flag(("--skip_evaluation",), f"--eval-tier {NO_EVALUATION}", "eval_tier",
         {"action": "store_const", "const": NO_EVALUATION, "default": None}, eval_only=True),
)
# quark-cli flags that need no translation (same spelling) or cannot be honoured, with why.
SAME_SPELLING = {"--device": "device"}
NOT_TRANSLATED = {
    "--template_file": "custom Quark templates are not wired into quark-ptq-eval yet",
    "--evaluation_dataset": "Phase 3 chooses its own evaluation (Tier 1 uses wikitext-2 or --eval-data)",
}


def add_hidden_aliases(parser: argparse.ArgumentParser, with_eval: bool) -> None:
    """quark-cli spellings on a plan command, hidden from --help and docs/cli.md."""
    for flag in QUARK_CLI_FLAGS:
        if flag.eval_only and not with_eval:
            continue
        parser.add_argument(*flag.quark, dest=flag.dest, help=argparse.SUPPRESS, **flag.kwargs)


def rewrite_model_dir(argv: list[str]) -> list[str]:
    """``--model_dir X`` (quark-cli) is our positional MODEL: argparse cannot alias a positional."""
    out: list[str] = []
    it = iter(argv)
    for token in it:
        if token == "--model_dir":
            out.append(next(it, "--model_dir"))
        elif token.startswith("--model_dir="):
            out.append(token.split("=", 1)[1])
        else:
            out.append(token)
    return out


# ---------------------------------------------------------------- import-command


class _Refused(Exception):
    pass


class _QuarkCliParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit 2: we want one sentence
        raise _Refused(message)


def _quark_cli_parser() -> argparse.ArgumentParser:
    p = _QuarkCliParser(prog=f"quark-cli {SUBCOMMAND}", add_help=False, allow_abbrev=False)
    p.add_argument("--model_dir", dest="model")
    p.add_argument("--device", dest="device")
    for flag in QUARK_CLI_FLAGS:
        p.add_argument(*flag.quark, dest=flag.dest, **flag.kwargs)
    for name in NOT_TRANSLATED:
        p.add_argument(name, dest=f"untranslated_{name.lstrip('-')}")
    return p


def split_command(text: str | list[str]) -> list[str]:
    """The flags of a pasted ``[ENV=..] quark-cli torch-llm-ptq FLAGS`` line (continuations allowed)."""
    tokens = shlex.split(text.replace("\\\n", " ")) if isinstance(text, str) else list(text)
    if len(tokens) == 1 and " " in tokens[0]:
        tokens = shlex.split(tokens[0].replace("\\\n", " "))  # the whole line given as one argument
    while tokens and ("=" in tokens[0] and not tokens[0].startswith("-") or tokens[0] in ("$", "env")):
        tokens.pop(0)  # `$ `, `env`, `CUDA_VISIBLE_DEVICES=0 ...`
    if tokens and Path(tokens[0]).name == "quark-cli":
        tokens.pop(0)
    if tokens and tokens[0] == SUBCOMMAND:
        tokens.pop(0)
    elif tokens and not tokens[0].startswith("-"):
        raise UsageError(f"import-command reads `quark-cli {SUBCOMMAND} ...` lines, not `{tokens[0]} ...`; "
                         f"paste the quark-cli command in quotes.")
    return tokens


def translate(text: str | list[str]) -> tuple[list[str], list[tuple[str, str, str]]]:
    """(our `run` arguments, rows of quark-cli flag -> our option -> note) for a pasted quark-cli line."""
    tokens = split_command(text)
    try:
        ns, extra = _quark_cli_parser().parse_known_args(tokens)
    except _Refused as exc:
        raise UsageError(f"The pasted quark-cli command does not parse ({exc}); check it against "
                         f"`quark-cli {SUBCOMMAND} --help`.") from None
    if extra:
        raise UsageError(f"import-command does not know {extra[0]!r}: it is not a quark-cli {SUBCOMMAND} flag it "
                         "can translate; remove it or set the matching `quark-ptq-eval run` option yourself.")
    for name, why in NOT_TRANSLATED.items():
        if getattr(ns, f"untranslated_{name.lstrip('-')}") is not None:
            raise UsageError(f"import-command cannot translate {name}: {why}.")
    if not ns.model:
        raise UsageError("The pasted quark-cli command has no --model_dir; add the model directory to it.")
    return _our_arguments(ns, tokens)


def _our_arguments(ns: argparse.Namespace, tokens: list[str]) -> tuple[list[str], list[tuple[str, str, str]]]:
    args = [ns.model]
    rows = [("--model_dir", "MODEL", ns.model)]
    if ns.device:
        args += ["--device", ns.device]
        rows.append(("--device", "--device", ns.device))
    given = {t.split("=", 1)[0] for t in tokens if t.startswith("--")}
    for flag in QUARK_CLI_FLAGS:
        value = getattr(ns, flag.dest, None)
        spelled = next((q for q in flag.quark if q in given), flag.quark[0])
        if flag.dest == "exclude_layers" and getattr(ns, "no_exclusions", None):
            args.append("--no-exclusions")
            rows.append((spelled, "--no-exclusions", "no value: exclude nothing, lm_head included"))
            continue
        if value is None and spelled in QUARK_CLI_DEFAULTS:
            value = int(QUARK_CLI_DEFAULTS[spelled])
            rows.append((spelled, flag.ours, f"{value} (quark-cli's default: the pasted command ran with it)"))
        elif value is None or flag.dest == "trust_remote_code":
            continue
        else:
            rows.append((spelled, flag.ours, _show(value)))
        args += _as_options(flag, value)
    if getattr(ns, "trust_remote_code", None) is None:
        rows.append(("(no --no_trust_remote_code)", "-", "quark-cli trusts the model's code by default; here it "
                                                           "stays off unless you add --trust-remote-code"))
    return args, rows


def _as_options(flag: Flag, value: Any) -> list[str]:
    if flag.dest == "layer_quant_config":
        return [t for pattern, scheme in value for t in (flag.ours, pattern, scheme)]
    if flag.dest == "exclude_layers":
        return [flag.ours, *value]
    if flag.kwargs.get("action") in ("store_true", "store_const"):
        return flag.ours.split()
    return [flag.ours, str(value)]


def _show(value: Any) -> str:
    if isinstance(value, list) and value and isinstance(value[0], list | tuple):
        return ", ".join(f"{p} -> {s}" for p, s in value)
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def with_common_options(args: argparse.Namespace, context_kinds: tuple[str, ...]) -> list[str]:
    """import-command's own options, spelled for `run`; plan_only unless another mode was asked for."""
    out: list[str] = []
    if args.output_dir:
        out += ["--output-dir", str(args.output_dir)]  # after the pasted --output_dir: argparse keeps the last
    if args.calib_data:
        out += ["--calib-data", str(args.calib_data)]
    if str(args.workdir) != ".":
        out += ["--workdir", str(args.workdir)]
    if args.approve:
        out += ["--approve", args.approve]
    out += [flag for flag, on in (("--yes", args.yes), ("--json", args.json), ("--quiet", args.quiet),
                                  ("--offline", args.offline)) if on]
    for kind in context_kinds:
        if getattr(args, kind, None):
            out += [f"--{kind.replace('_', '-')}", str(getattr(args, kind))]
    return [*out, "--execution-mode", args.execution_mode or "plan_only"]
