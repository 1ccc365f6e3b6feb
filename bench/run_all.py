"""`make bench`: run every bench/benchmarks/bench_*.py and print one table of ratios against the peers.

Each module exposes ``run(quick: bool) -> list[dict]`` with rows {"benchmark", "ours_s", "peer",
"peer_s", "ratio"} (optionally "target", "ok", "note"). A module that fails to import or run
becomes one error row and the others still run. ``ratio`` is peer time / our time everywhere
(above 1: we are faster). All rows are also written to ``.bench/results.json`` (gitignored); with ``--only`` the
other modules' previous rows there are kept.
Run: ``python -m bench.run_all [--quick] [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent / "benchmarks"  # the doc generators and suite tools beside it are not run
RESULTS = BENCH_DIR.parents[1] / ".bench" / "results.json"
COLUMNS = ("benchmark", "ours", "peer", "peer time", "ratio", "target")


def discover(only: list[str] | None) -> list[str]:
    names = sorted(p.stem for p in BENCH_DIR.glob("bench_*.py"))
    if only:
        names = [n for n in names if n in only or n.removeprefix("bench_") in only]
    return names


def run_module(name: str, quick: bool) -> tuple[list[dict], float]:
    """The module's rows, or one error row; never raises."""
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(f"bench.benchmarks.{name}")
        rows = [dict(r, module=name, quick=quick) for r in module.run(quick=quick)]
    except Exception as exc:  # noqa: BLE001 - one broken benchmark must not hide the others
        traceback.print_exc(file=sys.stderr)
        rows = [{"module": name, "benchmark": f"{name}: ERROR", "ours_s": None, "peer": "", "peer_s": None,
                 "ratio": None, "target": "", "ok": False, "error": f"{type(exc).__name__}: {exc}"}]
    return rows, time.perf_counter() - t0


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"


def _cells(row: dict) -> list[str]:
    ratio = f"{row['ratio']:g}x" if row.get("ratio") is not None else "-"
    target = row.get("target") or ""
    if "ok" in row:
        target = f"{'met' if row['ok'] else 'MISSED'}: {target}" if target else ("met" if row["ok"] else "MISSED")
    if row.get("error"):
        target = row["error"][:100]
    return [str(row["benchmark"]), _seconds(row.get("ours_s")), str(row.get("peer") or ""),
            _seconds(row.get("peer_s")), ratio, target]


def table(rows: list[dict]) -> str:
    """A Markdown table (pastes into bench/README.md as is)."""
    cells = [list(COLUMNS), *(_cells(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def merged_with_previous(rows: list[dict], durations: dict[str, float]) -> tuple[list[dict], dict[str, float]]:
    """With --only: keep the previous results of the modules not run now."""
    try:
        old = json.loads(RESULTS.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return rows, durations
    kept = [r for r in old.get("rows", []) if r.get("module") not in durations]
    old_durations = {k: v for k, v in old.get("meta", {}).get("module_seconds", {}).items() if k not in durations}
    return kept + rows, {**old_durations, **durations}


def write_results(rows: list[dict], durations: dict[str, float], quick: bool) -> Path:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": quick, "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform(),
            "load_average": os.getloadavg(), "module_seconds": {k: round(v, 1) for k, v in durations.items()}}
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n", encoding="utf-8")
    return RESULTS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller inputs and fewer repetitions in every benchmark")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these modules (bench_startup or startup)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    rows: list[dict] = []
    durations: dict[str, float] = {}
    for name in discover(args.only):
        print(f"== {name} ...", file=sys.stderr, flush=True)
        module_rows, durations[name] = run_module(name, args.quick)
        rows += module_rows
    print(f"\ncores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}; ratio = peer time / our time "
          "(above 1: we are faster)\n")
    print(table(rows))
    if args.only:
        rows, durations = merged_with_previous(rows, durations)
    print(f"\nwritten: {write_results(rows, durations, args.quick)}")
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
