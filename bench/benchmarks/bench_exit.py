"""What a finished process pays to exit, and what base/process_exit.exit_now saves: the same imports (torch and
transformers; then Quark through our import), left by ``sys.exit`` and by ``exit_now``, interleaved, N runs each;
the median wall time of each and their difference. Prints the load beside the figures.
Run: ``python -m bench.benchmarks.bench_exit [--runs N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

IMPORTS = {
    "torch + transformers": "import torch, transformers; from transformers import AutoModelForCausalLM",
    "Quark (our import)": "from quark_ptq_eval.base.quark_import import import_quark_torch; import_quark_torch()",
}
EXITS = {"sys.exit": "import sys; sys.exit(0)",
         "exit_now": "from quark_ptq_eval.base.process_exit import exit_now; exit_now(0)"}


def _wall(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - start


def measure(runs: int) -> list[tuple[str, float, float]]:
    """(imports, median wall with sys.exit, median wall with exit_now), the two interleaved."""
    out = []
    for label, imports in IMPORTS.items():
        walls: dict[str, list[float]] = {name: [] for name in EXITS}
        for _ in range(runs):
            for name, leave in EXITS.items():
                walls[name].append(_wall(f"{imports}\n{leave}"))
        plain, fast = (statistics.median(walls[name]) for name in EXITS)
        out.append((label, plain, fast))
    return out


def run(quick: bool) -> list[dict]:
    """run_all's rows: ours is exit_now, the peer a plain sys.exit after the same imports."""
    return [{"benchmark": f"exit after {label}", "ours_s": fast, "peer": "sys.exit", "peer_s": plain,
             "ratio": plain / fast, "note": f"saved {plain - fast:.2f} s a process"}
            for label, plain, fast in measure(1 if quick else 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    print(f"load {os.getloadavg()[0]:.2f} at start")
    for label, plain, fast in measure(runs):
        print(f"{label}: sys.exit {plain:.2f} s, exit_now {fast:.2f} s, saved {plain - fast:.2f} s a process "
              f"(median of {runs}; load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
