"""``import quark.torch``: plain against through our cache of Quark's transformers scan (quark_import.py).

Every process that quantizes, loads a Quark export or builds the catalog pays this import. Each
variant runs in a fresh interpreter; the cached one after one priming run (a user's second
process). Both print Quark's registry of MoE expert classes, which must be identical.
``ratio`` is plain time / cached time (above 1: we are faster). Run:
``python -m bench.benchmarks.bench_quark_import [--runs N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REGISTRY = ("from quark.torch.utils.llm.module_replacement.preprocess_registry import PREPROCESS_REGISTRY as R\n"
            "print(sorted(f'{k.__module__}.{k.__qualname__}' for k in R))\n")
PLAIN = "import quark.torch\n" + REGISTRY
CACHED = ("import sys\nfrom pathlib import Path\nfrom quark_ptq_eval.base.quark_import import import_quark_torch\n"
          "import_quark_torch(Path(sys.argv[1]))\n" + REGISTRY)


def timed(code: str, *args: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, proc.stdout.strip().splitlines()[-1]


def run(quick: bool, runs: int | None = None) -> list[dict]:
    runs = runs or (1 if quick else 3)
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "quark-import-scan.json")
        timed(CACHED, cache)  # priming: the first process parses and remembers
        plain, cached = [], []
        for _ in range(runs):  # interleaved: the host's load hits both alike
            seconds, plain_registry = timed(PLAIN)
            plain.append(seconds)
            seconds, cached_registry = timed(CACHED, cache)
            cached.append(seconds)
    same = plain_registry == cached_registry
    ours, peer = statistics.median(cached), statistics.median(plain)
    return [{"benchmark": "import quark.torch (scan cached)", "ours_s": ours, "peer": "plain import",
             "peer_s": peer, "ratio": peer / ours, "ok": same,
             "note": f"median of {runs}; expert registry {'identical' if same else 'DIFFERS'}"}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    rows = run(quick=False, runs=p.parse_args().runs)
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
