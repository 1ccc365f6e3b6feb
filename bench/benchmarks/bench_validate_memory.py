"""``validate`` on real-shape FP8 exports laid out as sparse files: wall time and peak RSS as the model grows.

Each case writes (``bench_real_size_plans.write_sparse``: real names, shapes and dtypes, payloads
left as holes that read as zeros) a BF16 Llama source of the published shape and the FP8 export
Quark writes of it (``F8_E4M3`` weights, per-tensor ``weight_scale`` and ``input_scale``, ``lm_head``
excluded): the scales are real non-zero values written into the holes, everything else reads as
zeros, so every check (the decode check decoding every weight against its source included) runs
in full on data that is right. Then ``quark-ptq-eval validate --no-load-check`` (``--load-check``: with
its defaults, the streamed load check included) runs in a child: its wall and CPU time, peak RSS (the
child's maximum resident set, from ``wait4``), each check's seconds and seconds per GB the decode check
reads, per worker count, printed with the load average before and after each run (the host is shared),
and its ratio to a cold read of every safetensors file of both checkpoints (``cold_read``, one reader
per core: the floor of any check that reads every byte). ``--limit-s`` stops
a run that would take too long (the 405 B case: ~1.2 TB read) and projects its wall time from the
share of the decode check's bytes read by then (``/proc/PID/io``).

    .venv/bin/python -m bench.benchmarks.bench_validate_memory [--work DIR] [--case 13b --case 70b ...] [--workers 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.benchmarks.bench_real_size_plans import BF16, F8, F32, llama_405b, write_sparse

FP8_SPEC = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True, "ch_axis": None,
            "group_size": None, "scale_format": None, "scale_type": "float", "observer_cls": "PerTensorMinMaxObserver",
            "round_method": "half_even", "is_scale_quant": False, "zero_point_type": "int32"}
QCONFIG = {"quant_method": "quark", "version": "0.13", "quant_mode": "eager_mode", "exclude": ["lm_head"],
           "export": {"pack_method": "reorder", "weight_format": "real_quantized", "kv_cache_group": [],
                      "min_kv_scale": 0.0, "weight_merge_groups": None},
           "global_quant_config": {"weight": FP8_SPEC, "input_tensors": FP8_SPEC, "output_tensors": None,
                                   "bias": None, "target_device": None},
           "layer_quant_config": {}, "layer_type_quant_config": {}, "kv_cache_quant_config": {}, "algo_config": None,
           "softmax_quant_spec": None, "kv_cache_post_rope": False}
WEIGHT_SCALE, INPUT_SCALE = 0.0625, 0.03125  # non-zero: a hole would read as a zero scale


def llama(h: int, inter: int, layers: int, heads: int, kv: int, vocab: int, shards: int):
    def shapes() -> tuple[dict, list[tuple[str, str, list[int]]], int]:
        hd = h // heads
        config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h,
                  "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
                  "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab, "tie_word_embeddings": False,
                  "torch_dtype": "bfloat16"}
        t = [("model.embed_tokens.weight", BF16, [vocab, h])]
        for n in range(layers):
            p = f"model.layers.{n}"
            t += [(f"{p}.input_layernorm.weight", BF16, [h]), (f"{p}.post_attention_layernorm.weight", BF16, [h]),
                  (f"{p}.self_attn.q_proj.weight", BF16, [heads * hd, h]),
                  (f"{p}.self_attn.k_proj.weight", BF16, [kv * hd, h]),
                  (f"{p}.self_attn.v_proj.weight", BF16, [kv * hd, h]),
                  (f"{p}.self_attn.o_proj.weight", BF16, [h, heads * hd]),
                  (f"{p}.mlp.gate_proj.weight", BF16, [inter, h]), (f"{p}.mlp.up_proj.weight", BF16, [inter, h]),
                  (f"{p}.mlp.down_proj.weight", BF16, [h, inter])]
        t += [("model.norm.weight", BF16, [h]), ("lm_head.weight", BF16, [vocab, h])]
        return config, t, shards
    return shapes


CASES = {  # name -> the published shape
    "probe": llama(1024, 2816, 2, 16, 4, 32000, 1),  # a quick run of the bench itself
    "13b": llama(5120, 13824, 40, 40, 40, 32000, 3),  # Llama-2-13B
    "70b": llama(8192, 28672, 80, 64, 8, 128256, 30),  # Llama-3.1-70B
    "405b": llama_405b,  # Llama-3.1-405B (bench_real_size_plans.py)
}


def fp8_export(tensors: list[tuple[str, str, list[int]]]) -> list[tuple[str, str, list[int]]]:
    """The export's tensors: each decoder linear in FP8 with its two scalar scales; the rest as is."""
    out = []
    for name, dtype, shape in tensors:
        module = name.removesuffix(".weight")
        if ".layers." in name and len(shape) == 2 and name.endswith("_proj.weight"):
            out += [(name, F8, shape), (f"{module}.weight_scale", F32, []), (f"{module}.input_scale", F32, [])]
        else:
            out.append((name, dtype, shape))
    return out


def fill_scales(model: Path) -> int:
    """Write the scales' real values into their holes; the count written."""
    import numpy as np

    from quark_ptq_eval.base.safetensors_io import read_model_headers

    count = 0
    for name, info in read_model_headers(model).items():
        if name.endswith(("weight_scale", "input_scale")):
            value = WEIGHT_SCALE if name.endswith("weight_scale") else INPUT_SCALE
            with open(info.file, "r+b") as fh:
                fh.seek(info.start)
                fh.write(np.float32(value).tobytes())
            count += 1
    return count


def build(name: str, work: Path) -> tuple[Path, Path, int]:
    """(source, export, elements the decode check decodes), written once per work dir."""
    config, tensors, shards = CASES[name]()
    source, export = write_pair(work, name, config, tensors, shards)
    decoded = sum(math.prod(s) for n, d, s in fp8_export(tensors) if d == F8)
    return source, export, decoded


def write_pair(work: Path, name: str, config: dict, tensors: list[tuple[str, str, list[int]]],
               shards: int) -> tuple[Path, Path]:
    """The BF16 source and its FP8 export as sparse files under ``work``, written once."""
    source, export = work / f"{name}-source", work / f"{name}-fp8"
    if not (source / "config.json").exists():
        write_sparse(source, config, tensors, shards)
    if not (export / "config.json").exists():
        write_sparse(export, {**config, "quantization_config": QCONFIG}, fp8_export(tensors), shards)
        fill_scales(export)
    return source, export


def copy_tokenizer(tokenizer: Path, folders: tuple[Path, ...]) -> None:
    """A checkpoint as shipped: its tokenizer's files beside the weights."""
    for folder in folders:
        for f in TOKENIZER_FILES:
            if (tokenizer / f).exists():
                shutil.copy(tokenizer / f, folder / f)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def tokenizer_dir(work: Path) -> Path:
    """The demo model's tokenizer (trained once, one step: only its files are used)."""
    from quark_ptq_eval.flows.demo import build_corpus, build_tiny_model

    out = work / "tokenizer"
    if not (out / "config.json").exists():
        build_tiny_model(out, build_corpus(work / "corpus.txt"), train_steps=1)
    return out


def _read_bytes(pid: int) -> int:
    """Bytes the child has read through read(2)/preadv(2) so far (the decode check's reads; the md5
    check maps its windows, so they do not count here)."""
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return 0
    match = re.search(r"^rchar: (\d+)", text, re.M)
    return int(match.group(1)) if match else 0


def run_validate(source: Path, export: Path, workers: int | None, work: Path, decode_bytes: int,
                 limit_s: float | None, load_check: bool = False) -> dict:
    """One ``validate`` child: wall, CPU and peak RSS (``wait4``'s ``ru_maxrss``); with ``limit_s``
    stopped there, with the share of the decode check's bytes read by then and the wall time projected.
    With ``load_check`` validate runs with its defaults (the load check streams a model this host cannot hold)."""
    argv = [sys.executable, "-m", "quark_ptq_eval", "validate", "--source", str(source), "--quantized", str(export),
            *([] if load_check else ["--no-load-check"]), "--workdir", str(work / "wd")]
    if workers:
        argv += ["--workers", str(workers)]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    logs = work / "validate-child.log"
    with open(logs, "w+") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        read, stopped, status, usage = 0, False, 0, None
        while usage is None:
            pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                usage = rusage
                break
            read = max(read, _read_bytes(proc.pid))
            if limit_s is not None and time.perf_counter() - t0 > limit_s and not stopped:
                proc.send_signal(signal.SIGTERM)
                stopped = True
            time.sleep(0.5)
        wall = time.perf_counter() - t0
        log.seek(0)
        out = log.read()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    if not stopped and proc.returncode:
        raise SystemExit(f"validate failed ({proc.returncode}):\n{out[-3000:]}")
    row = {"wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
           "peak_rss_mib": usage.ru_maxrss // 1024, "load": [round(load, 2), round(os.getloadavg()[0], 2)]}
    if stopped:
        share = min(1.0, read / decode_bytes)
        row.update(verdict=f"stopped after {limit_s:g} s", decode_share_read=round(share, 4),
                   projected_wall_s=round(wall / share) if share else None)
    else:
        row["verdict"] = next(line for line in out.splitlines() if line.startswith("Validation"))
        row["check_s"] = _check_seconds(work / "wd" / "validation_report.json")
    return row


def cold_read(folders: tuple[Path, ...], workers: int) -> float:
    """Seconds to read every file of ``folders`` once from a cold page cache, ``workers`` files at a time: the floor
    of any check that reads every byte (printed beside validate's wall time as their ratio)."""
    from concurrent.futures import ThreadPoolExecutor

    files = sorted((f for folder in folders for f in folder.iterdir() if f.suffix == ".safetensors"),
                   key=lambda f: -f.stat().st_size)

    def read(path: Path) -> int:
        buf = memoryview(bytearray(16 << 20))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total = 0
            while n := os.readv(fd, [buf]):
                total += n
            return total
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(read, files))
    return time.perf_counter() - t0


def _check_seconds(report: Path) -> dict[str, float]:
    """Each check's seconds, from the report validate wrote."""
    try:
        checks = json.loads(report.read_text()).get("checks", {})
    except (OSError, ValueError):
        return {}
    return {name: round(float(c.get("seconds") or 0), 1) for name, c in checks.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--case", choices=sorted(CASES), action="append")
    p.add_argument("--workers", type=int, nargs="+", default=[0], help="worker counts to run (0: the default)")
    p.add_argument("--load-check", action="store_true",
                   help="validate with its defaults, the load check included (the demo tokenizer copied beside the weights)")
    p.add_argument("--limit-s", type=float, default=None,
                   help="stop each run after this many seconds and project its wall time from the bytes read")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="validate-memory-"))
    for name in args.case or ["13b"]:
        source, export, decoded = build(name, work)
        if args.load_check:  # a checkpoint as shipped: its tokenizer beside the weights
            copy_tokenizer(tokenizer_dir(work), (source, export))
        read_gb = decoded * 3 / 1e9  # each FP8 code (1 byte) and its BF16 source (2 bytes)
        cold_s = cold_read((source, export), os.cpu_count() or 1)
        print(json.dumps({"case": name, "cold_read_both_s": round(cold_s, 1), "load": round(os.getloadavg()[0], 2)}),
              flush=True)
        for workers in args.workers:
            r = run_validate(source, export, workers or None, work, int(read_gb * 1e9), args.limit_s, args.load_check)
            r.update(case=name, workers=workers or "default", decoded_elements=decoded, decode_read_gb=round(read_gb, 1),
                     s_per_gb=round((r.get("projected_wall_s") or r["wall_s"]) / read_gb, 2),
                     over_cold_read=round((r.get("projected_wall_s") or r["wall_s"]) / cold_s, 2))
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
