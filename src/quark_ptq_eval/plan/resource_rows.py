"""The plan table's rows for memory and disk (each number with its basis), and the command that
reproduces the plan on another host (the "another host" proposal names it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quark_ptq_eval.base.plan_records import PlannedCalibration
from quark_ptq_eval.base.sizes import gb
from quark_ptq_eval.plan.resources import STREAM_STATE_BYTES, output_basis


def rerun_command(model: str, output_dir: Path | None, scheme: str, algorithm: str | None, kv: str | None,
                  calibration: PlannedCalibration, target: str | None) -> list[str]:
    """The `quark-ptq-eval run` command that reproduces this plan on a GPU host."""
    import shlex

    argv = ["quark-ptq-eval", "run", model, "-o", str(output_dir or "OUTPUT_DIR"), "--scheme", scheme,
            "--device", "cuda", "--num-calib-samples", str(calibration.num_samples),
            "--calib-seq-len", str(calibration.seq_len)]
    if algorithm:
        argv += ["--algorithm", algorithm]
    if kv:
        argv += ["--kv-cache-scheme", kv]
    if calibration.path:
        argv += ["--calib-data", calibration.path]
    if target:
        argv += ["--target", target]
    return [shlex.quote(a) for a in argv]


def decision_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The plan table's rows for memory and disk, each with the basis of its number."""
    q, host = res["quantize"], res["host"]
    ram = f"of {gb(host['ram_bytes'])}" if host["ram_bytes"] else "(host RAM unknown)"
    rows = [{"decision": "host memory (quantize)", "value": f"~{gb(q['host_peak_bytes'])} {ram}",
             "reason": f"peak RSS {q['basis']}: {', '.join(f'{k} {gb(v)}' for k, v in q['terms'].items() if v)} "
                       "(docs/planning.md)"}]
    if q["gpu_peak_bytes"]:
        rows.append({"decision": "GPU memory (quantize)", "value": f"~{gb(q['gpu_peak_bytes'])}",
                     "reason": f"{q['basis']}: weights, activations and algorithm caches on the device"})
    rows.append({"decision": "output size on disk", "value": f"~{gb(res['output_bytes'])}",
                 "reason": res.get("output_basis") or output_basis(None)})
    ev = res["evaluate"]
    if ev.get("streamed"):
        rows.append({"decision": "host memory (evaluate)", "value": f"~{gb(ev['host_peak_bytes'])}",
                     "reason": f"Tier 1 streamed one decoder block at a time, the baseline included (modelled: "
                               f"~{gb(ev['fixed_bytes'])} for start-up, one block of each model "
                               f"({gb(ev['block_bytes'])}) and a batch's logits, plus {gb(ev['per_window_bytes'])} "
                               f"per 2048-token window held, at most {gb(STREAM_STATE_BYTES)} of them at once); in "
                               f"memory it would need ~{gb(ev['in_memory_with_baseline_bytes'])}, more than this host"})
    else:
        rows.append({"decision": "host memory (evaluate)", "value": f"~{gb(ev['host_peak_bytes'])}",
                     "reason": f"Tier 1 (modelled): start-up, the model as loaded, {gb(ev['logits_bytes'])} of logits "
                               f"per batch; ~{gb(ev['with_baseline_bytes'])} with the baseline"})
    for p in res["problems"]:
        if p.get("live"):
            continue  # a reading of this moment (free RAM) is kept in resources, out of the approved table
        rows.append({"decision": f"does not fit: {p['what']}" if p["blocking"] else f"warning: {p['what']}",
                     "value": "STOP" if p["blocking"] else "note", "reason": p["message"]})
    for p in res["proposals"]:
        rows.append({"decision": "proposal", "value": p["change"], "reason": p["detail"]})
    return rows

