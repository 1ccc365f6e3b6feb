"""Hostile and malformed inputs, refused in-process with one clear sentence (fast: no engine).

Safetensors headers and model directories (``safetensors_io``), config.json (``intake``),
destructive output targets (``safety``) and hostile path names in the manifest's command.
Every case asserts the exact error class and message, and that nothing was created or changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import tracemalloc
from pathlib import Path

import pytest
import yaml

from quark_ptq_eval.base.errors import ExitCode, UnsafeInputError, UsageError
from quark_ptq_eval.base.safetensors_io import read_header, read_model_headers
from quark_ptq_eval.base.safety import check_output_target
from tests.reliability.test_reliability_guard import (
    LLAMA_CONFIG,
    LLAMA_TENSORS,
    make_model,
    st_bytes,
    st_header,
    tree_checksums,
    write_st,
)


@contextlib.contextmanager
def no_hang(seconds: int = 10):
    """Fail (instead of hanging the suite) when the code under test blocks."""

    def on_alarm(signum, frame):  # noqa: ARG001
        raise TimeoutError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def one_sentence(message: str) -> None:
    assert "\n" not in message and "Traceback" not in message and message.endswith("."), message


# --------------------------------------------------------------------------------------------
# Safetensors files
# --------------------------------------------------------------------------------------------

VALID_HEADER, VALID_DATA = st_header([("a", "F32", [2]), ("b", "F16", [2, 2])])


def _with(**entry) -> dict:
    return {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **entry}}


def _fifo(path: Path) -> None:
    os.mkfifo(path)


HOSTILE_FILES = {
    # id: (content as bytes, or a callable creating the path), expected message fragment
    "zero-length file": (b"", "is only 0 bytes long"),
    "shorter than the length field": (b"\x05\x00", "is only 2 bytes long"),
    "header length larger than the file": (st_bytes(VALID_HEADER, VALID_DATA, length=10_000),
                                           "its header claims 10000 bytes but the file holds"),
    "header length 2^63": (st_bytes(VALID_HEADER, VALID_DATA, length=2**63),
                           f"its header claims {2**63} bytes"),
    "header length 2^64-1": (st_bytes(VALID_HEADER, VALID_DATA, length=2**64 - 1),
                             f"its header claims {2**64 - 1} bytes"),
    "header length 101 MiB on a big file": (lambda p: _sparse(p, 101 * 2**20), f"claims {101 * 2**20} bytes"),
    "non-JSON header": (st_bytes(b"this is not json {"), "its header is not valid JSON"),
    "non-UTF-8 header": (st_bytes(b'{"\xff\xfe": 1}'), "its header is not valid JSON"),
    "header is a JSON array": (st_bytes(b"[1, 2]"), "its header is not a JSON object"),
    "deeply nested header": (st_bytes(b"[" * 200_000 + b"]" * 200_000), "nested deeper than any safetensors header"),
    "nesting hidden in __metadata__": (st_bytes({"__metadata__": {"a": json.loads("[" * 10 + "]" * 10)}}),
                                       "nested deeper"),
    "__metadata__ not an object": (st_bytes({"__metadata__": ["x"]}), "__metadata__ is not an object"),
    "tensor entry not an object": (st_bytes({"t": 5}), "the entry for tensor 't' is not an object"),
    "unknown dtype": (st_bytes(_with(dtype="F128"), 8), "uses an unknown dtype 'F128' for tensor 't'"),
    "missing dtype": (st_bytes({"t": {"shape": [2], "data_offsets": [0, 8]}}, 8), "unknown dtype None"),
    "negative shape": (st_bytes(_with(shape=[-2]), 8), "tensor 't' has an invalid shape [-2]"),
    "boolean shape": (st_bytes(_with(shape=[True, 2]), 8), "has an invalid shape [True, 2]"),
    "negative offset": (st_bytes(_with(data_offsets=[-8, 0]), 8), "has invalid data_offsets [-8, 0]"),
    "float offsets": (st_bytes(_with(data_offsets=[0.0, 8.0]), 8), "has invalid data_offsets [0.0, 8.0]"),
    "three offsets": (st_bytes(_with(data_offsets=[0, 4, 8]), 8), "has invalid data_offsets [0, 4, 8]"),
    "reversed offsets": (st_bytes(_with(data_offsets=[8, 0]), 8), "spans -8 bytes but its shape and dtype need 8"),
    "offsets disagree with shape": (st_bytes(_with(data_offsets=[0, 4]), 8), "spans 4 bytes but its shape and dtype need 8"),
    "overlapping offsets": (st_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12),
                            "overlaps another tensor's bytes"),
    "out-of-range offsets": (st_bytes(_with(data_offsets=[1_000_000, 1_000_008]), 8),
                             "its tensors need 1000008 bytes of data but only 8 are present"),
    "claims 4 TiB of data": (st_bytes({"t": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}, 64),
                             f"its tensors need {2**42} bytes of data but only 64 are present"),
    "claims 2^64-element tensor": (st_bytes({"t": {"dtype": "U8", "shape": [2**32, 2**32], "data_offsets": [0, 2**64]}}, 8),
                                   f"need {2**64} bytes of data but only 8 are present"),
    "a directory named *.safetensors": (lambda p: p.mkdir(), "cannot be read: Is a directory."),
    "a FIFO named *.safetensors": (_fifo, "is not a regular file"),
    "missing file": (lambda p: None, "cannot be read: No such file or directory."),
}


def _sparse(path: Path, claimed: int) -> None:
    with open(path, "wb") as fh:
        fh.write(claimed.to_bytes(8, "little") + b"{}")
        fh.truncate(claimed + 64)  # a sparse file big enough to hold the claim


@pytest.mark.parametrize("case", list(HOSTILE_FILES))
def test_hostile_safetensors_file_is_refused_in_one_sentence(tmp_path, case):
    content, expected = HOSTILE_FILES[case]
    path = tmp_path / "model.safetensors"
    if callable(content):
        content(path)
    else:
        path.write_bytes(content)
    tracemalloc.start()
    try:
        with no_hang(), pytest.raises(UnsafeInputError) as err:
            read_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert expected in err.value.message, err.value.message
    assert str(path) in err.value.message
    one_sentence(err.value.message)
    assert err.value.exit_code == ExitCode.USAGE
    assert peak < 8 * 2**20, f"allocated {peak} bytes for a refused file"  # never the claimed size


def test_a_valid_header_is_parsed_exactly(tmp_path):
    path = tmp_path / "ok.safetensors"
    path.write_bytes(st_bytes({**VALID_HEADER, "__metadata__": {"format": "pt"}}, VALID_DATA))
    h = read_header(path)
    assert sorted(h.tensors) == ["a", "b"] and h.metadata == {"format": "pt"}
    assert h.tensors["b"].nbytes == 8 and h.tensors["b"].end == path.stat().st_size


# --------------------------------------------------------------------------------------------
# Model directories: symlinks and index files
# --------------------------------------------------------------------------------------------


def _outside_shard(tmp_path: Path) -> Path:
    (tmp_path / "elsewhere").mkdir(exist_ok=True)
    return write_st(tmp_path / "elsewhere" / "secret.safetensors")


def _index(model: Path, weight_map) -> None:
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


MODEL_DIRS = {
    "shard symlink pointing outside": (
        lambda m, t: (m / "model.safetensors").symlink_to(_outside_shard(t)),
        "points outside the model directory"),
    "shard symlink loop": (
        lambda m, t: ((m / "a.safetensors").symlink_to(m / "b.safetensors"),
                      (m / "b.safetensors").symlink_to(m / "a.safetensors")),
        "cannot be resolved"),
    "dangling shard symlink": (
        lambda m, t: (m / "model.safetensors").symlink_to(t / "gone.safetensors"), "does not exist"),
    "symlinked sub-directory pointing outside": (
        lambda m, t: (_outside_shard(t), (m / "shards").symlink_to(t / "elsewhere"),
                      write_st(m / "model.safetensors"),
                      _index(m, {"lm_head.weight": "shards/secret.safetensors"})),
        "points outside the model directory"),
    "index weight_map with ../": (
        lambda m, t: (_outside_shard(t), write_st(m / "model.safetensors"),
                      _index(m, {"lm_head.weight": "../elsewhere/secret.safetensors"})),
        "names shard '../elsewhere/secret.safetensors' outside the model directory"),
    "index weight_map with an absolute path": (
        lambda m, t: (write_st(m / "model.safetensors"),
                      _index(m, {"lm_head.weight": str(_outside_shard(t))})),
        "outside the model directory; refusing to follow it"),
    "index weight_map naming /dev/zero": (
        lambda m, t: _index(m, {"lm_head.weight": "/dev/zero"}), "names shard '/dev/zero' outside"),
    "index is not JSON": (
        lambda m, t: (m / "model.safetensors.index.json").write_text("{not json"), "is not a valid safetensors index"),
    "index is a JSON array": (
        lambda m, t: (m / "model.safetensors.index.json").write_text("[]"), "is not a valid safetensors index"),
    "index weight_map is a list": (lambda m, t: _index(m, ["model.safetensors"]), "has no valid weight_map"),
    "index weight_map values not strings": (lambda m, t: _index(m, {"a": 1}), "has no valid weight_map"),
    "index names a missing shard": (
        lambda m, t: _index(m, {"a": "model-00001-of-00002.safetensors"}), "does not exist"),
    "the same tensor in two shards": (
        lambda m, t: (write_st(m / "model-1.safetensors"), write_st(m / "model-2.safetensors")),
        "appears in both"),
}


@pytest.mark.parametrize("case", list(MODEL_DIRS))
def test_hostile_model_directory_is_refused(tmp_path, case):
    plant, expected = MODEL_DIRS[case]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    plant(model, tmp_path)
    outside_before = tree_checksums(tmp_path / "elsewhere") if (tmp_path / "elsewhere").exists() else None
    with no_hang(), pytest.raises(UnsafeInputError) as err:
        read_model_headers(model)
    assert expected in err.value.message, err.value.message
    one_sentence(err.value.message)
    if outside_before is not None:
        assert tree_checksums(tmp_path / "elsewhere") == outside_before


def test_symlinks_that_stay_inside_the_model_directory_are_followed(tmp_path):
    model = make_model(tmp_path / "model")
    (model / "blobs").mkdir()
    (model / "model.safetensors").rename(model / "blobs" / "abc123")
    (model / "model.safetensors").symlink_to("blobs/abc123")  # relative, like a Hub cache snapshot
    assert len(read_model_headers(model)) == len(LLAMA_TENSORS)


# --------------------------------------------------------------------------------------------
# config.json, through intake (which reads config and headers only)
# --------------------------------------------------------------------------------------------


def _config(text: str | bytes):
    def plant(model: Path) -> None:
        (model / "config.json").write_bytes(text.encode() if isinstance(text, str) else text)
    return plant


def _config_json(**changes):
    return _config(json.dumps({**LLAMA_CONFIG, **changes}))


def _config_link(target: str):
    def plant(model: Path) -> None:
        (model / "config.json").unlink()
        (model / "config.json").symlink_to(target)
    return plant


CONFIGS = {
    "missing": (lambda m: (m / "config.json").unlink(), UsageError, "has no config.json"),
    "not JSON": (_config("{'model_type': 'llama',}"), UsageError, "is not valid JSON"),
    "not UTF-8": (_config(b'{"model_type": "\xff"}'), UsageError, "cannot be read"),
    "a JSON array": (_config("[1, 2, 3]"), UsageError, "config.json is not a JSON object"),
    "deeply nested": (_config("[" * 100_000 + "]" * 100_000), UsageError, "is not valid JSON"),
    "no model_type": (_config(json.dumps({"architectures": ["LlamaForCausalLM"]})), UsageError, "has no model_type"),
    "model_type is a number": (_config_json(model_type=7), UsageError, "has no model_type"),
    "architectures is a number": (_config_json(architectures=5), UsageError, "field architectures must be a list"),
    "architectures is a string": (_config_json(architectures="LlamaForCausalLM"), UsageError,
                                  "field architectures must be a list"),
    "num_hidden_layers is a string": (_config_json(num_hidden_layers="2"), UsageError,
                                      "field num_hidden_layers must be a non-negative integer, not '2'"),
    "hidden_size is negative": (_config_json(hidden_size=-8), UsageError, "field hidden_size must be a non-negative"),
    "text_config is a string": (_config_json(text_config="llama"), UsageError, "field text_config must be an object"),
    "nested text_config with a wrong type": (_config_json(text_config={"model_type": "llama", "vocab_size": [1]}),
                                             UsageError, "field text_config.vocab_size"),
    "config.json is a FIFO": (lambda m: ((m / "config.json").unlink(), os.mkfifo(m / "config.json")),
                              UsageError, "has no config.json"),
    "config.json links to /dev/zero": (_config_link("/dev/zero"), UsageError, "has no config.json"),
    "config.json is a directory": (lambda m: ((m / "config.json").unlink(), (m / "config.json").mkdir()),
                                   UsageError, "has no config.json"),
    "hostile shard behind a good config": (lambda m: (m / "model.safetensors").write_bytes(st_bytes(b"{}", length=2**63)),
                                           UnsafeInputError, "its header claims"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_bad_config_json_stops_intake_with_one_sentence(tmp_path, catalog, case):
    from quark_ptq_eval.intake import analyze_model

    plant, error, expected = CONFIGS[case]
    model = make_model(tmp_path / "model")
    plant(model)
    with no_hang(), pytest.raises(error) as err:
        analyze_model(str(model), offline=True, catalog=catalog)
    assert expected in err.value.message, err.value.message
    assert err.value.exit_code == ExitCode.USAGE
    assert "Traceback" not in str(err.value)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "directory", "oversized"])
def test_json_inputs_that_are_not_small_regular_files_are_refused(tmp_path, monkeypatch, kind):
    """Context files, plans and state are read through read_json: a FIFO or /dev/zero given as
    --session-context must not hang or exhaust memory."""
    from quark_ptq_eval.base import fsio

    path = tmp_path / "session_context.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        monkeypatch.setattr(fsio, "MAX_JSON_BYTES", 1024)
        path.write_text(json.dumps({"pad": "x" * 2048}))
    with no_hang(), pytest.raises(UsageError) as err:
        fsio.read_json(path, "session context")
    expected = {"oversized": "more than any such file should be", "directory": "cannot be read"}.get(
        kind, "is not a regular file")
    assert expected in err.value.message and str(path) in err.value.message


MARKER_CODE = """
from pathlib import Path
Path({marker!r}).write_text("model repository code ran")
"""


def plant_custom_code(model: Path, marker: Path) -> None:
    """auto_map pointing at modeling/configuration files that leave ``marker`` when imported."""
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                       "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
                       "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (model / "config.json").write_text(json.dumps(cfg))
    for name in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (model / f"{name}.py").write_text(MARKER_CODE.format(marker=str(marker)))


def test_custom_code_is_flagged_and_nothing_from_the_repository_is_imported(tmp_path, catalog):
    from quark_ptq_eval.intake import analyze_model

    model = make_model(tmp_path / "model")
    marker = tmp_path / "MARKER"
    plant_custom_code(model, marker)
    # the planted code really would leave the marker if anything imported it
    assert "modeling_evil" not in sys.modules
    analysis = analyze_model(str(model), offline=True, catalog=catalog)
    assert analysis.model["has_custom_code"] is True and analysis.model["trust_remote_code"] is False
    risk = [r for r in analysis.risks if "custom code (auto_map)" in r["message"]]
    assert len(risk) == 1 and risk[0]["severity"] == "high" and "--trust-remote-code" in risk[0]["recovery_hint"]
    assert not marker.exists()
    assert not any(m.endswith("_evil") for m in sys.modules)


# --------------------------------------------------------------------------------------------
# Output targets that would destroy data
# --------------------------------------------------------------------------------------------

TARGETS = {
    "the source model dir": (lambda m, w, t: m, "into the source model directory"),
    "a path inside the source model": (lambda m, w, t: m / "quantized", "into the source model directory"),
    "the source model via a symlink": (lambda m, w, t: _link(t / "alias", m), "into the source model directory"),
    "a parent of the source model": (lambda m, w, t: m.parent, "it contains the source model"),
    "the work dir itself": (lambda m, w, t: w, "is (or contains) the work directory"),
    "a parent of the work dir": (lambda m, w, t: w.parent, "is (or contains) the work directory"),
    "/": (lambda m, w, t: Path("/"), "it is /."),
    "/ spelled /tmp/..": (lambda m, w, t: Path("/tmp/.."), "it is /."),
    "the home directory": (lambda m, w, t: Path.home(), "it is your home directory"),
    "~": (lambda m, w, t: Path("~"), "it is your home directory"),
    "an existing file": (lambda m, w, t: _file(t / "afile"), "is a file, not a directory"),
    "below an existing file": (lambda m, w, t: _file(t / "afile") / "out", "is a file"),
}


def _link(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


def _file(path: Path) -> Path:
    path.write_text("precious")
    return path


@pytest.mark.parametrize("case", list(TARGETS))
def test_destructive_output_target_is_refused_before_anything_is_created(tmp_path, case):
    pick, expected = TARGETS[case]
    model = make_model(tmp_path / "models" / "src")
    workdir = tmp_path / "runs" / "work"
    workdir.mkdir(parents=True)
    target = pick(model, workdir, tmp_path)
    before = tree_checksums(tmp_path)
    with pytest.raises(UsageError) as err:
        check_output_target(target, model, workdir)
    assert expected in err.value.message, err.value.message
    assert err.value.exit_code == ExitCode.USAGE
    assert tree_checksums(tmp_path) == before


def test_a_fresh_output_dir_next_to_the_model_is_accepted(tmp_path):
    model = make_model(tmp_path / "src")
    out = check_output_target(tmp_path / "src-int8", model, tmp_path / "work")
    assert out == tmp_path / "src-int8" and not out.exists()


# --------------------------------------------------------------------------------------------
# Hostile path names: argument lists, shown shell-quoted, never interpreted by a shell
# --------------------------------------------------------------------------------------------

HOSTILE_NAMES = {
    "spaces": "my model dir",
    "single quote": "it's",
    "double quote": 'say "hi"',
    "command substitution": "$(touch PWNED)",
    "backticks": "`touch PWNED`",
    "semicolon": "x; touch PWNED",
    "pipe and redirect": "a | touch PWNED > out &",
    "newline": "line1\nline2",
    "non-ASCII": "modèle-模型-🙂",
    "leading dash": "--help",
    "glob and tilde": "~*?[a]",
}


@pytest.mark.parametrize("case", list(HOSTILE_NAMES))
def test_hostile_names_travel_as_exact_arguments(tmp_path, monkeypatch, case):
    from quark_ptq_eval.base.gates import FlagApprover
    from quark_ptq_eval.base.ui import Reporter
    from quark_ptq_eval.flows.recipe.pipeline import Recipe, RunOptions

    name = HOSTILE_NAMES[case]
    monkeypatch.chdir(tmp_path)
    model = make_model(tmp_path / name)
    calib = tmp_path / f"calib {name}.txt"
    calib.write_text("some calibration text\n" * 20)
    out = tmp_path / f"out {name}"
    recipe = Recipe(tmp_path / f"work {name}", FlagApprover(all_gates=True), Reporter(quiet=True))
    recipe.run(RunOptions(model=str(model), output_dir=str(out), offline=True,
                          request={"scheme": "int8", "calib_data": str(calib), "num_calib_samples": 8,
                                "calib_seq_len": 64}), stop_after="manifest")
    manifest = yaml.safe_load((tmp_path / f"work {name}" / "run_manifest.yaml").read_text(encoding="utf-8"))
    argv, env = manifest["command"]["argv"], manifest["command"]["env"]
    # exact, absolute arguments: no flag confusion from a leading dash, no expansion of anything
    assert argv[argv.index("--model_dir") + 1] == str(model)
    assert argv[argv.index("--output_dir") + 1] == str(out) + ".partial"
    assert argv[argv.index("--calib_data") + 1] == str(calib)
    assert all(argv[argv.index(f) + 1].startswith("/") for f in ("--model_dir", "--output_dir", "--calib_data"))
    # the line shown to the user is shell-quoted: a shell would give back exactly the argument list
    assert shlex.split(manifest["command"]["shell"]) == ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
    assert not list(tmp_path.rglob("PWNED")) and not out.exists()
