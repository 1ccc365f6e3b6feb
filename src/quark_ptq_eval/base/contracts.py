"""JSON-schema validation of every artifact: against our own schema and Quark's contract.

Quark ships its contracts inside the wheel (``quark/_bundled_skills/.../contracts``); they are
located without importing Quark. Schema errors name the offending field.
"""

from __future__ import annotations

import importlib.util
import json
from functools import cache
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import UsageError

OWN_SCHEMAS = Path(__file__).parent / "schemas"
QUARK_CONTRACT_DIRS = (
    "_bundled_skills/quark-torch-ptq/references/contracts",
    "_bundled_skills/_legacy_impl/shared/contracts",
)


@cache
def quark_contract_dir() -> Path | None:
    spec = importlib.util.find_spec("quark")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for rel in QUARK_CONTRACT_DIRS[::-1]:
            if (Path(root) / rel).is_dir():
                return Path(root) / rel
    return None


@cache
def _schema(path: Path) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return schema


def quark_contract(kind: str) -> dict[str, Any] | None:
    d = quark_contract_dir()
    return _schema(d / f"{kind}.schema.json") if d and (d / f"{kind}.schema.json").exists() else None


def own_schema(kind: str) -> dict[str, Any] | None:
    p = OWN_SCHEMAS / f"{kind}.schema.json"
    return _with_registries(kind, _schema(p)) if p.exists() else None


# The registries live in the steps that own them (above the base): named here as a registry row names
# its module, and read only when a schema is filled in.
ENGINE_TABLE = "quark_ptq_eval.plan.engines:ENGINES"
SOURCE_FORMAT_TABLE = "quark_ptq_eval.intake.formats:FORMATS"


def _registry_names(table: str) -> tuple[str, ...]:
    from quark_ptq_eval.base.registry import load

    return tuple(load(table))


def _with_registries(kind: str, schema: dict[str, Any]) -> dict[str, Any]:
    """Enums that a registry owns are filled in here, never typed into the schema files."""
    if kind == "model_analysis":
        return _with_source_formats(schema)
    if kind != "quant_plan":
        return schema
    engine = schema["properties"]["engine"]
    name = {**engine["properties"]["name"], "enum": list(_registry_names(ENGINE_TABLE))}
    engine = {**engine, "properties": {**engine["properties"], "name": name}}
    return {**schema, "properties": {**schema["properties"], "engine": engine}}


def _with_source_formats(schema: dict[str, Any]) -> dict[str, Any]:
    fmt = schema["properties"]["source_format"]
    name = {**fmt["properties"]["name"], "enum": list(_registry_names(SOURCE_FORMAT_TABLE))}
    fmt = {**fmt, "properties": {**fmt["properties"], "name": name}}
    return {**schema, "properties": {**schema["properties"], "source_format": fmt}}


def schema_errors(kind: str, data: object) -> list[str]:
    """All violations of our schema and Quark's contract, each as 'field: problem'."""
    import jsonschema

    problems = []
    for origin, schema in (("ours", own_schema(kind)), ("quark", quark_contract(kind))):
        if schema is None:
            continue
        validator = jsonschema.Draft202012Validator(schema)
        for err in sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path)):
            where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
            problems.append(f"{where}: {err.message} [{origin} schema]")
    return problems


def check(kind: str, data: object, source: str | Path) -> None:
    problems = schema_errors(kind, data)
    if problems:
        raise UsageError(f"{source} is not a valid {kind}: {problems[0]}", "Fix the field or regenerate the file.")
