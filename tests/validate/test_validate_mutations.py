"""Mutation campaign: random single faults planted into real Quark exports are each flagged; the
unmutated exports never are. Seeded (hypothesis, derandomized), so every run draws the same
mutations. CI runs ``QPE_MUTATIONS`` of them (default 48); a larger campaign is the same test
with a larger number (``QPE_MUTATIONS=400 pytest tests/test_validate_mutations.py``). Size,
catch rate and the split by kind are printed by the test that follows the campaign.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from quark_ptq_eval.base.safetensors_io import INDEX_NAME
from quark_ptq_eval.validate import validate_model
from tests.fixtures.decode_faults import FAULTS, PLANTERS, applicable
from tests.validate.test_validate import read_tensors, shard, write_tensors

EXPORTS = ("int8", "int4_wo_128", "mxfp4")
WEIGHT_FAULTS = tuple(f"weight:{fault}" for fault in FAULTS)  # decoded weights off their source (decode check)
KINDS = ("byte", "shape", "dtype", "config", "tokenizer", "index", *WEIGHT_FAULTS)
SAME_WIDTH = {"F32": "I32", "I32": "F32", "F16": "BF16", "BF16": "F16", "I8": "U8", "U8": "I8",
              "F8_E4M3": "I8", "F8_E8M0": "U8", "I64": "F64", "F64": "I64"}
CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
               "vocab_size", "max_position_embeddings", "hidden_act", "bos_token_id", "eos_token_id",
               "tie_word_embeddings", "attention_bias", "head_dim", "num_hidden_layers")
QCONFIG_FIELDS = (("dtype", "uint8"), ("qscheme", "per_group"), ("group_size", 64), ("symmetric", None))
TOKENIZER_EDITS = ("model_max_length", "add_bos_token", "eos_token", "chat_template", "normalizer", "vocab", "merges",
                   "post_processor")


@dataclass
class Campaign:
    root: Path
    source: Path
    exports: dict[str, Path]
    plans: dict[str, dict]
    outcomes: Counter

    def validate(self, name: str):
        return validate_model(self.source, self.exports[name], self.plans[name])


def _plan(scheme: str) -> dict:
    return {"global_scheme": scheme, "exclude_layers": ["lm_head"], "layer_quant_config": {}, "kv_cache_scheme": None,
            "algorithm": None}


@pytest.fixture(scope="module")
def campaign(tiny_llama, quantized, tmp_path_factory):
    root = tmp_path_factory.mktemp("campaign")
    exports = {s: Path(shutil.copytree(quantized(s), root / s)) for s in EXPORTS}
    exports["int8-sharded"] = Path(shutil.copytree(quantized("int8"), root / "int8-sharded"))
    shard(exports["int8-sharded"])
    plans = {name: _plan(name.split("-")[0]) for name in exports}
    return Campaign(root, tiny_llama, exports, plans, Counter())


def test_unmutated_exports_are_never_flagged(campaign):
    for name in campaign.exports:
        report = campaign.validate(name)
        assert report.status == "success", report.to_markdown()


@st.composite
def mutations(draw):
    kind = draw(st.sampled_from(KINDS))
    export = "int8-sharded" if kind == "index" else draw(st.sampled_from(EXPORTS))
    if kind in WEIGHT_FAULTS:  # a format that can carry it: MX exponents only in mxfp4, nibbles in 4-bit codes
        export = next(e for e in (export, *EXPORTS) if FAULT_FORMATS[kind.split(":")[1]] & {e, "*"})
    return kind, export, draw(st.integers(0, 2**31 - 1)), draw(st.integers(0, 2**31 - 1))


@seed(20261130)
@settings(max_examples=int(os.environ.get("QPE_MUTATIONS", "48")), derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(mutation=mutations())
def test_mutation_campaign(campaign, mutation):
    kind, export, a, b = mutation
    out = campaign.exports[export]
    backup = campaign.root / "backup"
    shutil.rmtree(backup, ignore_errors=True)
    shutil.copytree(out, backup)
    try:
        what = MUTATORS[kind](out, a, b)
        report = campaign.validate(export)
    finally:
        shutil.rmtree(out)
        shutil.copytree(backup, out)
    campaign.outcomes.update(["total", f"total:{kind}"])
    if report.status == "failed":
        campaign.outcomes.update(["caught", f"caught:{kind}"])
    assert report.status == "failed", f"{kind} mutation not flagged on {export}: {what}\n{report.to_markdown()}"


# --- the mutators: each plants one fault and says what it did ------------------------------------------

def _single_file_tensors(out: Path):
    tensors = read_tensors(out)
    return tensors, sorted(tensors)


def _unquantized(out: Path, tensors: dict) -> list[str]:
    """Tensors carried over from the source: norms, embeddings, the excluded lm_head."""
    return sorted(n for n in tensors if not n.rpartition(".")[2].startswith(("weight_", "input_", "output_"))
                  and tensors[n][0] in ("F32", "F16", "BF16") and not _is_quantized_weight(n, tensors))


def _is_quantized_weight(name: str, tensors: dict) -> bool:
    module = name.rpartition(".")[0]
    return name.endswith(".weight") and f"{module}.weight_scale" in tensors


def mutate_byte(out: Path, a: int, b: int) -> str:
    tensors, _ = _single_file_tensors(out)
    name = (names := _unquantized(out, tensors))[a % len(names)]
    dtype, shape, data = tensors[name]
    pos = b % len(data)
    tensors[name] = (dtype, shape, data[:pos] + bytes([data[pos] ^ (1 << (a % 8))]) + data[pos + 1:])
    write_tensors(out / "model.safetensors", tensors)
    return f"flipped bit {a % 8} of byte {pos} in {name}"


def mutate_shape(out: Path, a: int, b: int) -> str:
    tensors, names = _single_file_tensors(out)
    name = names[a % len(names)]
    dtype, shape, data = tensors[name]
    if len(shape) >= 2 and len(set(shape)) > 1:
        new = list(reversed(shape))
    elif len(shape) >= 2:
        new = [shape[0] * shape[1], *shape[2:]]
    else:
        new = [1, *shape]
    tensors[name] = (dtype, new, data)
    write_tensors(out / "model.safetensors", tensors)
    return f"{name} shape {shape} -> {new}"


def mutate_dtype(out: Path, a: int, b: int) -> str:
    tensors, names = _single_file_tensors(out)
    names = [n for n in names if tensors[n][0] in SAME_WIDTH]
    name = names[a % len(names)]
    dtype, shape, data = tensors[name]
    tensors[name] = (SAME_WIDTH[dtype], shape, data)
    write_tensors(out / "model.safetensors", tensors)
    return f"{name} dtype {dtype} -> {SAME_WIDTH[dtype]}"


def mutate_config(out: Path, a: int, b: int) -> str:
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    if a % 4 == 0:  # the quantization_config itself, against the plan
        key, value = QCONFIG_FIELDS[b % len(QCONFIG_FIELDS)]
        spec = cfg["quantization_config"]["global_quant_config"]["weight"]
        spec = spec[0] if isinstance(spec, list) else spec
        spec[key] = (not spec[key]) if value is None else (value if spec.get(key) != value else "int4")
        path.write_text(json.dumps(cfg, indent=2))
        return f"quantization_config weight {key} -> {spec[key]}"
    keys = [k for k in CONFIG_KEYS if k in cfg]
    key = keys[b % len(keys)]
    old = cfg[key]
    cfg[key] = (not old if isinstance(old, bool) else old + 1 if isinstance(old, int) else old * 2
                if isinstance(old, float) else f"{old}_x" if isinstance(old, str) else 1)
    path.write_text(json.dumps(cfg, indent=2))
    return f"config {key} {old!r} -> {cfg[key]!r}"


def mutate_tokenizer(out: Path, a: int, b: int) -> str:
    edit = TOKENIZER_EDITS[a % len(TOKENIZER_EDITS)]
    if edit in ("model_max_length", "add_bos_token", "eos_token", "chat_template"):
        path = out / "tokenizer_config.json"
        data = json.loads(path.read_text())
        data[edit] = {"model_max_length": 7 + b % 100, "add_bos_token": not data.get("add_bos_token", False),
                      "eos_token": "<|pad|>", "chat_template": "{{ messages[0]['content'] }}!"}[edit]
    else:
        path = out / "tokenizer.json"
        data = json.loads(path.read_text())
        vocab = data["model"]["vocab"]
        if edit == "vocab":
            x, y = sorted(vocab)[b % len(vocab)], sorted(vocab)[(b + 1) % len(vocab)]
            vocab[x], vocab[y] = vocab[y], vocab[x]
        elif edit == "merges":
            data["model"]["merges"].pop(b % len(data["model"]["merges"]))
        elif edit == "normalizer":
            data["normalizer"] = {"type": "Lowercase"}
        else:
            bos = data["added_tokens"][0]  # a BOS template where there was none: every encoding changes
            data["post_processor"] = {
                "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos["content"], "type_id": 0}},
                                                         {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos["content"]: {"id": bos["content"], "ids": [bos["id"]],
                                                    "tokens": [bos["content"]]}}}
    path.write_text(json.dumps(data))
    return f"tokenizer {edit} in {path.name}"


def mutate_index(out: Path, a: int, b: int) -> str:
    path = out / INDEX_NAME
    index = json.loads(path.read_text())
    weight_map = index["weight_map"]
    names, shards = sorted(weight_map), sorted(set(weight_map.values()))
    name = names[b % len(names)]
    if a % 3 == 0:
        del weight_map[name]
        what = f"dropped {name}"
    elif a % 3 == 1:
        weight_map[name] = next(s for s in shards if s != weight_map[name])
        what = f"moved {name} to {weight_map[name]}"
    else:
        weight_map[f"{name}_ghost"] = weight_map[name]
        what = f"added {name}_ghost"
    path.write_text(json.dumps(index))
    return what


FAULT_FORMATS = {"negate_row": {"*"}, "zero_rows": {"*"}, "scale_25": {"int8", "int4_wo_128"},
                 "zero_point_step": {"int8", "int4_wo_128"}, "swap_nibbles": {"int4_wo_128", "mxfp4"},
                 "mx_exponent": {"mxfp4"}}


def _weight_fault(fault: str):
    def mutate(out: Path, a: int, b: int) -> str:
        tensors = read_tensors(out)
        modules = sorted(n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale"))
        module = next(m for m in modules[a % len(modules):] + modules if fault in applicable(tensors, m))
        what = PLANTERS[fault](tensors, module)
        write_tensors(out / "model.safetensors", tensors)
        return what
    return mutate


MUTATORS = {"byte": mutate_byte, "shape": mutate_shape, "dtype": mutate_dtype, "config": mutate_config,
            "tokenizer": mutate_tokenizer, "index": mutate_index,
            **{kind: _weight_fault(kind.split(":")[1]) for kind in WEIGHT_FAULTS}}


def test_campaign_size_and_catch_rate_are_printed(campaign, capsys):
    """Runs after the campaign (same module, file order): prints its figures, even under -q."""
    total, caught = campaign.outcomes["total"], campaign.outcomes["caught"]
    by_kind = ", ".join(f"{k} {campaign.outcomes['caught:' + k]}/{campaign.outcomes['total:' + k]}" for k in KINDS)
    with capsys.disabled():
        print(f"\nmutation campaign: {total} mutations over {len(campaign.exports)} real exports, caught {caught} "
              f"({caught / max(total, 1):.1%}); by kind: {by_kind}")
    assert total > 0 and caught == total
