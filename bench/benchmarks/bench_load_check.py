"""The load check over real exports: healthy ones must pass, planted loader-level faults must fail.

For each export of the family matrix (``python -m bench.docgen.matrix`` leaves them under
``.matrix/cells/<family>/<column>/out.partial``), the full validation with the load check runs
twice: on the export as Quark wrote it, and on a copy with one module's weight scale multiplied
by 4 in the file (headers, layout and the unquantized tensors' bytes all unchanged: only the load
check could see it; since the decode check it fails there first). Prints one line per export and a
summary; the numbers behind ``loadlimits.HEALTHY`` (the limit per weight format). Run: ``python -m bench.benchmarks.bench_load_check [--families a,b] [--columns fp8]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parents[2]


def plant_scale_fault(export: Path, work: Path) -> tuple[Path, str] | None:
    """A copy of ``export`` with the first layer-0 weight scale read as 4x (an E8M0 exponent + 2)."""
    import torch
    from safetensors.torch import load_file, save_file

    copy = work / "faulty"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(export, copy)
    for shard in sorted(copy.glob("*.safetensors")):
        tensors = load_file(shard)
        names = sorted(n for n in tensors if n.endswith("weight_scale") and ".0." in n)
        if not names:
            continue
        name = names[0]
        scale = tensors[name]
        tensors[name] = scale + 2 if scale.dtype == torch.uint8 else scale * 4
        save_file(tensors, shard, metadata={"format": "pt"})
        return copy, name.removesuffix(".weight_scale")
    return None


def load_stats(report) -> dict:
    check, calibration, decode = report.check("load"), report.check("calibration"), report.check("decode")
    findings = [f for c in (decode, calibration, check) for f in c.findings if not f.benign]
    return {"status": check.status, **check.stats, "uncalibrated": calibration.stats.get("uncalibrated", 0),
            "decode": decode.status, "decode_worst_steps": decode.stats.get("worst_steps"),
            "verdict": "fail" if any(c.status == "fail" for c in report.checks) else "pass",
            "findings": [f"{f.subject}: {f.message}" for f in findings][:2]}


def main(argv: list[str] | None = None) -> None:
    from quark_ptq_eval.validate import validate_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default=str(ROOT / ".matrix"))
    p.add_argument("--families", help="comma-separated model types (default: every one with exports)")
    p.add_argument("--columns", help="comma-separated columns (default: all)")
    p.add_argument("--no-faults", action="store_true", help="healthy exports only")
    p.add_argument("--json", help="write every row here")
    args = p.parse_args(argv)
    cells = sorted(Path(args.work, "cells").glob("*/*/out.partial/config.json"))
    want_f = set(args.families.split(",")) if args.families else None
    want_c = set(args.columns.split(",")) if args.columns else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in cells:
            export = config.parent
            family, column = export.parent.parent.name, export.parent.name
            if (want_f and family not in want_f) or (want_c and column not in want_c):
                continue
            source = Path(args.work, "models", family)
            plan = json.loads((export.parent / "quant_plan.json").read_text())
            row = {"family": family, "column": column,
                   "healthy": load_stats(validate_model(source, export, plan, load_check=True))}
            planted = None if args.no_faults else plant_scale_fault(export, Path(tmp))
            if planted:
                row["fault_module"] = planted[1]
                row["faulty"] = load_stats(validate_model(source, planted[0], plan, load_check=True))
            rows.append(row)
            h, f = row["healthy"], row.get("faulty", {})
            print(f"{family:18s} {column:11s} healthy {h['status']:7s} max {h.get('max_module_error', '-')!s:8s} "
                  f"agree {h.get('greedy_agreement', '-')!s:7s} loader {h.get('loader', '-'):12s} | scale x4 "
                  f"{f.get('status', '-'):7s} max {f.get('max_module_error', '-')!s:8s} {(f or h)['findings'][:1]}", flush=True)
    summarize(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def summarize(rows: list[dict]) -> None:
    healthy = [r["healthy"] for r in rows]
    faulty = [r["faulty"] for r in rows if "faulty" in r]
    inf = float("inf")  # a non-finite output is None in the stats (JSON has no infinity)
    errs = [inf if h["max_module_error"] is None else h["max_module_error"] for h in healthy if "max_module_error" in h]
    ferrs = [inf if f["max_module_error"] is None else f["max_module_error"] for f in faulty if "max_module_error" in f]
    uncalibrated = sum(h["uncalibrated"] > 0 for h in healthy)
    print(f"healthy exports: {sum(h['status'] == 'pass' for h in healthy)}/{len(healthy)} pass; largest module "
          f"error {max(errs, default=float('nan')):.4f}; greedy agreement below 60 % on "
          f"{sum(h.get('greedy_agreement', 1) < 0.6 for h in healthy)}; {uncalibrated} fail before the load check "
          "on activation scales calibration never set")
    if faulty:
        print(f"planted scale x4: {sum(f['verdict'] == 'fail' for f in faulty)}/{len(faulty)} fail; smallest module "
              f"error {min(ferrs, default=float('nan')):.4f}")


if __name__ == "__main__":
    main()
