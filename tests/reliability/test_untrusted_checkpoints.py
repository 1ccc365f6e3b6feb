"""Untrusted checkpoints on a shared host: links that leave the model, special files, pickles that
try to run code, and an export that carries nothing the source did not.

Refusals go through the command line (exit 2, one ``error:`` line naming the file and where it
points, nothing created outside the work dir). The cases that must run share one real Quark
export of a Hugging Face cache snapshot that also holds a link inside the model directory.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from quark_ptq_eval.base.errors import ExitCode, UnsafeInputError
from quark_ptq_eval.intake.model_files import approved_files
from quark_ptq_eval.intake.pickle_scan import ALLOWED_GLOBALS, scan_pickle
from tests.reliability.test_reliability_guard import LLAMA_CONFIG, make_model, tree_checksums

SECRET = '{"auths": {"registry.example.com": {"auth": "c2VjcmV0"}}}'


class RunsAShell:
    """What a hostile ``pytorch_model.bin`` holds: unpickling it calls os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _secret(tmp: Path) -> Path:
    (tmp / "elsewhere").mkdir(exist_ok=True)
    path = tmp / "elsewhere" / "docker-config.json"
    path.write_text(SECRET)
    return path


def _link_out(model: Path, tmp: Path) -> str:
    (model / "special_tokens_map.json").symlink_to(_secret(tmp))
    return f"special_tokens_map.json points outside the model directory {model} (to {tmp}/elsewhere/docker-config.json)"


def _shard_link_out(model: Path, tmp: Path) -> str:
    """A two-shard model whose second shard is a link to a shard elsewhere on the host."""
    (tmp / "elsewhere").mkdir(exist_ok=True)
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    make_model(tmp / "elsewhere" / "other")
    (model / "model-00002-of-00002.safetensors").symlink_to(tmp / "elsewhere" / "other" / "model.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                  "lm_head.weight": "model-00002-of-00002.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return (f"model-00002-of-00002.safetensors points outside the model directory {model} "
            f"(to {tmp}/elsewhere/other/model.safetensors)")


def _fifo_tokenizer(model: Path, tmp: Path) -> str:
    os.mkfifo(model / "tokenizer.json")
    return "tokenizer.json is a FIFO, not a regular file; refusing to read it"


def _evil_pickle(model: Path, tmp: Path) -> str:
    import torch

    (model / "model.safetensors").unlink()  # a .bin-only checkpoint, as older fine-tunes ship
    torch.save({"model.embed_tokens.weight": torch.zeros(16, 8), "x": RunsAShell(tmp / "PWNED")},
               model / "pytorch_model.bin")
    return "pytorch_model.bin (pytorch_model/data.pkl) is a pickle that calls posix.system"


REFUSED = {
    "a symlink to a credentials file outside the model": _link_out,
    "an index shard whose symlink escapes": _shard_link_out,
    "a FIFO named tokenizer.json": _fifo_tokenizer,
    "a pickle that calls os.system": _evil_pickle,
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_untrusted_checkpoint_is_refused_at_intake_before_anything_runs(cli, corpus, tmp_path, case):
    model = make_model(tmp_path / "model")
    expected = REFUSED[case](model, tmp_path)
    before = tree_checksums(tmp_path)
    out, wd = tmp_path / "out", tmp_path / "work"
    # `run --yes`: were intake to let it through, the engine would start; timeout: a FIFO must not hang it
    res = cli("run", model, "-o", out, "--workdir", wd, "--offline", "--yes", "--scheme", "int8",
              "--calib-data", corpus, "--eval-tier", "skip", timeout=120)
    assert res.rc == ExitCode.USAGE, res.err
    errors = [ln for ln in res.err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], res.err
    assert errors[0].endswith("refusing to follow it.") or errors[0].endswith("refusing to read it.") \
        or "refusing it before anything loads it." in errors[0], errors[0]
    assert "Traceback" not in res.err
    assert not out.exists() and not (tmp_path / "out.partial").exists()
    assert not (wd / "model_analysis.json").exists() and not (wd / "logs" / "engine.log").exists()
    assert not (tmp_path / "PWNED").exists()
    assert {k: v for k, v in tree_checksums(tmp_path).items() if not k.startswith("work/")} == before


def test_the_scan_allows_exactly_what_torch_weights_only_rebuilds_and_passes_a_real_checkpoint(tmp_path):
    import torch
    from torch._weights_only_unpickler import _get_allowed_globals
    from transformers import LlamaConfig, LlamaForCausalLM

    assert set(_get_allowed_globals()) == ALLOWED_GLOBALS
    cfg = LlamaConfig(**{k: v for k, v in LLAMA_CONFIG.items() if k not in ("model_type", "architectures")})
    state = LlamaForCausalLM(cfg).to(torch.bfloat16).state_dict()
    torch.save(state, tmp_path / "pytorch_model.bin")
    torch.save(state, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    scan_pickle(tmp_path / "pytorch_model.bin")
    scan_pickle(tmp_path / "legacy.bin")
    marker = tmp_path / "PWNED"
    torch.save({"w": torch.zeros(2), "x": RunsAShell(marker)}, tmp_path / "legacy-evil.pt",
               _use_new_zipfile_serialization=False)
    (tmp_path / "protocol5.pt").write_bytes(pickle.dumps([RunsAShell(marker)], protocol=5))  # STACK_GLOBAL
    for name in ("legacy-evil.pt", "protocol5.pt"):
        with pytest.raises(UnsafeInputError, match="calls posix.system"):
            scan_pickle(tmp_path / name)
    assert not marker.exists()


def test_hf_snapshot_links_are_approved_and_copied_as_regular_files(tmp_path):
    """No engine: a link Quark (or anything) left in the output is replaced, its target untouched."""
    from quark_ptq_eval.execute.quark_api_engine import copy_non_weight_files

    snapshot = _hub_snapshot(make_model(tmp_path / "src"), tmp_path / "hub")
    (snapshot / "tokenizer.json").symlink_to("../../blobs/tok")
    (snapshot.parents[1] / "blobs" / "tok").write_text('{"version": "1.0"}')
    victim = _secret(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").symlink_to(victim)
    assert set(approved_files(snapshot)) == {"config.json", "model.safetensors", "tokenizer.json"}
    copy_non_weight_files(snapshot, out)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json"]  # weights and config are the engine's
    assert not (out / "tokenizer.json").is_symlink() and (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert victim.read_text() == SECRET


def _hub_snapshot(model: Path, hub: Path) -> Path:
    """``model`` laid out as the Hub client caches it: every file a link into ``../../blobs``."""
    repo = hub / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(model.iterdir()):
        shutil.copy(f, blobs / f"sha-{f.name}")
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"sha-{f.name}")
    return snapshot


@pytest.mark.slow
def test_hf_snapshot_with_a_link_inside_the_model_quantizes_into_regular_files(tiny_llama, corpus, catalog,
                                                                                tmp_path):
    from quark_ptq_eval.execute import quark_api_engine
    from quark_ptq_eval.execute.file_modes import apply_umask
    from quark_ptq_eval.execute.inspect_output import inspect_output
    from quark_ptq_eval.intake import analyze_model
    from quark_ptq_eval.validate.auxfiles import check_aux

    snapshot = _hub_snapshot(tiny_llama, tmp_path / "hub")
    (snapshot / "LICENSE").write_text("MIT License\n")
    (snapshot / "LICENSE.txt").symlink_to("LICENSE")  # a link that stays inside the model dir
    analysis = analyze_model(str(snapshot), offline=True, catalog=catalog)
    assert analysis.analysis_status == "complete"
    out = tmp_path / "out"
    assert quark_api_engine.main(["--model_dir", str(snapshot), "--output_dir", str(out), "--quant_scheme", "int8",
                                  "--calib_data", str(corpus), "--num_calib_data", "4", "--seq_len", "64"]) == 0
    apply_umask(out)  # as the execute step does after the engine
    facts = inspect_output(out)
    assert facts["ok"], facts["problems"]
    entries = list(out.rglob("*"))
    assert entries and all(p.is_file() and not p.is_symlink() for p in entries), entries
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):  # README.md: the cards
        assert (out / name).read_bytes() == (tiny_llama / name).read_bytes(), name
    assert (out / "LICENSE.txt").read_text() == "MIT License\n"
    aux = check_aux(snapshot, out)
    assert aux.status == "pass", [f.message for f in aux.findings]
    (out / "notes.json").symlink_to(tmp_path / "hub")  # a link in an export is a problem, never a pass
    assert any("notes.json is a symlink" in p for p in inspect_output(out)["problems"])
