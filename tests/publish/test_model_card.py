"""The export's model card (publish/): on a real run it parses back with huggingface_hub, its results are
eval_results.json's figures, it names every exclusion, the KV-cache scheme and the serving check's line,
and it carries the base model's licence and tags without copying or touching the base's own card.

``assert_card_matches`` is also run on the cards of other real runs (test_pipeline, test_plan_goals,
test_compare), so each run pays for its recipe once."""

from __future__ import annotations

import hashlib
import json
import shlex
from contextlib import nullcontext
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.publish import write_card
from quark_ptq_eval.publish.metadata import BASE_SUFFIX
from quark_ptq_eval.runtime.vllm_host import free_port
from tests.evaluate.vllm.test_tier3_real_vllm import (
    assert_scored,
    assert_tier3_served_both_sized_and_measured,
    control_with_vllms_default,
    other_jobs_holding_memory,
    our_servers,
    port_free,
    tier3_args,
)
from tests.fixtures.exports import assert_reloadable_export
from tests.fixtures.speed_checks import SPEED_ARGS

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
HAS_VLLM = (ROOT / ".venv-vllm" / ".installed").is_file()
BASE_README = """---
license: apache-2.0
language: en
tags:
- docstrings
- tiny
model-index:
- name: base-with-card
  results:
  - task: {type: text-generation}
    dataset: {name: made-up, type: made-up}
    metrics: [{type: accuracy, value: 0.99}]
---

# The base model's own card

Its text describes the base model.
"""


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def figures(ev: dict) -> set[tuple]:
    """(task, metric, value, is the base model's) for every figure of eval_results.json."""
    ours = {(t, m, v, False) for t, ms in ev["quantized"].items() for m, v in ms.items() if _number(v)}
    base = {(t, m, v, True) for t, ms in (ev.get("baseline") or {}).items() for m, v in ms.items()
            if _number(v) and (t, m, ev["quantized"].get(t, {}).get(m), False) in ours}
    return ours | base


def serving_flags(argv: list[str]) -> list[str]:
    """The serving check's flags after its model, less those of its one local start."""
    rest, flags = argv[argv.index("--model") + 2:], []
    while rest:
        arg = rest.pop(0)
        if arg in ("--port", "--host", "--served-model-name"):
            rest.pop(0)
        else:
            flags.append(arg)
    return flags


def assert_card_matches(out: Path, wd: Path) -> ModelCard:
    """The card in ``out`` states what the artifacts in ``wd`` hold."""
    card = ModelCard.load(out / "README.md")
    data, text = card.data, card.text
    plan = json.loads((wd / "quant_plan.json").read_text())
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert {"quark", plan["global_scheme"]} <= set(data.tags) and data.license
    ev_file = wd / "eval_results.json"
    ev = json.loads(ev_file.read_text()) if ev_file.is_file() else None
    if ev and Path(ev["model"]).resolve() == out.resolve() and ev.get("quantized"):
        got = {(r.task_name, r.metric_type, r.metric_value, r.metric_name.endswith(BASE_SUFFIX))
               for r in data.eval_results}
        assert got == figures(ev) and len(got) == len(data.eval_results)
        assert f"verdict **{ev['verdict']}**" in text
    else:
        assert data.eval_results is None and "Not evaluated" in text and "model-index" not in str(card)
    for pattern in plan["exclude_layers"]:
        assert f"`{pattern}`" in text.split("## Quantization")[1].split("## Validation")[0], pattern
    for pattern, scheme in plan["layer_quant_config"].items():
        assert f"`{pattern}` → `{scheme}`" in text
    if plan["kv_cache_scheme"]:
        assert f"kv-cache-{plan['kv_cache_scheme']}" in data.tags and f"| KV cache | `{plan['kv_cache_scheme']}` |" in text
    manifest = (wd / "run_manifest.yaml").read_text()
    import yaml

    assert yaml.safe_load(manifest)["command"]["shell"] in text
    serve = json.loads((wd / "validation_report.json").read_text())["checks"]["serve"]
    if serve["stats"].get("argv"):
        line = shlex.join(["vllm", "serve", data.model_name, *serving_flags(serve["stats"]["argv"])])
        assert f"```bash\n{line}\n```" in text
    else:
        assert f"Not served by this run's serving check ({serve['skipped_reason']})" in text
    return card


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def _eval_args(corpus: Path, port: int) -> list:
    """With the project's vLLM: Tier 3 with the baseline and --speed (the serving check and Tier 3 each start the
    export's server; Tier 3 starts the baseline's; the benchmark runs on Tier 3's own servers); without it, Tier 1
    with the baseline (the card's Tier 1 figures are also checked on test_plan_goals' --baseline run)."""
    if HAS_VLLM:
        return ["--eval-tier", "vllm", "--baseline", *tier3_args(port, "--vllm-arg=--max-num-seqs=16"), "--speed",
                *SPEED_ARGS]
    return ["--eval-tier", "ppl", "--eval-data", corpus, "--seq-len", "64", "--max-windows", "16", "--baseline"]


@pytest.mark.slow
def test_a_run_carries_the_base_card_serve_checks_and_scores_tier3_and_its_card_states_it(
        cli, copy_model, tiny_llama, corpus, tmp_path):
    """One real `run` of a base model with its own card, to Tier 3 with the project's vLLM: validation's
    serving check starts vLLM on the export (served), then Tier 3 serves it and its source, scores both and
    measures their serving speed on those servers, while other jobs hold memory (test_tier3_real_vllm's checks);
    the card states what the run's artifacts hold. The export is int8 with `*up_proj*` at int4_wo_128, widened
    to gate/up (the group vLLM fuses, issue 41, tests/plan/test_plan_groups.py): the widened mix is what vLLM
    serves here."""
    source = copy_model(tiny_llama, "base-with-card")
    (source / "README.md").write_text(BASE_README)
    before = _digests(source)
    wd, out, port = tmp_path / "work", tmp_path / "base-with-card-int8", free_port()
    with other_jobs_holding_memory() if HAS_VLLM else nullcontext() as figures:
        res = cli("run", source, "-o", out, "--workdir", wd, "--scheme", "int8", "--layer-quant-scheme", "*up_proj*",
                  "int4_wo_128", "--widen-groups", "--calib-data", corpus, "--num-calib-samples", "8",
                  "--calib-seq-len", "64", "--offline", "--yes", *_eval_args(corpus, port))
        control = (control_with_vllms_default(cli, out, port, tmp_path / "default")
                   if HAS_VLLM and figures is not None and res.rc == 0 else None)
    assert res.rc == 0, res.err[-3000:]
    assert res.err.strip().splitlines()[-1] == f"To publish it on the Hugging Face Hub (not run): hf upload {out.name} {out} ."
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]["layer_quant_config"]
    assert {"model.layers.*.mlp.gate_proj", "*up_proj*"} <= set(qconfig)  # gate/up at int4, the rest int8
    validation = json.loads((wd / "validation_report.json").read_text())
    assert validation["status"] == "success", validation["evidence"]
    assert_reloadable_export(validation["status"], out, wd)  # test_pipeline's run_yes for llama int8
    if HAS_VLLM:
        _assert_served_and_scored(wd, out, port)
        assert_tier3_served_both_sized_and_measured(res, wd, port, figures, control, out, source)
    card = assert_card_matches(out, wd)
    # the base card's licence, language and tags carried over; its results and text not copied
    assert (card.data.license, card.data.language) == ("apache-2.0", "en") and {"docstrings", "tiny"} <= set(card.data.tags)
    assert "made-up" not in str(card) and "Its text describes the base model" not in card.text
    assert f"the base model's own card: {source / 'README.md'}" in card.text
    assert _digests(source) == before  # the source's files never touched
    assert validation["checks"]["aux"]["status"] == "pass" and "README.md" not in json.dumps(validation["checks"]["aux"])
    # deterministic from the same artifacts; `card` names the Hub id given; a README.md not ours is left alone
    first = (out / "README.md").read_bytes()
    write_card(wd, out)
    assert (out / "README.md").read_bytes() == first
    write_card(wd, out, base_model="acme/tiny-llama")
    meta = ModelCard.load(out / "README.md").data
    assert (meta.base_model, meta.base_model_relation) == ("acme/tiny-llama", "quantized")
    (out / "README.md").write_text("my own notes\n")
    with pytest.raises(UsageError, match="is not a card quark-ptq-eval wrote"):
        write_card(wd, out)
    assert (out / "README.md").read_text() == "my own notes\n"


def _assert_served_and_scored(wd: Path, out: Path, port: int) -> None:
    serve = json.loads((wd / "validation_report.json").read_text())["checks"]["serve"]
    assert serve["status"] == "pass" and serve["stats"]["served"] is True, serve
    assert serve["stats"]["argv"][0] == str(VLLM_PYTHON.absolute())
    results = json.loads((wd / "eval_results.json").read_text())
    assert_scored(results)
    assert results["details"]["stderr"]["quantized"]["qpe_docstring_mc"]["acc"] > 0
    assert not our_servers(out, f"--port {port}") and port_free(port)  # nothing left behind
