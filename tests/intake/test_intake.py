"""Phase 1 step 1: intake reads config.json and safetensors headers only."""

import builtins
import json
import shutil
from pathlib import Path

import pytest

from quark_ptq_eval.base import contracts, safetensors_io
from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.intake import analyze_model


class HeaderOnlyFile:
    """A file whose payload bytes are unreadable: any read past the header raises."""

    def __init__(self, fh):
        self._fh = fh
        self._limit = None

    def read(self, n=-1):
        pos = self._fh.tell()
        if self._limit is not None and (n < 0 or pos + n > self._limit):
            raise OSError(5, "payload is unreadable")
        data = self._fh.read(n)
        if pos == 0 and n == 8:
            self._limit = 8 + int.from_bytes(data, "little")
        return data

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


def test_intake_never_reads_tensor_payloads(tiny_llama, catalog, monkeypatch):
    real_open = builtins.open

    def guarded_open(path, mode="r", *a, **k):
        fh = real_open(path, mode, *a, **k)
        return HeaderOnlyFile(fh) if str(path).endswith(".safetensors") else fh

    monkeypatch.setattr(safetensors_io, "open", guarded_open, raising=False)
    analysis = analyze_model(str(tiny_llama), offline=True, catalog=catalog)
    # the guard really guards: reading a payload through it fails
    with pytest.raises(OSError), guarded_open(tiny_llama / "model.safetensors", "rb") as fh:
        fh.read(8)
        fh.read(10**9)
    t = analysis.quantization_targets
    assert analysis.analysis_status == "complete"
    assert (t["linear_layer_count"], t["linear_count_method"]) == (15, "safetensors_header")  # 2x7 + lm_head
    assert analysis.template == {**analysis.template, "available": True, "exclude_layers": ["lm_head"]}
    assert t["excluded_by_default"] == ["lm_head"]
    assert analysis.size["bytes"] > 1_000_000
    assert contracts.schema_errors("model_analysis", analysis.to_dict()) == []


def test_intake_reads_sharded_models_through_the_index(tiny_llama, catalog, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "sharded"
    shutil.copytree(tiny_llama, model)
    tensors = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), 1):
        fname = f"model-0000{i}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, model / fname)
        weight_map.update({n: fname for n in part})
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    analysis = analyze_model(str(model), offline=True, catalog=catalog)
    assert analysis.quantization_targets["linear_layer_count"] == 15


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: d, "does not exist"),
        (lambda d: (d.mkdir(), d)[1], "is empty"),
        (lambda d: (d.mkdir(), (d / "x.txt").write_text("x"), d)[2], "has no config.json"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("{nope"), d)[2], "is not valid JSON"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("[1, 2]"), d)[2], "not a JSON object"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text('{"model_type": 3}'), d)[2], "has no model_type"),
    ],
)
def test_bad_model_directories_get_one_clear_sentence(tmp_path, catalog, setup, message):
    path = setup(tmp_path / "model")
    with pytest.raises(UsageError, match=message):
        analyze_model(str(path), offline=True, catalog=catalog)


def test_hub_id_offline_is_refused_clearly(catalog):
    with pytest.raises(UsageError, match="offline mode is on"):
        analyze_model("meta-llama/Llama-3.1-8B", offline=True, catalog=catalog)


def test_unknown_model_type_and_custom_code_are_risks(tiny_llama, tmp_path, catalog):
    model = tmp_path / "custom"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(model_type="my_new_arch", auto_map={"AutoModelForCausalLM": "modeling_x.MyModel"})
    (model / "config.json").write_text(json.dumps(cfg))
    analysis = analyze_model(str(model), offline=True, catalog=catalog)
    assert analysis.analysis_status == "partial"
    assert analysis.model["trust_remote_code"] is False
    messages = " ".join(r["message"] for r in analysis.risks)
    assert "no LLM template" in messages and "custom code" in messages
    assert all(r["severity"] == "high" for r in analysis.risks)


def test_intake_without_weights_estimates_from_config(tmp_path, catalog):
    model = tmp_path / "config-only"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
                                                   "intermediate_size": 14336, "vocab_size": 128256}))
    analysis = analyze_model(str(model), offline=True, catalog=catalog)
    assert analysis.quantization_targets["linear_count_method"] == "config_formula"
    assert analysis.quantization_targets["linear_layer_count"] == 32 * 7 + 1
    assert 14e9 < analysis.size["bytes"] < 18e9  # ~8B params in bf16
    assert Path(analysis.model["model_path"]).is_absolute()


def test_a_hugging_face_cache_snapshot_is_read_through_its_blob_links(tiny_llama, catalog, tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in tiny_llama.iterdir():
        blob = blobs / f"sha-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    analysis = analyze_model(str(snapshot), offline=True, catalog=catalog)
    assert analysis.quantization_targets["linear_layer_count"] == 15
    # a link to anywhere else is still refused
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(tiny_llama / "model.safetensors")
    with pytest.raises(UsageError, match="points outside the model directory"):
        analyze_model(str(snapshot), offline=True, catalog=catalog)
