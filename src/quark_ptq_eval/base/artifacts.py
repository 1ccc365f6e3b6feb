"""The recipe's artifacts as typed objects that serialise to the contract files.

analysis -> plan -> manifest (-> output -> validation report -> eval report). Each class knows
its file name, the step that produces it (named when it is missing) and its schema; loading
validates, writing validates then replaces the file atomically.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypedDict, TypeVar, cast

from quark_ptq_eval.base import contracts
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.base.fsio import atomic_write_text, read_json, write_json
from quark_ptq_eval.base.plan_records import DeviceStrategy, PlanEngine, PlannedCalibration, SourceReading
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
        return cls(**cls._sections({k: v for k, v in data.items() if k in names}))

    @classmethod
    def _sections(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """The fields with the sections a subclass types read from their JSON (the one place that reads them)."""
        return fields

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

    def write_if_changed(self, workdir: str | Path) -> bool:
        """Write unless the file already holds exactly this content (a resume that changed nothing
        leaves it, and its mtime, as it is); True when it was written."""
        try:
            unchanged = self._parse(self.path_in(workdir)) == self.to_dict()
        except UsageError:  # missing or unreadable: written anew
            unchanged = False
        if not unchanged:
            self.write(workdir)
        return not unchanged

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


# Ids of the decisions code looks up (plan.decision(id)); a row's label is what the plan table shows
# and quant_plan.json writes as "decision", free to change. A row of no listed id has its label as id.
DECISION_LABELS: dict[str, str] = {
    "target": "target", "global_scheme": "global_scheme", "algorithm": "algorithm",
    "kv_cache_scheme": "kv_cache_scheme", "exclude_layers": "exclude_layers",
    "layer_quant_config": "layer_quant_config", "calibration": "calibration",
    "calibration_size": "calibration size", "device": "device", "engine": "engine",
    "trust_remote_code": "trust_remote_code", "evaluation_intent": "evaluation_intent",
    "output_format": "output format", "warning": "warning", "sensitivity": "sensitivity",
    "serving_fit": "serving fit", "source_reading": "source reading", "deployment_groups": "deployment groups",
    "budget_search": "budget search",
}
_DECISION_IDS = {label: decision_id for decision_id, label in DECISION_LABELS.items()}
_ROW_KEYS = ("decision", "value", "reason")


@dataclass
class Decision:
    """One row of the plan's decision table: found by its ``id``, shown (and written to
    quant_plan.json as ``"decision"``) by its ``label``, with its value, why, and the further keys a
    row may carry (the sensitivity scan's figures). ``row["value"]`` reads the row as written."""

    id: str
    value: Any
    reason: str
    label: str = ""  # "": DECISION_LABELS' for the id
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.label = self.label or DECISION_LABELS.get(self.id, self.id)

    @classmethod
    def of(cls, row: Decision | dict[str, Any]) -> Decision:
        """A decision from itself or from the row quant_plan.json holds."""
        if isinstance(row, Decision):
            return row
        label = row["decision"]
        return cls(_DECISION_IDS.get(label, label), row.get("value"), row.get("reason", ""), label,
                   {k: v for k, v in row.items() if k not in _ROW_KEYS})

    def as_dict(self) -> dict[str, Any]:
        return {"decision": self.label, "value": self.value, "reason": self.reason, **self.extra}

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.as_dict().get(key, default)


class PlanJson(TypedDict, total=False):
    """quant_plan.json's content as the checks after execute read it (validation, evaluation): any
    of these keys, since a hand-written plan (``validate --plan FILE``) may hold only its
    exclusions. ``QuantPlan.as_json()`` gives a whole one."""

    model: dict[str, str]  # model_type, analysis_ref, model_path
    global_scheme: str
    exclude_layers: list[str]
    layer_quant_config: dict[str, str]
    algorithm: str | None
    kv_cache_scheme: str | None
    calibration: dict[str, Any]
    trust_remote_code: bool
    output_dir: str
    target: dict[str, Any]


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
    calibration: PlannedCalibration
    device_strategy: DeviceStrategy
    engine: PlanEngine
    trust_remote_code: bool
    evaluation_intent: str
    decisions: list[Decision]  # a row given as the dict quant_plan.json holds is read as its Decision
    requires_confirmation: bool = True
    output_dir: str = ""
    target: dict[str, Any] = field(default_factory=dict)  # where it will be served (plan/targets.py)
    resources: dict[str, Any] = field(default_factory=dict)  # what this host must hold (plan/resources.py)
    source_reading: SourceReading | None = None  # how the source is read (plan/source_reading.py); None: an older plan

    def __post_init__(self) -> None:
        self.decisions = [Decision.of(d) for d in self.decisions]

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        for name in ("calibration", "device_strategy", "engine"):  # the typed sections, as the plan has written them
            data[name] = getattr(self, name).to_dict()
        data["source_reading"] = self.source_reading.to_dict() if self.source_reading else {}  # {}: as older plans hold it
        data["decisions"] = [Decision.of(d).as_dict() for d in self.decisions]  # the rows as written
        return data

    @classmethod
    def _sections(cls, fields: dict[str, Any]) -> dict[str, Any]:
        return {**fields, "calibration": PlannedCalibration.from_dict(fields["calibration"]),
                "device_strategy": DeviceStrategy.from_dict(fields["device_strategy"]),
                "engine": PlanEngine.from_dict(fields["engine"]),
                "source_reading": SourceReading.from_dict(fields.get("source_reading") or {})}

    def as_json(self) -> PlanJson:
        """The plan as quant_plan.json holds it (to_dict), typed for the checks after execute."""
        return cast(PlanJson, self.to_dict())

    def decision(self, decision_id: str) -> Decision | None:
        """The first decision of that id (None: the plan made none)."""
        self.decisions = [Decision.of(d) for d in self.decisions]  # a row appended as a dict, too
        return next((d for d in self.decisions if d.id == decision_id), None)


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
