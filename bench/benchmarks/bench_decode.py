"""The decode check at disk speed: every quantized weight decoded against its source, vs a cold read.

Builds ``bench_validate.py``'s synthetic sharded model pair (in a temp dir, deleted afterwards): a
float16 source and a twin whose ``up_proj`` linears are int8 round-to-nearest per tensor, as Quark
lays them out. Times, each from a cold page cache (``posix_fadvise(DONTNEED)`` on every file of
both models: the files' pages leave the cache, nothing else on the host is touched) and
interleaved (ours, read, ours, ...), medians:

- ``decode_export`` (the decode check alone: it reads each quantized weight's codes and scales and
  its source weight, decodes and compares),
- reading exactly the same byte ranges once, in file order, ``cat > /dev/null`` style (the peer;
  target: ours within 1.5x of it).

Wall and CPU seconds of both, and the host's load average around the runs: on a shared host the
wall ratio also measures the load, the CPU seconds do not. ``ratio`` is peer time / our time.

Run: ``python -m bench.benchmarks.bench_decode [--size-gb 2] [--repeat 3]`` (``make bench`` runs it with the defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

TARGET = 1.5  # ours / cold read, at most


def decode_ranges(source: Path, twin: Path) -> list[tuple[Path, int, int]]:
    """The byte ranges the decode check reads (each quantized weight, its scale, zero point and
    source), in file order: the fastest order to read them in."""
    from quark_ptq_eval.base.safetensors_io import read_model_headers

    src, out = read_model_headers(source), read_model_headers(twin)
    ranges = []
    for name in sorted(out):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{module}.weight_scale" in out:
            for info in (out[name], out[f"{module}.weight_scale"], out.get(f"{module}.weight_zero_point"), src[name]):
                if info is not None:
                    ranges.append((info.file, info.start, info.end))
    return sorted(ranges, key=lambda r: (str(r[0]), r[1]))


def measure(size_gb: float, repeat: int) -> dict[str, Any]:
    from bench.benchmarks.bench_validate import (
        HIDDEN,
        SHARD_BYTES,
        VOCAB,
        _write_model_pair,
        interleaved,
        read_ranges_once,
    )
    from quark_ptq_eval.validate.decode import decode_export

    root = Path(tempfile.mkdtemp(prefix="qpe-bench-decode-"))
    try:
        source, twin = _write_model_pair(root, int(size_gb * 1e9), HIDDEN, VOCAB, SHARD_BYTES)
        ranges = decode_ranges(source, twin)
        load_before = os.getloadavg()[0]
        results = interleaved({"decode": lambda: decode_export(source, twin),
                               "read": lambda: read_ranges_once(ranges)}, (source, twin), repeat)
        load_after = os.getloadavg()[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    check = results["decode"][2]
    assert check.status == "pass", [f.line() for f in check.findings][:3]
    ours, read = results["decode"][0], results["read"][0]
    return {"bytes_read": sum(end - start for _, start, end in ranges), "weights": check.stats["checked"],
            "worst_steps": check.stats["worst_steps"], "decode_s": round(ours, 3),
            "decode_cpu_s": round(results["decode"][1], 3), "cold_read_s": round(read, 3),
            "cold_read_cpu_s": round(results["read"][1], 3), "ours_over_read": round(ours / read, 3),
            "cores": os.cpu_count(), "load_average": [round(load_before, 1), round(load_after, 1)],
            "met": ours <= TARGET * read}


def run(quick: bool = False, size_gb: float | None = None, repeat: int | None = None) -> list[dict[str, Any]]:
    """``run_all.py``'s row: ours (the decode check) against the cold read of the same bytes."""
    size_gb = size_gb if size_gb is not None else (0.5 if quick else 2.0)
    m = measure(size_gb, repeat if repeat is not None else (1 if quick else 3))
    note = (f"{m['bytes_read'] / 1e6:.0f} MB, {m['weights']} weights, worst {m['worst_steps']} step; CPU s: decode "
            f"{m['decode_cpu_s']}, read {m['cold_read_cpu_s']}; {m['cores']} cores, load {m['load_average']}")
    return [{"benchmark": f"decode check, every quantized weight ({m['bytes_read'] / 1e9:.2f} GB read)",
             "ours_s": m["decode_s"], "peer": "cold read of the same bytes (cat > /dev/null)",
             "peer_s": m["cold_read_s"], "ratio": round(m["cold_read_s"] / m["decode_s"], 3),
             "target": f"ours <= {TARGET}x the read", "ok": m["met"], "note": note, "measured": m}]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gb", type=float, default=None, help="source model size (default 2; 0.5 with --quick)")
    p.add_argument("--repeat", type=int, default=None, help="interleaved cold runs of each (default 3)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    print(json.dumps(run(args.quick, args.size_gb, args.repeat)[0]["measured"], indent=2))


if __name__ == "__main__":
    main()
