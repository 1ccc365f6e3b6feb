"""The recipe's artifacts as typed objects that serialise to the contract files.

analysis -> plan -> manifest (-> output -> validation report -> eval report). Each class knows
its file name, the step that produces it (named when it is missing) and its schema; loading
validates, writing validates then replaces the file atomically.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from quark_ptq_eval.base import contracts
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.fsio import atomic_write_text, read_json, write_json
from quark_ptq_eval.base.state import digest


class MissingArtifact(UsageError):
    pass


ArtifactT = TypeVar("ArtifactT", bound="Artifact")


@dataclass
class Artifact:
    FILENAME: ClassVar[str]
    KIND: ClassVar[str]
    PRODUCED_BY: ClassVar[str]
    # Fields that do not change what was decided (and so do not invalidate an approval).
    VOLATILE: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[ArtifactT], data: dict[str, Any], source: str | Path = "artifact") -> ArtifactT:
        contracts.check(cls.KIND, data, source)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @property
    def digest(self) -> str:
        return digest({k: v for k, v in self.to_dict().items() if k not in self.VOLATILE})

    @classmethod
    def path_in(cls, workdir: str | Path) -> Path:
        return Path(workdir) / cls.FILENAME

    def write(self, workdir: str | Path) -> Path:
        data = self.to_dict()
        contracts.check(self.KIND, data, self.FILENAME)
        return self._dump(self.path_in(workdir), data)

    @classmethod
    def load(cls: type[ArtifactT], workdir: str | Path) -> ArtifactT:
        path = cls.path_in(workdir)
        if not path.exists():
            raise MissingArtifact(
                f"{cls.FILENAME} is missing in {Path(workdir).resolve()}.",
                f"It is produced by the {cls.PRODUCED_BY} step: run `quark-ptq-eval {cls.PRODUCED_BY}` first.",
            )
        return cls.from_dict(cls._parse(path), path)

    @staticmethod
    def _dump(path: Path, data: dict[str, Any]) -> Path:
        return write_json(path, data)

    @staticmethod
    def _parse(path: Path) -> Any:
        data = read_json(path, "artifact")
        if not isinstance(data, dict):
            raise UsageError(f"{path} is not a JSON object.", "Regenerate it.")
        return data


@dataclass
class ModelAnalysis(Artifact):
    FILENAME: ClassVar[str] = "model_analysis.json"
    KIND: ClassVar[str] = "model_analysis"
    PRODUCED_BY: ClassVar[str] = "intake"
    VOLATILE: ClassVar[tuple[str, ...]] = ("analyzed_at",)

    analysis_status: str
    model: dict[str, Any]
    architecture: dict[str, Any]
    template: dict[str, Any]
    quantization_targets: dict[str, Any]
    size: dict[str, Any]
    risks: list[dict[str, Any]]
    analyzed_at: str = ""
    source_format: dict[str, Any] = field(default_factory=dict)  # intake/formats.py: what the weights are

    @property
    def model_type(self) -> str:
        model_type: str = self.model["model_type"]
        return model_type


@dataclass
class QuantPlan(Artifact):
    FILENAME: ClassVar[str] = "quant_plan.json"
    KIND: ClassVar[str] = "quant_plan"
    PRODUCED_BY: ClassVar[str] = "plan"
    # resources holds live host readings (free RAM and disk): a re-plan must not void an approval.
    VOLATILE: ClassVar[tuple[str, ...]] = ("requires_confirmation", "resources")

    model: dict[str, Any]
    global_scheme: str
    exclude_layers: list[str]
    exclude_source: str
    layer_quant_config: dict[str, str]
    algorithm: str | None
    kv_cache_scheme: str | None
    calibration: dict[str, Any]
    device_strategy: dict[str, Any]
    engine: dict[str, Any]
    trust_remote_code: bool
    evaluation_intent: str
    decisions: list[dict[str, Any]]
    requires_confirmation: bool = True
    output_dir: str = ""
    target: dict[str, Any] = field(default_factory=dict)  # where it will be served (plan/targets.py)
    resources: dict[str, Any] = field(default_factory=dict)  # what this host must hold (plan/resources.py)
    source_reading: dict[str, Any] = field(default_factory=dict)  # how the source is read (plan/source_reading.py)


@dataclass
class RunManifest(Artifact):
    FILENAME: ClassVar[str] = "run_manifest.yaml"
    KIND: ClassVar[str] = "run_manifest"
    PRODUCED_BY: ClassVar[str] = "manifest"
    VOLATILE: ClassVar[tuple[str, ...]] = ("runs", "observed")

    workflow: str
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    checkpoints: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    engine: dict[str, Any]
    command: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)
    observed: dict[str, Any] = field(default_factory=dict)

    @property
    def command_digest(self) -> str:
        """What the execution gate approves: the exact argv and environment."""
        return digest({"argv": self.command["argv"], "env": self.command.get("env", {})})

    @staticmethod
    def _dump(path: Path, data: dict[str, Any]) -> Path:
        import yaml

        return atomic_write_text(path, yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100))

    @staticmethod
    def _parse(path: Path) -> Any:
        import yaml

        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path} is not valid YAML ({exc}).", "Regenerate it with `quark-ptq-eval manifest`.") from None
        if not isinstance(data, dict):
            raise UsageError(f"{path} is not a YAML mapping.", "Regenerate it with `quark-ptq-eval manifest`.")
        return data
