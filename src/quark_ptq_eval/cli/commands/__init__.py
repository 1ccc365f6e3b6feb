"""The commands, one row each: name, help (also the command's description) and the module that holds its
``add_arguments(parser)`` and ``run(args) -> int``. The parser is built from this table in its order
(``--help``, docs/cli.md); a new command is one module here and one row.

The modules are cheap to import (no torch, no Quark): what a command needs it imports in ``run``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Protocol

from quark_ptq_eval.cli.commands import (
    card,
    compare,
    engine_host,
    execute,
    import_command,
    intake,
    manifest,
    plan,
    preflight,
    resume,
    run,
    sensitivity,
    status,
    sweep,
    validate,
)
from quark_ptq_eval.cli.commands import eval as eval_command


class CommandModule(Protocol):
    """What a command's module holds."""

    def add_arguments(self, p: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    module: CommandModule


COMMANDS: tuple[Command, ...] = (
    # the recipe's steps, one command each, then `run` / `resume` over all of them
    Command("preflight", "Detect the environment and write the context files.", preflight),
    Command("intake", "Phase 1 step 1: analyse the model (config and headers only) -> model_analysis.json.", intake),
    Command("plan", "Phase 1 step 2: recommend a plan -> quant_plan.json (needs checkpoint 1).", plan),
    Command("manifest", "Phase 1 step 3: the exact command -> run_manifest.yaml (needs checkpoint 2).", manifest),
    Command("execute", "Phase 1 step 4: run the approved command and verify the output.", execute),
    Command("validate", "Phase 2: structural validation of a quantized model against its source.", validate),
    Command("eval", "Phase 3: evaluate a model (perplexity, lm-eval tasks, or vLLM on ROCm).", eval_command),
    Command("run", "The whole recipe: quantize -> validate -> evaluate, stopping at each gate.", run),
    Command("resume", "Continue the run in --workdir from where it stopped.", resume),
    # around the recipe: import a quark-cli line, compare schemes, scan sensitivity, the card, status
    Command("import-command", "Translate a pasted `quark-cli torch-llm-ptq ...` line into our plan and show it for "
                              "approval (a plan_only run).", import_command),
    Command("compare", "Compare schemes in one run: one intake, the plans approved together, one report.", compare),
    Command("sweep", "Compare schemes on several models (models x schemes x goals from a YAML/JSON grid): one "
                     "comparison each, one summary table.", sweep),
    Command("sensitivity", "Measure how much quantizing each layer alone hurts; propose layers to keep unquantized.",
            sensitivity),
    Command("card", "Write the export's model card (README.md) again from its run's artifacts.", card),
    Command("status", "Show where the run in --workdir stands.", status),
    Command("engine-host", "Keep torch, transformers and Quark imported and fork each engine of the runs that name "
                           "this host in $QUARK_PTQ_EVAL_ENGINE_HOST, and their whole commands where "
                           "$QUARK_PTQ_EVAL_HOST_COMMANDS=1 and no terminal is on stdin (many runs in a row on one "
                           "CPU host).", engine_host),
)
BY_NAME = {c.name: c for c in COMMANDS}
