"""Session guard: the source model and the installed Quark package are never modified.

The recipe forbids touching either. Quark's files are hashed when this module is imported (at
collection, before any test of the session runs); the tiny source model when the guard is first
used. The session-scoped ``source_guard`` fixture re-hashes both at the very end of the session
and fails there (an error at teardown of the last test) if anything changed, was added or was
removed. Other reliability modules import it, so it is armed early in their session too.

Also home to the small builders the hostile-input suites share (hand-written safetensors files
and synthetic model directories; no torch needed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest

SKIP_DIRS = {"__pycache__"}


def tree_checksums(root: Path) -> dict[str, str]:
    """sha256 of every regular file under ``root`` (relative path -> digest); symlinks by target.

    Directories are not entries, so the empty ``llm_ptq`` folder quark-cli creates inside its
    package does not count; a file written into it does."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def quark_roots() -> list[Path]:
    spec = importlib.util.find_spec("quark")
    assert spec is not None and spec.submodule_search_locations, "amd-quark is not installed"
    pkg = Path(next(iter(spec.submodule_search_locations)))
    return [pkg, *sorted(pkg.parent.glob("amd_quark-*.dist-info"))]


def quark_checksums() -> dict[str, dict[str, str]]:
    return {str(r): tree_checksums(r) for r in quark_roots()}


def changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return ([f"changed {k}" for k in sorted(before.keys() & after.keys()) if before[k] != after[k]]
            + [f"removed {k}" for k in sorted(before.keys() - after.keys())]
            + [f"added {k}" for k in sorted(after.keys() - before.keys())])


QUARK_AT_COLLECTION = quark_checksums()


class _Guard:
    def __init__(self) -> None:
        self.models: dict[Path, dict[str, str]] = {}

    def watch(self, model_dir: Path) -> None:
        self.models.setdefault(Path(model_dir), tree_checksums(Path(model_dir)))

    def problems(self) -> list[str]:
        found = []
        for root, before in QUARK_AT_COLLECTION.items():
            found += [f"Quark package {root}: {c}" for c in changes(before, tree_checksums(Path(root)))]
        for model, before in self.models.items():
            found += [f"source model {model}: {c}" for c in changes(before, tree_checksums(model))]
        return found


GUARD = _Guard()  # one per session, however many modules import the fixture


@pytest.fixture(scope="session")
def source_guard(tiny_llama):
    GUARD.watch(tiny_llama)
    yield GUARD
    problems = GUARD.problems()
    assert not problems, "the test session modified files it must never touch:\n" + "\n".join(problems[:20])


def test_guard_is_armed_over_the_real_files(source_guard, tiny_llama):
    quark_files = QUARK_AT_COLLECTION[str(quark_roots()[0])]
    assert "__init__.py" in quark_files and len(quark_files) > 100
    assert not any("__pycache__" in k for k in quark_files)
    assert "model.safetensors" in source_guard.models[tiny_llama] and "config.json" in source_guard.models[tiny_llama]
    assert source_guard.problems() == []


def test_guard_detects_a_changed_added_or_removed_file(tmp_path):
    (tmp_path / "a").write_text("1")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_text("2")
    (tmp_path / "__pycache__").mkdir()
    before = tree_checksums(tmp_path)
    (tmp_path / "__pycache__" / "x.pyc").write_text("ignored")
    (tmp_path / "empty_dir").mkdir()  # like quark-cli's llm_ptq folder: not a file, not a change
    assert changes(before, tree_checksums(tmp_path)) == []
    (tmp_path / "a").write_text("3")
    (tmp_path / "sub" / "b").unlink()
    (tmp_path / "empty_dir" / "c").write_text("new")
    assert changes(before, tree_checksums(tmp_path)) == ["changed a", "removed sub/b", "added empty_dir/c"]


# --------------------------------------------------------------------------------------------
# Builders shared by the hostile-input suites
# --------------------------------------------------------------------------------------------

LLAMA_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
                "vocab_size": 16, "tie_word_embeddings": False}
LLAMA_TENSORS = [("model.embed_tokens.weight", "F16", [16, 8]),
                 *[(f"model.layers.0.self_attn.{p}.weight", "F16", [8, 8]) for p in ("q_proj", "k_proj", "v_proj", "o_proj")],
                 *[(f"model.layers.0.mlp.{p}.weight", "F16", s) for p, s in (("gate_proj", [16, 8]), ("up_proj", [16, 8]),
                                                                               ("down_proj", [8, 16]))],
                 ("model.layers.0.input_layernorm.weight", "F16", [8]), ("model.norm.weight", "F16", [8]),
                 ("lm_head.weight", "F16", [16, 8])]
DTYPE_SIZE = {"F16": 2, "BF16": 2, "F32": 4, "I8": 1, "U8": 1}


def st_header(tensors=LLAMA_TENSORS) -> tuple[dict, int]:
    """A valid header for ``tensors`` laid out back to back, and its data length."""
    header, pos = {}, 0
    for name, dtype, shape in tensors:
        n = DTYPE_SIZE[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    return header, pos


def st_bytes(header: dict | bytes, data: bytes | int = 0, length: int | None = None) -> bytes:
    """A safetensors file: 8-byte little-endian length, header, data (``int``: that many zero bytes)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    return n.to_bytes(8, "little") + raw + (bytes(data) if isinstance(data, int) else data)


def write_st(path: Path, tensors=LLAMA_TENSORS) -> Path:
    header, size = st_header(tensors)
    path.write_bytes(st_bytes(header, size))
    return path


def make_model(root: Path, config: dict | None = None, tensors=LLAMA_TENSORS) -> Path:
    """A synthetic llama-like model dir: config.json and one valid shard (headers only matter)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(LLAMA_CONFIG if config is None else config))
    write_st(root / "model.safetensors", tensors)
    return root
