"""Publish: the export's model card (``README.md``), written from every phase's artifacts with
huggingface_hub's card API, and the ``hf upload`` line that publishes it (printed, never run).

The last layer before the flows: it reads what intake, plan, manifest, validation and evaluation
wrote, and writes one file into the export. Nothing of the source is touched; a ``README.md`` in
the export that neither this package nor the base model wrote is the user's and is never replaced.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.fsio import atomic_write_text
from quark_ptq_eval.publish.base_card import BASE_MODEL_HELP, CARD_FILE, CARD_MARK, check_base_model
from quark_ptq_eval.publish.facts import ComparisonChoice, read_facts

CARD_CHOICES = ("write", "none")  # --card: write the card at the end of the recipe, or none


def write_card(workdir: Path, export: Path, *, base_model: str | None = None, repo_id: str | None = None,
               comparison: ComparisonChoice | None = None) -> Path:
    """Write ``export/README.md`` from the run in ``workdir``; returns its path. ``base_model``: the base's
    Hub id (default: the one the run was given, recorded in its run_state.json)."""
    from huggingface_hub import ModelCard

    from quark_ptq_eval.publish.body import card_body
    from quark_ptq_eval.publish.metadata import card_data

    facts = read_facts(workdir, export, base_model)
    facts.comparison = comparison
    repo = repo_id or default_repo_id(facts.export)
    data = card_data(facts, repo)
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{card_body(facts, repo)}")
    path = facts.export / CARD_FILE
    _check_ours(path, facts.base.card)
    atomic_write_text(path, str(card))
    return path


def _check_ours(path: Path, base_card: str | None) -> None:
    """A README.md already there may be replaced only if it is our card or a copy of the base's."""
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    copied = base_card is not None and Path(base_card).is_file() and Path(base_card).read_bytes() == path.read_bytes()
    if CARD_MARK not in text and not copied:
        raise UsageError(f"{path} is not a card quark-ptq-eval wrote (nor the base model's): it is left as it is.",
                         "Move it away, then run `quark-ptq-eval card` again (or keep it and run with --card none).")


def default_repo_id(export: Path) -> str:
    """The Hub repository the card and the upload line name by default: the export's directory name
    (without a namespace, `hf upload` puts it under the logged-in user)."""
    return Path(export).resolve().name


def upload_command(export: Path, repo_id: str | None = None) -> str:
    """The line that publishes the export (printed for the user, never run here)."""
    return shlex.join(["hf", "upload", repo_id or default_repo_id(export), str(Path(export).resolve()), "."])


__all__ = ["BASE_MODEL_HELP", "CARD_CHOICES", "CARD_FILE", "ComparisonChoice", "check_base_model", "upload_command",
           "write_card"]
