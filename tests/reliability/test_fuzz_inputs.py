"""Property-based fuzzing (hypothesis) of the two parsers that see untrusted input first.

- ``safetensors_io.read_header`` on arbitrary bytes and on structured mutations of valid files:
  the only exception allowed is our ``UnsafeInputError``; an accepted header only describes
  bytes inside the file, without overlaps; memory stays bounded whatever size a header claims.
- The validator's config comparison (``validate/configdiff.py``) on arbitrary JSON-like values,
  biased towards the keys it treats specially: no crash, and a document never differs from itself.

Example counts are moderate so the module stays well under a minute on a shared CPU.
"""

from __future__ import annotations

import json
import math
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quark_ptq_eval.base.errors import UnsafeInputError
from quark_ptq_eval.base.safetensors_io import DTYPE_BYTES, SafetensorsHeader, read_header
from quark_ptq_eval.validate.configdiff import (
    HeaderFacts,
    check_config,
    drop_keys,
    json_diff,
    normalize_drift,
    triage_json,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])
MEMORY_BOUND = 16 * 2**20  # far below any size a fuzzed header claims (up to 2^64)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "fuzzed.safetensors"


def check_reader(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    tracemalloc.start()
    try:
        try:
            header = read_header(path)
        except UnsafeInputError as exc:
            assert exc.message and "\n" not in exc.message
            header = None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BOUND + 4 * len(data), f"read_header allocated {peak} bytes"
    if header is None:
        return
    assert isinstance(header, SafetensorsHeader)
    size = len(data)
    pos = header.data_start
    for t in sorted(header.tensors.values(), key=lambda t: (t.start, t.end)):
        assert header.data_start <= t.start <= t.end <= size, "accepted a tensor outside the file"
        assert t.start >= pos, "accepted overlapping tensors"
        assert t.end - t.start == math.prod(t.shape) * DTYPE_BYTES[t.dtype]
        pos = t.end


@FUZZ
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes(scratch, data):
    check_reader(scratch, data)


@FUZZ
@given(body=st.binary(max_size=256), length=st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1)))
def test_arbitrary_header_behind_a_plausible_length(scratch, body, length):
    check_reader(scratch, length.to_bytes(8, "little") + body)


# -- structured mutations of valid files ------------------------------------------------------

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                         st.text(max_size=8))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                   st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)
INTERESTING_INTS = st.one_of(st.integers(-3, 300), st.sampled_from([2**31, 2**32, 2**53, 2**62, 2**63, 2**64 - 1]),
                             st.integers(-(2**64), 2**64))


@st.composite
def valid_files(draw):
    tensors, pos = {}, 0
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(sorted(DTYPE_BYTES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        n = math.prod(shape) * DTYPE_BYTES[dtype]
        gap = draw(st.integers(0, 3))
        tensors[f"model.layers.{i}.weight"] = {"dtype": dtype, "shape": shape, "data_offsets": [pos + gap, pos + gap + n]}
        pos += gap + n
    if draw(st.booleans()):
        tensors["__metadata__"] = {"format": "pt"}
    return tensors, pos


MUTATIONS = ("length", "truncate", "dtype", "shape", "offsets", "move", "entry", "metadata", "nest", "flip", "extend")


@st.composite
def mutated_files(draw):
    header, data_len = draw(valid_files())
    names = [k for k in header if k != "__metadata__"]
    length = None
    data = bytes(data_len)
    ops = draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3))
    for op in ops:
        if op == "length":
            length = draw(INTERESTING_INTS.filter(lambda n: 0 <= n < 2**64))
        elif op == "truncate":
            data = data[: draw(st.integers(0, len(data)))]
        elif op == "extend":
            data += bytes(draw(st.integers(0, 16)))
        elif op == "metadata":
            header["__metadata__"] = draw(JSON_VALUES)
        elif op == "nest":
            depth = draw(st.integers(1, 40))
            header[draw(st.text(max_size=4))] = json.loads("[" * depth + "]" * depth)
        elif names and op in ("dtype", "shape", "offsets", "move", "entry"):
            name = draw(st.sampled_from(names))
            if op != "entry" and not isinstance(header[name], dict):
                continue  # an earlier mutation replaced the whole entry
            offsets = header[name].get("data_offsets") if op == "move" else None
            if op == "move":  # the same size elsewhere: overlaps, gaps, past the end
                if isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets):
                    start = draw(st.integers(0, data_len + 8))
                    header[name]["data_offsets"] = [start, start + offsets[1] - offsets[0]]
            elif op == "dtype":
                header[name]["dtype"] = draw(st.one_of(JSON_SCALARS, st.sampled_from(sorted(DTYPE_BYTES))))
            elif op == "shape":
                header[name]["shape"] = draw(st.one_of(JSON_VALUES, st.lists(INTERESTING_INTS, max_size=3)))
            elif op == "offsets":
                header[name]["data_offsets"] = draw(st.one_of(JSON_VALUES, st.lists(INTERESTING_INTS, max_size=3)))
            else:
                header[name] = draw(JSON_VALUES)
    raw = json.dumps(header).encode()
    if "flip" in ops and draw(st.booleans()) and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i + 1 :]
    n = len(raw) if length is None else length
    return n.to_bytes(8, "little") + raw + data


@FUZZ
@given(data=mutated_files())
def test_structured_mutations_of_valid_files(scratch, data):
    check_reader(scratch, data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=valid_files())
def test_valid_files_are_accepted_exactly(scratch, spec):
    """The oracle's other side: an unmutated file is accepted with every tensor where it was put."""
    header, data_len = spec
    raw = json.dumps(header).encode()
    scratch.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(data_len))
    parsed = read_header(scratch)
    expected = {k: v for k, v in header.items() if k != "__metadata__"}
    assert set(parsed.tensors) == set(expected)
    for name, entry in expected.items():
        t = parsed.tensors[name]
        assert (t.dtype, list(t.shape)) == (entry["dtype"], entry["shape"])
        assert (t.start - parsed.data_start, t.end - parsed.data_start) == tuple(entry["data_offsets"])


# -- the validator's config comparison ---------------------------------------------------------

SPECIAL_KEYS = ("quantization_config", "torch_dtype", "dtype", "rope_theta", "rope_scaling", "rope_parameters",
                "layer_types", "model_type", "text_config", "transformers_version", "num_hidden_layers", "type",
                "rope_type", "_name_or_path")
KEYS = st.one_of(st.sampled_from(SPECIAL_KEYS), st.text(max_size=5))
CONFIG_VALUES = st.recursive(
    JSON_SCALARS | st.sampled_from(["full_attention", "linear", "bfloat16"]),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=5)),
    max_leaves=20,
)
CONFIGS = st.dictionaries(KEYS, CONFIG_VALUES, max_size=8)


@settings(max_examples=300, deadline=None)
@given(a=st.one_of(CONFIGS, CONFIG_VALUES), b=st.one_of(CONFIGS, CONFIG_VALUES))
def test_config_comparison_never_crashes(a, b):
    real, benign = triage_json(a, b)
    for d in [*real, *benign, *json_diff(a, b)]:
        assert isinstance(d.path, str)
        assert isinstance(d.describe(), str)
    normalize_drift(a)
    drop_keys(a, frozenset({"quantization_config"}))


@settings(max_examples=200, deadline=None)
@given(a=CONFIGS)
def test_a_config_never_differs_from_itself(a):
    assert json_diff(a, a) == []
    assert triage_json(a, a) == ([], [])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(src=st.one_of(CONFIGS, CONFIG_VALUES, st.binary(max_size=40)), out=st.one_of(CONFIGS, st.binary(max_size=40)))
def test_config_check_on_arbitrary_files_reports_instead_of_crashing(tmp_path_factory, src, out):
    root = tmp_path_factory.mktemp("cfg")
    for side, value in (("source", src), ("output", out)):
        (root / side).mkdir()
        (root / side / "config.json").write_bytes(value if isinstance(value, bytes) else json.dumps(value).encode())
    result = check_config(root / "source", root / "output", HeaderFacts(2, 2))
    for f in result.findings:
        assert isinstance(f.line(), str) and f.message
