"""CLI start-up: `quark-ptq-eval --help` and `status` against the 0.5 s target and `quark-cli --help`.

Each command runs as a fresh process (the way a user types it); the figure is the median wall
time of N runs. The peer, `quark-cli --help`, imports ``quark.torch`` and its ONNX commands at
start-up (tens of seconds), so it runs once. A fresh interpreter then calls our ``main()``
in-process for ``--help`` and ``status`` and lists which heavy modules (torch, quark,
transformers, lm_eval, datasets) ended up in ``sys.modules``: the target is none.

``ratio`` is peer time / our time (above 1: we are faster). Run: ``python -m bench.benchmarks.bench_startup
[--runs N] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 0.5
HEAVY = ("torch", "quark", "transformers", "lm_eval", "datasets")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

# Runs in a fresh interpreter: our main() in-process, then the heavy modules it left loaded.
IMPORT_PROBE = """
import contextlib, io, json, sys
from quark_ptq_eval.cli.main import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        main(json.loads(sys.argv[1]))
    except SystemExit:
        pass
heavy = tuple(json.loads(sys.argv[2]))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
"""


def our_cli() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m quark_ptq_eval``."""
    script = Path(sys.executable).parent / "quark-ptq-eval"
    return [str(script)] if script.exists() else [sys.executable, "-m", "quark_ptq_eval"]


def wall(argv: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return seconds


def median_wall(argv: list[str], runs: int) -> float:
    wall(argv)  # one untimed run: page cache and .pyc files warm, as for a user's second call
    return statistics.median(wall(argv) for _ in range(runs))


def heavy_imports(cli_args: list[str]) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", IMPORT_PROBE, json.dumps(cli_args), json.dumps(HEAVY)],
                          env=ENV, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peer_help() -> tuple[str, float | None]:
    """``quark-cli --help``, once (it imports quark.torch)."""
    cli = Path(sys.executable).parent / "quark-cli"
    if not cli.exists():
        return "quark-cli --help (not installed)", None
    try:
        return "quark-cli --help (1 run)", wall([str(cli), "--help"])
    except RuntimeError as exc:
        return f"quark-cli --help (failed: {str(exc)[-120:]})", None


def _row(name: str, ours_s: float, peer: str, peer_s: float | None, heavy: list[str], runs: int,
         floor_s: float) -> dict:
    ok = ours_s < TARGET_S and not heavy
    note = f"median of {runs}; bare interpreter {floor_s:.3f} s; heavy imports: {', '.join(heavy) or 'none'}"
    return {"benchmark": name, "ours_s": round(ours_s, 3), "peer": peer,
            "peer_s": round(peer_s, 3) if peer_s is not None else None,
            "ratio": round(peer_s / ours_s, 1) if peer_s is not None else None,
            "target": f"ours < {TARGET_S} s, no {'/'.join(HEAVY)} import", "ok": ok, "note": note,
            "heavy_imports": heavy}


def stopped_run(workdir: Path) -> Path:
    """A work dir whose run stopped at checkpoint 2 (what `status` reads most often)."""
    state = {"options": {"model": "/models/tiny", "output_dir": "/models/tiny-int8"},
             "approvals": {"intake": "0123456789abcdef"},
             "steps": {"intake": {"status": "done", "at": "2026-01-01T00:00:00+0000"},
                       "plan": {"status": "done", "at": "2026-01-01T00:00:01+0000"}},
             "waiting_for": "plan"}
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "run_state.json").write_text(json.dumps(state), encoding="utf-8")
    return workdir


def run(quick: bool, runs: int | None = None) -> list[dict]:
    runs = runs or (3 if quick else 11)
    cli = our_cli()
    floor_s = median_wall([sys.executable, "-c", "pass"], runs)
    with tempfile.TemporaryDirectory(prefix="qpe-bench-startup-") as tmp:
        stopped = str(stopped_run(Path(tmp) / "stopped"))
        cases = [("quark-ptq-eval --help", ["--help"]),
                 ("quark-ptq-eval status (empty work dir)", ["status", "--workdir", tmp]),
                 ("quark-ptq-eval status (run stopped at a gate)", ["status", "--workdir", stopped])]
        timed = [(name, args, median_wall([*cli, *args], runs), heavy_imports(args)) for name, args in cases]
    peer, peer_s = peer_help()
    return [_row(name, ours_s, peer, peer_s, heavy, runs, floor_s) for name, _, ours_s, heavy in timed]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=None, help="timed runs per command (default 11; 3 with --quick)")
    p.add_argument("--quick", action="store_true", help="fewer runs")
    args = p.parse_args(argv)
    rows = run(args.quick, args.runs)
    print(f"cores: {os.cpu_count()}; fresh process per run, median; ratio = peer_s / ours_s")
    for r in rows:
        peer = f"{r['peer_s']:.2f} s" if r["peer_s"] is not None else "n/a"
        ratio = f"{r['ratio']}x" if r["ratio"] is not None else "n/a"
        print(f"{r['benchmark']:<44} {r['ours_s']:.3f} s  vs {r['peer']}: {peer} ({ratio}); "
              f"{'met' if r['ok'] else 'MISSED'}: {r['target']}\n    {r['note']}")


if __name__ == "__main__":
    main()
