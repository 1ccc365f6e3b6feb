"""`--ray HOST:PORT` with nothing listening: our refusal against Ray's own ``ray.init`` on that address.

- ours: ``check_answers`` (flows/compare/ray_cluster.py), the check ``connect`` runs before ``ray.init``;
- peer: ``ray.init(address=HOST:PORT)`` in a fresh process, stopped after ``--cap`` seconds (Ray 2.60 retries
  its GCS for minutes: still waiting after 200 s here), so its time is a lower bound when it says "capped".

The ratio is peer / ours. Run: ``python -m bench.benchmarks.bench_ray_dead_address [--cap 60]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.flows.compare.ray_cluster import check_answers
from quark_ptq_eval.runtime.vllm_host import free_port

PEER = "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False)"


def ours(address: str) -> float:
    start = time.perf_counter()
    try:
        check_answers(address)
    except UsageError:
        return time.perf_counter() - start
    raise SystemExit(f"something answers at {address}: pick another port")


def peer(address: str, cap_s: float) -> tuple[float, bool]:
    """Seconds until ray.init gave up, and whether it was stopped at the cap instead."""
    start = time.perf_counter()
    try:
        subprocess.run([sys.executable, "-c", PEER, address], capture_output=True, timeout=cap_s)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, True
    return time.perf_counter() - start, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=60.0, help="stop Ray's own attempt after this many seconds")
    args = parser.parse_args()
    address = f"127.0.0.1:{free_port()}"
    load_before = os.getloadavg()[0]
    our_s = ours(address)
    peer_s, capped = peer(address, args.cap)
    print(f"cores: {os.cpu_count()}; load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"dead address {address}: ours {our_s * 1000:.1f} ms (refused); ray.init "
          f"{'>' if capped else ''}{peer_s:.1f} s{' (capped: still retrying)' if capped else ''}; "
          f"ratio (peer / ours) {'>' if capped else ''}{peer_s / our_s:,.0f}")


if __name__ == "__main__":
    main()
