"""The streaming MD5 comparison on synthetic files: exact digests, first difference, sampling, threads."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from quark_ptq_eval.base.safetensors_io import TensorInfo
from quark_ptq_eval.validate.byte_identity import (
    Sampling,
    check_excluded_bytes,
    digest_pair,
    excluded_candidates,
    sample,
)


def tensor(path: Path, payload: bytes, prefix: bytes = b"", name: str = "t") -> TensorInfo:
    path.write_bytes(prefix + payload)
    return TensorInfo(name, "U8", (len(payload),), path, len(prefix), len(prefix) + len(payload))


@pytest.mark.parametrize("diff_at", [None, 0, 63, 64, 65, 999, 4095, 9999])
@pytest.mark.parametrize("chunk", [64, 1000, 8192, 1 << 20])
def test_digests_are_exact_on_both_sides(tmp_path, diff_at, chunk):
    payload = random.Random(1).randbytes(10_000)
    changed = payload if diff_at is None else payload[:diff_at] + bytes([payload[diff_at] ^ 0xFF]) + payload[diff_at + 1:]
    src = tensor(tmp_path / "a", payload, prefix=b"x" * 13)
    out = tensor(tmp_path / "b", changed, prefix=b"y" * 7)
    d = digest_pair(src, out, chunk_bytes=chunk)
    assert d.source_md5 == hashlib.md5(payload).hexdigest()
    assert d.output_md5 == hashlib.md5(changed).hexdigest()
    assert d.first_difference == diff_at
    assert d.identical is (diff_at is None)


def test_empty_tensor_is_identical(tmp_path):
    d = digest_pair(tensor(tmp_path / "a", b""), tensor(tmp_path / "b", b""))
    assert d.identical and d.source_md5 == hashlib.md5(b"").hexdigest()


def test_a_short_file_is_a_read_error_not_a_crash(tmp_path):
    payload = random.Random(2).randbytes(20_000)
    src = tensor(tmp_path / "a", payload, prefix=b"p" * 100)
    out = TensorInfo("t", "U8", (20_000,), tmp_path / "b", 100, 20_100)
    (tmp_path / "b").write_bytes(b"p" * 100 + payload[:15_000])
    result = check_excluded_bytes({"t": src}, {"t": out}, ["t"])
    [finding] = result.failures
    assert finding.side == "environment" and "ends before the end of tensor 't'" in finding.message


def test_sampling_is_seeded_and_matches_quarks_draw():
    names = [f"model.layers.{i}.keep.weight" for i in range(10)]
    assert sample(names, 3, 42) == sorted(random.Random(42).sample(names, 3))
    assert sample(names, 3, 42) == sample(names, 3, 42) != sample(names, 3, 43)
    assert sample(names, None, 0) == names == sample(names, 10, 0)


def test_candidates_follow_module_and_tensor_patterns_and_tied_embeddings(tmp_path):
    info = TensorInfo("x", "U8", (1,), tmp_path / "f", 0, 1)
    source = {n: info for n in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
                                "model.layers.0.mlp.down_proj.bias", "model.layers.0.mlp.up_proj.weight")}
    assert excluded_candidates(source, ["*down_proj"], False) == [
        "model.layers.0.mlp.down_proj.bias", "model.layers.0.mlp.down_proj.weight"]
    assert excluded_candidates(source, ["lm_head"], True) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert excluded_candidates(source, ["*.up_proj.weight"], False) == ["model.layers.0.mlp.up_proj.weight"]


def test_many_pairs_across_threads_agree_with_one_thread(tmp_path):
    rng = random.Random(3)
    source, output = {}, {}
    for i in range(12):
        payload = rng.randbytes(rng.randint(1, 50_000))
        name = f"m{i}.weight"
        source[name] = tensor(tmp_path / f"s{i}", payload, name=name)
        bad = i % 5 == 0
        output[name] = tensor(tmp_path / f"o{i}", payload[:-1] + b"\0" if bad else payload, name=name)
    calls = []
    parallel = check_excluded_bytes(source, output, ["m*"], sampling=Sampling(workers=4, progress=lambda *a: calls.append(a)))
    serial = check_excluded_bytes(source, output, ["m*"], sampling=Sampling(workers=1))
    assert [f.subject for f in parallel.failures] == [f.subject for f in serial.failures] == ["m0.weight", "m10.weight", "m5.weight"]
    assert parallel.stats["identical"] == serial.stats["identical"] == 9
    assert parallel.stats["differing_md5"] == serial.stats["differing_md5"] and len(parallel.stats["differing_md5"]) == 3
    assert calls[-1][1] == calls[-1][2] == sum(s.nbytes for s in source.values())


def test_nothing_excluded_skips_the_check(tmp_path):
    src = tensor(tmp_path / "a", b"abc")
    assert check_excluded_bytes({"t": src}, {"t": src}, []).status == "skipped"
    assert "no source tensor matches" in check_excluded_bytes({"t": src}, {"t": src}, ["lm_head"]).skipped_reason


def test_without_libc_memcmp_the_comparison_still_holds(tmp_path, monkeypatch):
    from quark_ptq_eval.validate import byte_identity

    monkeypatch.setattr(byte_identity, "_memcmp", lambda: None)
    payload = random.Random(4).randbytes(5000)
    src = tensor(tmp_path / "a", payload)
    assert digest_pair(src, tensor(tmp_path / "b", payload), chunk_bytes=1024).identical
    d = digest_pair(src, tensor(tmp_path / "c", payload[:4000] + b"\0" * 1000), chunk_bytes=1024)
    assert d.first_difference == 4000 + next(i for i, x in enumerate(payload[4000:]) if x != 0)
