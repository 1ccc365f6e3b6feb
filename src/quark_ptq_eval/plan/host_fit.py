"""Does this host hold the plan (the engine at its peak, the output on disk, a Tier 1 evaluation)?
If not, what would: smaller calibration, no algorithm, more GPUs, the one-shard engine, another host.
The numbers come from the memory model (``resources.py``), the host's from ``host_memory.py``."""

from __future__ import annotations

import dataclasses
from typing import Any

from quark_ptq_eval.base.plan_records import DeviceStrategy
from quark_ptq_eval.base.sizes import gb
from quark_ptq_eval.context.preflight import HostEnv
from quark_ptq_eval.plan.host_memory import host_capacity
from quark_ptq_eval.plan.resources import (
    HEADROOM,
    QuantizeWorkload,
    engine_estimate,
    estimate_eval,
    estimate_eval_streamed,
    estimate_file2file,
    estimate_quantize,
    estimate_sequential,
    output_basis,
    output_bytes,
)


def _fits(est: dict[str, Any], host: dict[str, Any], device: DeviceStrategy) -> bool:
    ram = host["ram_bytes"]
    gpu = host["gpu_bytes_per_device"] * (host["gpu_count"] if device.multi_device else 1)
    return ((not ram or est["host_peak_bytes"] <= ram * HEADROOM)
            and (not est["gpu_peak_bytes"] or not gpu or est["gpu_peak_bytes"] <= gpu * HEADROOM))


def engine_for_host(work: QuantizeWorkload, engine: str, why: str, requested: str, env: HostEnv) -> tuple[str, str]:
    """The plan's engine once this host's memory is known: when the automatic choice's whole-model engine does not
    fit, file-to-file where it fits and can serve the plan, else the sequential engine where it fits
    (docs/planning.md)."""
    from quark_ptq_eval.plan.engines import block_engine, shard_engine

    info, algorithm, kv, device = work.info, work.algorithm, work.kv, work.device
    for fallback in (shard_engine(), block_engine()):
        if fallback is not None and requested == fallback.name:
            why_not = fallback.unsupported_reason(info, algorithm, kv)
            if why_not:
                raise fallback.refusal(why_not)
            return engine, why
    host = host_capacity(env, None)
    whole = estimate_quantize(work.analysis, info, algorithm, work.calibration, device.device)
    if requested != "auto" or _fits(whole, host, device):
        return engine, why
    key, have = (("gpu_peak_bytes", host["gpu_bytes_per_device"]) if whole["gpu_peak_bytes"]
                 and not _fits({**whole, "host_peak_bytes": 0}, host, device) else ("host_peak_bytes", host["ram_bytes"]))
    where = "GPU memory" if key == "gpu_peak_bytes" else "RAM"
    needs = (f"the whole-model engine ({engine}) needs about {gb(whole[key])} of {where} at its peak and this host "
             f"has {gb(have)} (planning for at most {HEADROOM:.0%})")
    return _shard_choice(work, host, key, needs) or _block_choice(work, host, key, needs) or (engine, why)


def _shard_choice(work: QuantizeWorkload, host: dict[str, Any], key: str, needs: str) -> tuple[str, str] | None:
    from quark_ptq_eval.plan.engines import shard_engine
    from quark_ptq_eval.plan.source_reading import engine_reads_source

    shard = shard_engine()
    if (shard is None or shard.unsupported_reason(work.info, work.algorithm, work.kv)
            or not engine_reads_source(shard.name, work.analysis, work.device.device)):
        return None
    f2f = estimate_file2file(work.analysis, work.device.device)
    if not _fits(f2f, host, work.device):
        return None
    return shard.name, (f"{needs}; Quark's file-to-file quantization holds one shard at a time: about "
                        f"{gb(f2f[key])} (largest shard {gb(f2f['model_bytes'])}), and this scheme needs no calibration")


def _block_choice(work: QuantizeWorkload, host: dict[str, Any], key: str, needs: str) -> tuple[str, str] | None:
    from quark_ptq_eval.plan.engines import block_engine, shard_engine

    block, shard = block_engine(), shard_engine()
    if block is None or block.unsupported_reason(work.info, work.algorithm, work.kv):
        return None
    seq = estimate_sequential(work.analysis, work.algorithm, work.calibration)
    if not _fits(seq, host, work.device):
        return None
    f2f_why = shard.unsupported_reason(work.info, work.algorithm, work.kv) if shard else None
    f2f = (f"file-to-file cannot run this plan ({f2f_why})" if f2f_why
           else "file-to-file does not fit or read this source here")
    return block.name, (f"{needs}; {f2f}; the sequential engine runs Quark on one decoder block at a time: about "
                        f"{gb(seq['host_peak_bytes'])} (one block {gb(seq['model_bytes'])})")


def assess(work: QuantizeWorkload, host: dict[str, Any], rerun: list[str], engine: str | None = None) -> dict[str, Any]:
    """Does this host hold the engine, the output and a Tier 1 evaluation? If not, what would."""
    from quark_ptq_eval.plan.engines import holds_one_block, holds_one_shard

    analysis, scheme, info, algorithm, device = work.analysis, work.scheme, work.info, work.algorithm, work.device
    calibration = work.calibration

    est = engine_estimate(engine, analysis, info, algorithm, calibration, device.device)
    out = output_bytes(analysis, scheme, info)
    ev = estimate_eval(analysis, out)
    ev["with_baseline_bytes"] = estimate_eval(analysis, out, baseline=True)["host_peak_bytes"]
    ram = host["ram_bytes"]
    if ram and ev["with_baseline_bytes"] > ram * HEADROOM:  # Tier 1 streams one block at a time here
        streamed = estimate_eval_streamed(analysis, out)
        ev = {**streamed, "with_baseline_bytes": streamed["host_peak_bytes"],
              "in_memory_bytes": ev["host_peak_bytes"], "in_memory_with_baseline_bytes": ev["with_baseline_bytes"]}
    problems = _problems(est, out, ev, host, device)
    fits = not any(p["blocking"] for p in problems)
    blocked = {p["what"] for p in problems if p["blocking"]}
    proposals = _disk_proposal(out, host, blocked)
    if blocked - {"disk"}:  # memory blocks: what would hold the engine (a disk alone needs none of these)
        proposals += _proposals(work, host, est, rerun)
        if not holds_one_shard(engine) and not holds_one_block(engine):
            proposals[-1:-1] = [*_file2file_proposal(work, host), *_sequential_proposal(work, host)]
    return {"quantize": est, "evaluate": ev, "output_bytes": out, "host": host, "output_basis": output_basis(analysis),
            "fits": fits, "problems": problems, "proposals": proposals}


def _problems(est: dict[str, Any], out: int, ev: dict[str, Any], host: dict[str, Any], device: DeviceStrategy) -> list[dict[str, Any]]:
    problems = []
    ram, gpu = host["ram_bytes"], host["gpu_bytes_per_device"] * (host["gpu_count"] if device.multi_device else 1)
    if ram and est["host_peak_bytes"] > ram * HEADROOM:
        problems.append({"blocking": True, "what": "host RAM",
                         "message": f"the engine needs about {gb(est['host_peak_bytes'])} of RAM at its peak; "
                                    f"this host has {gb(ram)} (planning for at most {HEADROOM:.0%})"})
    if est["gpu_peak_bytes"] and gpu and est["gpu_peak_bytes"] > gpu * HEADROOM:
        problems.append({"blocking": True, "what": "GPU memory",
                         "message": f"the engine needs about {gb(est['gpu_peak_bytes'])} of GPU memory; "
                                    f"{'all GPUs' if device.multi_device else 'one GPU'} here hold {gb(gpu)}"})
    if host["disk_free_bytes"] is not None and out > host["disk_free_bytes"]:
        problems.append({"blocking": True, "what": "disk",
                         "message": f"the output needs about {gb(out)} on disk; {gb(host['disk_free_bytes'])} is free"})
    if ram and ev["host_peak_bytes"] > ram * HEADROOM:
        problems.append({"blocking": False, "what": "evaluation RAM",
                         "message": f"a Tier 1 evaluation here needs about {gb(ev['host_peak_bytes'])} of RAM "
                                    f"(more with the baseline); this host has {gb(ram)}"})
    avail = host.get("ram_available_bytes")
    if ram and avail and avail < est["host_peak_bytes"] <= ram * HEADROOM:
        problems.append({"blocking": False, "what": "RAM in use", "live": True,
                         "message": f"only {gb(avail)} of RAM is free right now (other processes); "
                                    f"the engine needs about {gb(est['host_peak_bytes'])}"})
    return problems


def _disk_proposal(out: int, host: dict[str, Any], blocked: set[str]) -> list[dict[str, Any]]:
    """The output does not fit the disk: another output directory, on a disk that holds it (the engine's memory
    has nothing to do with it, so no memory proposal is made for a disk alone)."""
    if "disk" not in blocked:
        return []
    return [{"change": "-o on another disk",
             "detail": f"-o on a disk with at least {gb(out)} free (the output's disk has "
                       f"{gb(host['disk_free_bytes'])}); the plan's memory is not the problem"
                       if blocked == {"disk"} else f"-o on a disk with at least {gb(out)} free"}]


def _proposals(work: QuantizeWorkload, host: dict[str, Any], est: dict[str, Any], rerun: list[str]) -> list[dict[str, Any]]:
    """Concrete changes with their estimates: smaller calibration, no algorithm, GPUs, another host."""
    analysis, info, algorithm, calibration, device = work.analysis, work.info, work.algorithm, work.calibration, work.device
    ram = host["ram_bytes"] or 0
    out: list[dict[str, Any]] = []

    def variant(change: str, algo: str | None, num_samples: int = 0, seq_len: int = 0) -> None:
        calib = dataclasses.replace(calibration, num_samples=num_samples or calibration.num_samples,
                                    seq_len=seq_len or calibration.seq_len)
        e = estimate_quantize(analysis, info, algo, calib, device.device)
        if e["host_peak_bytes"] < 0.95 * est["host_peak_bytes"]:
            fits = "fits" if not ram or e["host_peak_bytes"] <= ram * HEADROOM else "still too much"
            out.append({"change": change, "detail": f"{change}: about {gb(e['host_peak_bytes'])} ({fits})"})

    if calibration.num_samples > 16:
        variant(f"--num-calib-samples {max(16, calibration.num_samples // 4)}", algorithm,
                num_samples=max(16, calibration.num_samples // 4))
    if calibration.seq_len > 256:
        variant("--calib-seq-len 256", algorithm, seq_len=256)
    if algorithm:
        variant("--algorithm '' (plain PTQ)", None)
    if device.device == "cuda" and host["gpu_count"] > 1 and not device.multi_device:
        out.append({"change": "--multi-device", "detail": f"--multi-device: spread the model over the "
                                                          f"{host['gpu_count']} GPUs here"})
    gpu_est = estimate_quantize(analysis, info, algorithm, calibration, "cuda")
    need_ram = est["host_peak_bytes"] / HEADROOM
    out.append({"change": "another host", "command": " ".join(rerun),
                "detail": f"a host with at least {gb(need_ram)} of RAM, or a GPU host (about "
                          f"{gb(gpu_est['gpu_peak_bytes'])} of GPU memory and {gb(gpu_est['host_peak_bytes'])} of "
                          f"RAM); run there: {' '.join(rerun)}"})
    return out


def _file2file_proposal(work: QuantizeWorkload, host: dict[str, Any]) -> list[dict[str, Any]]:
    """Quark's file-to-file engine with its estimate, when it can serve this plan (a proposal must work)."""
    from quark_ptq_eval.plan.engines import shard_engine
    from quark_ptq_eval.plan.source_reading import engine_reads_source

    analysis, info, algorithm, kv, device = work.analysis, work.info, work.algorithm, work.kv, work.device

    shard, no_kv = shard_engine(), ""
    if shard is None:
        return []
    if shard.unsupported_reason(info, algorithm, kv):
        if not (kv and not shard.unsupported_reason(info, algorithm, None)):
            return []
        no_kv = " --kv-cache-scheme ''"  # file-to-file never runs the model, so it calibrates no KV scales
    if not engine_reads_source(shard.name, analysis, device.device):
        if not engine_reads_source(shard.name, analysis, "cuda"):
            return []
        e = estimate_file2file(analysis, "cuda")
        return [{"change": f"--engine {shard.name} --device cuda{no_kv} (a GPU host)",
                 "detail": f"on a GPU host, Quark's file-to-file engine recovers the FP8 weights itself, one shard "
                           f"at a time: about {gb(e['gpu_peak_bytes'])} of GPU memory and {gb(e['host_peak_bytes'])} "
                           f"of RAM (this host has no GPU for its FP8 kernel)"
                           + ("; without the KV-cache scheme, whose scales need calibration" if no_kv else "")}]
    e = estimate_file2file(analysis, device.device)
    fits = "fits" if _fits(e, host, device) else "still too much"
    return [{"change": f"--engine {shard.name}{no_kv}", "detail": f"--engine {shard.name}{no_kv}: one shard at a time, "
                                                               f"about {gb(e['host_peak_bytes'])} ({fits})"}]



def _sequential_proposal(work: QuantizeWorkload, host: dict[str, Any]) -> list[dict[str, Any]]:
    """The sequential engine with its estimate, when it can serve this plan; where the plan's calibration keeps it
    over the host, also the most calibration samples with which it fits (its hidden states grow with them)."""
    from quark_ptq_eval.plan.engines import block_engine

    block = block_engine()
    if block is None or block.unsupported_reason(work.info, work.algorithm, work.kv):
        return []
    e = estimate_sequential(work.analysis, work.algorithm, work.calibration)
    fits = _fits(e, host, work.device)
    said = [{"change": f"--engine {block.name}", "detail": f"--engine {block.name}: one decoder block at a time, "
                                                          f"about {gb(e['host_peak_bytes'])} "
                                                          f"({'fits' if fits else 'still too much'})"}]
    fewer = None if fits else _samples_that_fit(work, host)
    if fewer:
        change = f"--engine {block.name} --num-calib-samples {fewer[0]}"
        said.append({"change": change, "detail": f"{change}: about {gb(fewer[1]['host_peak_bytes'])} (fits)"})
    return said


def _samples_that_fit(work: QuantizeWorkload, host: dict[str, Any], least: int = 8) -> tuple[int, dict[str, Any]] | None:
    """The most calibration samples (halving from the plan's, not below ``least``) with which the sequential engine
    fits this host, with its estimate then; None where even ``least`` does not."""
    samples = work.calibration.num_samples // 2
    while samples >= least:
        e = estimate_sequential(work.analysis, work.algorithm, dataclasses.replace(work.calibration, num_samples=samples))
        if _fits(e, host, work.device):
            return samples, e
        samples //= 2
    return None
