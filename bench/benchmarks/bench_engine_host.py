"""A fresh engine against one forked by the engine host (execute/engine_host.py): the same `run_command` of the
same Quark API engine command on a tiny trained Llama (int8, 8 calibration windows), interleaved, N runs each;
the median wall time and CPU of each, their ratio, and whether the exports are the same bytes. A fresh engine is
what every run pays without a host (and what `quark-cli` pays: it imports the same libraries). Prints the load.
Run: ``python -m bench.benchmarks.bench_engine_host [--runs N]``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _one(argv: list[str], log: Path, cwd: Path) -> tuple[float, float]:
    """(wall s, CPU s of the engine) of one run_command, in a process of its own (its children's CPU is counted
    there; a hosted engine is the host's child, so the host's CPU is read before and after instead)."""
    code = ("import json,sys,time,resource; from pathlib import Path; from quark_ptq_eval.execute.runner import "
            "run_command; t=time.perf_counter(); r=run_command(json.loads(sys.argv[1]), {}, Path(sys.argv[2]), "
            "Path(sys.argv[3]), echo=None); assert r.returncode == 0, r.tail[-5:]; "
            "u=resource.getrusage(resource.RUSAGE_CHILDREN); print(time.perf_counter()-t, u.ru_utime+u.ru_stime)")
    import json

    out = subprocess.run([sys.executable, "-c", code, json.dumps(argv), str(log), str(cwd)], env=ENV, check=True,
                         capture_output=True, text=True).stdout.split()
    return float(out[0]), float(out[1])


def _host_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime, stime, cutime, cstime


def _digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def measure(runs: int, work: Path) -> dict[str, list[tuple[float, float]]]:
    from quark_ptq_eval.flows.demo import build_corpus, build_tiny_model

    corpus = build_corpus(work / "corpus.txt")
    model = build_tiny_model(work / "tiny", corpus)
    sock = work / "host.sock"
    host = subprocess.Popen([sys.executable, "-m", "quark_ptq_eval.execute.engine_host", "--socket", str(sock)],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not sock.exists():
        time.sleep(0.2)
    times: dict[str, list[tuple[float, float]]] = {"fresh": [], "hosted": []}
    digests = set()
    try:
        for i in range(runs):
            for kind in times:
                out = work / f"{kind}-{i}"
                argv = [sys.executable, "-m", "quark_ptq_eval.execute.quark_api_engine", "--model_dir", str(model),
                        "--output_dir", str(out), "--quant_scheme", "int8", "--calib_data", str(corpus),
                        "--num_calib_data", "8", "--seq_len", "64"]
                ENV.pop("QUARK_PTQ_EVAL_ENGINE_HOST", None)
                if kind == "hosted":
                    ENV["QUARK_PTQ_EVAL_ENGINE_HOST"] = str(sock)
                before = _host_cpu(host.pid)
                wall, cpu = _one(argv, work / f"{kind}-{i}.log", work)
                times[kind].append((wall, cpu + _host_cpu(host.pid) - before))
                digests.add(_digest(out))
    finally:
        host.terminate()
        host.wait()
    assert len(digests) == 1, "the exports differ"
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        times = measure(args.runs, Path(tmp))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    print("| engine | wall s (median) | CPU s (median) |\n|---|---:|---:|")
    for kind, (wall, cpu) in med.items():
        print(f"| {kind} | {wall:.2f} | {cpu:.2f} |")
    print(f"hosted / fresh: wall {med['hosted'][0] / med['fresh'][0]:.2f}x, CPU {med['hosted'][1] / med['fresh'][1]:.2f}x; "
          f"the exports the same bytes in all {2 * args.runs} runs")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
