"""What the base model says about itself: its Hub id, licence and card metadata.

Read from the source's own ``README.md`` front matter (through huggingface_hub's card parser) and
its ``config.json``; nothing is guessed: a licence neither states is ``unknown``. The source's
files are only read. Only metadata that stays true of a quantized copy is carried over (licence,
language, datasets, tags, pipeline tag); the base card's results and text describe the base model
and are linked, never copied.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CARD_FILE = "README.md"
CARD_MARK = "Written by quark-ptq-eval from the artifacts in"  # the footer that makes a README.md ours
UNKNOWN_LICENSE = "unknown"
# the Hub cache's layout: .../models--ORG--NAME/snapshots/REVISION
_CACHE_DIR = re.compile(r"^models--(?P<org>[\w.-]+?)--(?P<name>[\w.-]+)$")
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
CARRIED = ("license", "license_name", "license_link", "language", "datasets")
# --base-model on run, resume, compare, sweep and card: one help, one check
BASE_MODEL_HELP = ("the base model's Hugging Face Hub id (ORG/NAME), written into the model card's metadata "
                   "(base_model, base_model_relation: quantized): a model read from a local directory names none "
                   "of its own")


@dataclass
class BaseCard:
    """The base model's identity and the metadata its card or config states."""

    path: str  # the source as the run read it (a local directory, or a Hub id)
    hub_id: str | None = None  # where the base lives on the Hub, when known
    hub_id_from: str = ""  # how it was found
    license: str = UNKNOWN_LICENSE
    license_from: str = "neither the base model's card nor its config.json states one"
    carried: dict[str, Any] = field(default_factory=dict)  # metadata carried into our card (licence included)
    tags: list[str] = field(default_factory=list)
    pipeline_tag: str | None = None
    card: str | None = None  # the base's own README.md (read, never copied), when it has one

    @property
    def link(self) -> str | None:
        """Where the base model's card is read: its Hub page, else its local file."""
        if self.hub_id:
            return f"https://huggingface.co/{self.hub_id}"
        return self.card


def read_base_card(model: str, source: str, base_model: str | None = None) -> BaseCard:
    """``model``: the analysis's model path; ``source``: ``local`` or ``huggingface_id``;
    ``base_model``: a Hub id the user states (it wins over what is found)."""
    base = BaseCard(path=model)
    base.hub_id, base.hub_id_from = _hub_id(model, source, base_model)
    directory = Path(model)
    if source != "local" or not directory.is_dir():
        return base
    config = json_or_empty(directory / "config.json")
    if isinstance(config.get("license"), str) and config["license"]:
        base.license, base.license_from = config["license"], "the base model's config.json"
        base.carried["license"] = config["license"]
    readme = directory / CARD_FILE
    if readme.is_file():
        base.card = str(readme)
        _read_front_matter(readme, base)
    return base


def _read_front_matter(readme: Path, base: BaseCard) -> None:
    from huggingface_hub import ModelCard

    if not readme.read_text(encoding="utf-8", errors="replace").startswith("---"):
        return  # a card without a metadata block states nothing to carry
    data = ModelCard.load(readme, ignore_metadata_errors=True).data.to_dict()
    for key in CARRIED:
        if data.get(key) not in (None, "", []):
            base.carried[key] = data[key]
    if isinstance(data.get("license"), str) and data["license"]:
        base.license, base.license_from = data["license"], "the base model's card"
    tags = data.get("tags") or []
    base.tags = [str(t) for t in ([tags] if isinstance(tags, str) else tags)]
    if isinstance(data.get("pipeline_tag"), str):
        base.pipeline_tag = data["pipeline_tag"]


def check_base_model(value: str | None) -> None:
    """Refuse a --base-model that is no Hub id (before any work: the card is the run's last step)."""
    if value is not None and not _HUB_ID.match(value):
        from quark_ptq_eval.base.errors import UsageError

        raise UsageError(f"--base-model {value!r} is not a Hugging Face Hub id (ORG/NAME).",
                         "Pass the id the model has on the Hub, e.g. --base-model Qwen/Qwen3-0.6B.")


def _hub_id(model: str, source: str, stated: str | None) -> tuple[str | None, str]:
    if stated:
        return stated, "given with --base-model"
    if source == "huggingface_id" and _HUB_ID.match(model):
        return model, "the run's model argument"
    parts = Path(model).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and (m := _CACHE_DIR.match(parts[-3])):
        return f"{m['org']}/{m['name']}", "the Hugging Face cache directory it was read from"
    return None, "give one with --base-model ORG/NAME (on run, compare, sweep, or `quark-ptq-eval card OUT`)"


def json_or_empty(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # absent or unreadable: the card says what is unknown
    return data if isinstance(data, dict) else {}
