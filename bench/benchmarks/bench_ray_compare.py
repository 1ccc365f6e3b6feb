"""`compare` of four schemes locally against `compare --ray` on the two-node test cluster, on the demo model.

Builds the demo corpus and tiny Llama in a temp dir, warms the capability catalog, brings up Ray's own
multi-node-on-one-host cluster (``ray.cluster_utils.Cluster``: a head and a second node, 1 CPU each, on
127.0.0.1, as the tests do), then times, each as one fresh CLI process with a fresh output root:

- ours: ``quark-ptq-eval compare M --schemes fp8,int8,int4_wo_128,mxfp4 -o ROOT --ray ADDRESS ...``
  (every scheme's recipe a Ray task: two at a time, one per node);
- peer: the same ``compare`` without ``--ray`` (one scheme after another in the one process).

The ratio is peer / ours (above 1: the cluster run is faster). Ray's own cost shows in two figures
beside it: the cluster's bring-up (not in either time), and the per-cell overhead, the cells' wall
time on Ray (attempt start to end, read from the work dirs) against the same scheme's share locally.
Both runs' comparison.json must agree (perplexity and KL per scheme, equal to 1e-9 relative).
Run: ``python -m bench.benchmarks.bench_ray_compare [--max-windows N]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.benchmarks.bench_compare import SCHEMES, shared_flags
from bench.benchmarks.bench_orchestration import ENV, our_cli, timed, warm_catalog

NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20, "node_ip_address": "127.0.0.1"}


def start_cluster():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster

    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=NODE)
    cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    return cluster, time.perf_counter() - t0


def compare_argv(model: Path, corpus: Path, root: Path, windows: int, address: str | None) -> list[str]:
    return [*our_cli(), "compare", str(model), "--schemes", ",".join(SCHEMES), "-o", str(root),
            *shared_flags(corpus, windows), *(["--ray=" + address] if address else [])]


def agree(local: dict, ray: dict) -> bool:
    a, b = ({r["scheme"]: r for r in d["schemes"]} for d in (local, ray))
    return all(math.isclose(a[s][k], b[s][k], rel_tol=1e-9) for s in SCHEMES for k in ("perplexity", "kl_mean")
               if a[s].get(k) is not None) and all(a[s]["status"] == b[s]["status"] for s in SCHEMES)


def cell_seconds(root: Path) -> dict[str, float]:
    """Each cell's wall time on Ray: its (last) attempt's start to its eval results' write."""
    out = {}
    for scheme in SCHEMES:
        wd = root / "work" / scheme
        attempts = json.loads((wd / "ray_attempts.json").read_text(encoding="utf-8"))
        out[scheme] = (wd / "eval_results.json").stat().st_mtime - attempts[-1]["started_at"]
    return out


def run(quick: bool, windows: int | None = None) -> list[dict]:
    windows = windows or (16 if quick else 64)
    env_path = os.environ.get("PYTHONPATH", "")
    src = str(Path(__file__).resolve().parents[2] / "src")
    os.environ["PYTHONPATH"] = src + (os.pathsep + env_path if env_path else "")  # the cluster's workers import ours
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # 127.0.0.1 stays loopback in every process
    # the CLI children get bench_orchestration.ENV, a copy of the environment taken at its import: refresh it,
    # or the driver maps the cluster's 127.0.0.1 to the host's network address and waits for a GCS there
    ENV.update({k: os.environ[k] for k in ("PYTHONPATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")})
    with tempfile.TemporaryDirectory(prefix="qpe-bench-ray-") as tmp:
        root = Path(tmp)
        from quark_ptq_eval.flows.demo import build_corpus, build_tiny_model

        corpus = build_corpus(root / "assets" / "corpus.txt")
        model = build_tiny_model(root / "assets" / "tiny-llama", corpus)
        catalog_s = warm_catalog()
        cluster, up_s = start_cluster()
        try:
            load0 = os.getloadavg()[0]
            ray_s = timed(compare_argv(model, corpus, root / "ray" / "out", windows, cluster.address),
                          root / "ray.log")
            local_s = timed(compare_argv(model, corpus, root / "local" / "out", windows, None), root / "local.log")
            load1 = os.getloadavg()[0]
        finally:
            cluster.shutdown()
        docs = {k: json.loads((root / k / "out" / "comparison.json").read_text(encoding="utf-8"))
                for k in ("local", "ray")}
        cells = cell_seconds(root / "ray" / "out")
    return [{"benchmark": f"compare {','.join(SCHEMES)} --ray (2 nodes x 1 CPU) vs local", "ours_s": round(ray_s, 2),
             "peer": "the same compare without --ray", "peer_s": round(local_s, 2),
             "ratio": round(local_s / ray_s, 3), "target": "results equal; Ray's scheduling overhead small",
             "ok": agree(docs["local"], docs["ray"]), "cluster_up_s": round(up_s, 1),
             "cells_s": {s: round(v, 1) for s, v in cells.items()}, "catalog_warmup_s": round(catalog_s, 1),
             "load": [round(load0, 2), round(load1, 2)], "windows": windows,
             "note": f"cluster bring-up {up_s:.1f} s (outside both times); cells on Ray "
                     + ", ".join(f"{s} {v:.0f} s" for s, v in cells.items())}]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    row = run(args.quick, args.max_windows)[0]
    print(f"cores: {os.cpu_count()}; load average {row['load'][0]:.2f} -> {row['load'][1]:.2f}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"compare --ray: {row['ours_s']:.1f} s; local compare: {row['peer_s']:.1f} s; "
          f"ratio (local / ray) {row['ratio']:.2f}; {row['note']}; results equal: {row['ok']}")
    print(json.dumps(row, indent=1))
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
