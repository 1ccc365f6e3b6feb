"""The decode check at disk speed: every quantized weight decoded against its source, vs a cold read.

Builds ``bench_validate.py``'s synthetic sharded model pair (in a temp dir, deleted afterwards): a
float16 source and a twin whose ``up_proj`` linears are int8 round-to-nearest per tensor, as Quark
lays them out. Times, each from a cold page cache and interleaved (ours, read, ours, ...), medians:

- ``decode_export`` (the decode check alone: it reads each quantized weight's codes and scales and
  its source weight, decodes and compares),
- reading exactly the same byte ranges once, ``cat > /dev/null`` style (target: within 1.5x).

Run: ``python bench/bench_decode.py [--size-gb 2] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def decode_ranges(source: Path, twin: Path) -> list[tuple[Path, int, int]]:
    """The byte ranges the decode check reads: each quantized weight, its scale, zero point and source."""
    from quark_ptq_eval.base.safetensors_io import read_model_headers

    src, out = read_model_headers(source), read_model_headers(twin)
    ranges = []
    for name in sorted(out):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{module}.weight_scale" in out:
            for info in (out[name], out[f"{module}.weight_scale"], out.get(f"{module}.weight_zero_point"), src[name]):
                if info is not None:
                    ranges.append((info.file, info.start, info.end))
    return ranges


def run(size_gb: float, repeat: int) -> dict:
    from bench_validate import HIDDEN, SHARD_BYTES, VOCAB, _write_model_pair, interleaved, read_ranges_once

    from quark_ptq_eval.validate.decode import decode_export

    root = Path(tempfile.mkdtemp(prefix="qpe-bench-decode-"))
    try:
        source, twin = _write_model_pair(root, int(size_gb * 1e9), HIDDEN, VOCAB, SHARD_BYTES)
        ranges = decode_ranges(source, twin)
        nbytes = sum(end - start for _, start, end in ranges)
        results = interleaved({"decode": lambda: decode_export(source, twin),
                               "read": lambda: read_ranges_once(ranges)}, (source, twin), repeat)
        check = results["decode"][2]
        assert check.status == "pass", [f.line() for f in check.findings][:3]
        ours, read = results["decode"][0], results["read"][0]
        return {"bytes_read": nbytes, "weights": check.stats["checked"], "worst_steps": check.stats["worst_steps"],
                "decode_s": round(ours, 3), "decode_cpu_s": round(results["decode"][1], 3),
                "cold_read_s": round(read, 3), "ratio": round(ours / read, 3), "target": "decode <= 1.5x cold read",
                "met": ours <= 1.5 * read}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    print(json.dumps(run(args.size_gb, args.repeat), indent=2))


if __name__ == "__main__":
    main()
