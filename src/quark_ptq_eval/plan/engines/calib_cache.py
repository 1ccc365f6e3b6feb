"""Serve ``quark-cli``'s fixed calibration datasets from the user's own local text, offline.

``quark-cli torch-llm-ptq`` (amd-quark 0.13) only calibrates on fixed Hub datasets
(``--dataset pileval`` = ``mit-han-lab/pile-val-backup`` ...). With ``HF_DATASETS_OFFLINE=1``,
``datasets`` falls back to a *prepared* cache entry
``<HF_DATASETS_CACHE>/<namespace>___<name>/<config>/0.0.0/<hash>/`` (``dataset_info.json`` plus
``<name>-<split>.arrow``). We write such an entry from local text into a PRIVATE cache directory
and hand the child process its location through the environment: the user's ``~/.cache`` and
Quark's package files are never touched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.textdata import load_texts, split_plain_text

# Bump when the on-disk layout we write changes: a new value invalidates every reused entry.
_LAYOUT_VERSION = "1"
_HUB_VERSION = "0.0.0"  # the version folder `datasets` uses for Hub datasets without a version


@dataclass(frozen=True)
class HubDataset:
    """Where ``quark-cli`` reads one ``--dataset`` choice from (see quark/torch/utils/llm/data_preparation.py)."""

    repo_id: str
    config: str | None  # None: loaded without a config name -> folder "default"
    split: str
    column: str

    @property
    def config_folder(self) -> str:
        return self.config or "default"

    @property
    def short_name(self) -> str:
        return self.repo_id.split("/")[-1]


# quark-cli `--dataset` value -> the Hub dataset its calibration loader reads (amd-quark 0.13).
CALIBRATION_DATASETS: dict[str, HubDataset] = {
    "pileval": HubDataset("mit-han-lab/pile-val-backup", None, "validation", "text"),
    "pileval_for_awq_benchmark": HubDataset("mit-han-lab/pile-val-backup", None, "validation", "text"),
    "wikitext": HubDataset("Salesforce/wikitext", "wikitext-2-raw-v1", "train", "text"),
    "wikitext_for_gptq_benchmark": HubDataset("Salesforce/wikitext", "wikitext-2-raw-v1", "train", "text"),
    "cnn_dailymail": HubDataset("abisee/cnn_dailymail", "3.0.0", "train", "article"),
}


def prepare_offline_calibration(texts_path: Path, cache_dir: Path, dataset: str = "pileval") -> dict[str, str]:
    """Build (or reuse) a private prepared cache serving ``dataset`` from ``texts_path``.

    Returns the environment variables to add to the ``quark-cli`` child's environment.
    """
    spec = _spec(dataset)
    documents = read_documents(Path(texts_path))
    cache_dir = Path(cache_dir).expanduser().resolve()
    config_dir = cache_dir / _cache_folder(spec.repo_id) / spec.config_folder / _HUB_VERSION
    entry = config_dir / _content_hash(spec, documents)
    if not (entry / "dataset_info.json").is_file():
        _write_entry(entry, spec, documents)
    _drop_other_entries(cache_dir / _cache_folder(spec.repo_id), keep=entry)
    return offline_env(cache_dir)


def offline_env(cache_dir: Path) -> dict[str, str]:
    """The child's environment: offline everywhere, every `datasets` write inside ``cache_dir``."""
    cache_dir = Path(cache_dir).expanduser().resolve()
    return {
        "HF_DATASETS_CACHE": str(cache_dir),
        # Dynamic modules would otherwise land in the user's ~/.cache/huggingface/modules.
        "HF_MODULES_CACHE": str(cache_dir / "modules"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def read_documents(path: Path) -> list[str]:
    """Calibration documents of a local .txt/.jsonl/.parquet (or saved `datasets`) source."""
    texts = load_texts(path)
    if Path(path).suffix == ".txt":
        texts = split_plain_text(texts[0] if texts else "")
    documents = [t for t in (s.strip() for s in texts) if t]
    if not documents:
        raise UsageError(f"The calibration text {path} holds no text.")
    return documents


def _spec(dataset: str) -> HubDataset:
    if dataset not in CALIBRATION_DATASETS:
        known = ", ".join(sorted(CALIBRATION_DATASETS))
        raise UsageError(f"quark-cli dataset {dataset!r} cannot be served from local text (supported: {known}).")
    return CALIBRATION_DATASETS[dataset]


def _cache_folder(repo_id: str) -> str:
    # Mirrors datasets' own naming: "ns/Name" -> "ns___name" (camelCase -> snake_case on the name).
    from datasets.naming import camelcase_to_snakecase

    *namespace, name = repo_id.split("/")
    return "___".join([*namespace, camelcase_to_snakecase(name)])


def _content_hash(spec: HubDataset, documents: list[str]) -> str:
    digest = hashlib.sha256(f"{_LAYOUT_VERSION}\0{spec}\0".encode())
    for doc in documents:
        data = doc.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:32]


def _write_entry(entry: Path, spec: HubDataset, documents: list[str]) -> None:
    """Write the prepared entry in a scratch folder, then rename it into place (atomic)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=entry.parent, prefix=".building-") as tmp:
        scratch = Path(tmp) / "entry"
        scratch.mkdir()
        _write_arrow_and_info(scratch, spec, documents)
        try:
            scratch.rename(entry)
        except OSError:
            if not (entry / "dataset_info.json").is_file():  # not a concurrent writer's finished copy
                raise


def _write_arrow_and_info(folder: Path, spec: HubDataset, documents: list[str]) -> None:
    import datasets
    from datasets.arrow_writer import ArrowWriter

    features = datasets.Features({spec.column: datasets.Value("string")})
    with ArrowWriter(features=features, path=str(folder / f"{spec.short_name}-{spec.split}.arrow")) as writer:
        for doc in documents:
            writer.write({spec.column: doc})
        num_examples, num_bytes = writer.finalize()
    split = datasets.SplitInfo(name=spec.split, num_bytes=num_bytes, num_examples=num_examples,
                               dataset_name=spec.short_name)
    # config_name must equal the config folder: datasets' offline lookup checks it.
    info = datasets.DatasetInfo(features=features, dataset_name=spec.short_name, config_name=spec.config_folder,
                                builder_name="cache", version=_HUB_VERSION,
                                splits=datasets.SplitDict({spec.split: split}, dataset_name=spec.short_name),
                                dataset_size=num_bytes,
                                description="Local calibration text served offline by quark-ptq-eval.")
    info.write_to_directory(str(folder))


def _drop_other_entries(dataset_root: Path, keep: Path) -> None:
    """`datasets` picks the most recent entry: remove stale ones so it can only pick ``keep``."""
    for info in dataset_root.glob("*/*/*/dataset_info.json"):
        if info.parent != keep:
            shutil.rmtree(info.parent, ignore_errors=True)
    os.utime(keep)
