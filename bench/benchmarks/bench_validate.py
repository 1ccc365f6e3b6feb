"""The validator at disk speed: our checks against Quark's helper on one synthetic sharded model.

Builds (in a temp dir, deleted afterwards) a multi-GB sharded source model written with
``safetensors`` from random data, plus a "quantized" twin whose excluded tensors (``lm_head``,
``*o_proj``) are byte copies and whose other linears are int8 with scales, as a Quark export
lays them out. Each timed run starts from a cold page cache for the files involved
(``posix_fadvise(DONTNEED)``), so all contenders read from the same place; repeated contenders
run interleaved (ours, peer, read, ours, ...) and report medians, so load changes hit all alike. Prints, in one run:

- the full byte check (every tensor that must not change: embeddings, norms, excluded layers,
  lm_head) vs Quark's ``check_non_quantized_tensors_md5_unchanged`` on the same tensors (target >= 2x),
- the same byte check vs reading the same byte ranges once, ``cat > /dev/null`` style (target within 1.5x),
- the whole validation (every registry check but the load check) vs Quark's four helpers,
- header checks on a 100-shard model: ours (layout, both sides) vs Quark's fuzzy summary (target < 1 s),
- ``import quark_ptq_eval.validate`` in a fresh interpreter (target < 0.5 s, no heavy module).

``ratio`` is peer time / our time (above 1: we are faster). Run: ``python -m bench.benchmarks.bench_validate
[--size-gb 2] [--workers N] [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

HELPER = (Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
          / "quark/_bundled_skills/_legacy_impl/l1-atomic/torch/quark-torch-result-validator/quant_validation.py")
HIDDEN = 2048
VOCAB = 32000
SHARD_BYTES = 256 * 1024 * 1024
EXCLUDE = ["lm_head", "*o_proj"]
# Everything the twin leaves unquantized, as Quark-helper exclude globs: the same tensor set ours compares.
UNCHANGED = [*EXCLUDE, "model.embed_tokens", "*input_layernorm"]
INT8_PER_TENSOR = {"dtype": "int8", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True,
                   "ch_axis": None, "group_size": None, "is_scale_quant": False, "scale_type": "float"}


# --- synthetic model ------------------------------------------------------------------------------

def _random(rng, shape: tuple[int, ...], dtype):
    import numpy as np

    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(rng.bytes(n), dtype=dtype).reshape(shape)


def _layer_tensors(rng, i: int, hidden: int) -> tuple[dict, dict]:
    """One decoder layer: an excluded o_proj (copied) and an int8 up_proj in the twin."""
    import numpy as np

    o_proj = _random(rng, (hidden, hidden), np.float16)
    # up_proj: finite weights, quantized round-to-nearest per tensor as Quark does (the decode check holds it)
    up = (rng.standard_normal((hidden // 2, hidden), dtype=np.float32) * 0.02).astype(np.float16)
    scale = np.float32(np.abs(up).max()) / np.float32(127)
    src = {f"model.layers.{i}.self_attn.o_proj.weight": o_proj,
           f"model.layers.{i}.mlp.up_proj.weight": up,
           f"model.layers.{i}.input_layernorm.weight": _random(rng, (hidden,), np.float16)}
    out = {f"model.layers.{i}.self_attn.o_proj.weight": o_proj,
           f"model.layers.{i}.mlp.up_proj.weight": np.clip(np.rint(up.astype(np.float32) / scale), -128, 127)
           .astype(np.int8),
           f"model.layers.{i}.mlp.up_proj.weight_scale": np.array(scale, np.float32),
           f"model.layers.{i}.mlp.up_proj.weight_zero_point": np.zeros((), np.int8),
           f"model.layers.{i}.input_layernorm.weight": src[f"model.layers.{i}.input_layernorm.weight"]}
    return src, out


def _write_model_pair(root: Path, size_bytes: int, hidden: int, vocab: int, shard_bytes: int) -> tuple[Path, Path]:
    import numpy as np
    from safetensors.numpy import save_file

    source, twin = root / "source", root / "quantized"
    rng = np.random.default_rng(0)
    head = _random(rng, (vocab, hidden), np.float16)
    embed = _random(rng, (vocab, hidden), np.float16)
    per_layer = 3 * hidden * hidden + 2 * hidden
    n_layers = max(1, (size_bytes - 2 * head.nbytes) // per_layer)
    shards: list[tuple[dict, dict]] = [({"model.embed_tokens.weight": embed, "lm_head.weight": head},
                                        {"model.embed_tokens.weight": embed, "lm_head.weight": head})]
    for i in range(n_layers):
        src, out = _layer_tensors(rng, i, hidden)
        if sum(a.nbytes for a in shards[-1][0].values()) + per_layer > shard_bytes:
            shards.append(({}, {}))
        shards[-1][0].update(src)
        shards[-1][1].update(out)
    for model_dir, side in ((source, 0), (twin, 1)):
        _save_sharded(model_dir, [pair[side] for pair in shards], save_file)
    _write_small_files(source, twin, n_layers, hidden, vocab)
    return source, twin


def _save_sharded(model_dir: Path, shards: list[dict], save_file) -> None:
    model_dir.mkdir(parents=True)
    weight_map = {}
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(model_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _write_small_files(source: Path, twin: Path, layers: int, hidden: int, vocab: int) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
              "hidden_size": hidden, "vocab_size": vocab, "dtype": "float16", "transformers_version": "5.0.0"}
    qconfig = {"quant_method": "quark", "exclude": EXCLUDE, "layer_quant_config": {},
               "global_quant_config": {"weight": INT8_PER_TENSOR, "input_tensors": None, "output_tensors": None}}
    (source / "config.json").write_text(json.dumps(config))
    (twin / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    tokenizer = json.dumps({"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(vocab)}, "merges": []}})
    for model_dir in (source, twin):
        (model_dir / "tokenizer.json").write_text(tokenizer)
        (model_dir / "README.md").write_text("synthetic benchmark model\n")


def _write_many_shards(root: Path, shards: int, layers_per_shard: int) -> tuple[Path, Path]:
    """A 100-shard pair with small tensors: what matters here is header size and count."""
    import numpy as np
    from safetensors.numpy import save_file

    source, twin = root / "source100", root / "quantized100"
    rng = np.random.default_rng(1)
    pairs, layer = [], 0
    for _ in range(shards):
        src, out = {}, {}
        for _ in range(layers_per_shard):
            s, o = _layer_tensors(rng, layer, 16)
            src.update(s)
            out.update(o)
            layer += 1
        pairs.append((src, out))
    for model_dir, side in ((source, 0), (twin, 1)):
        _save_sharded(model_dir, [p[side] for p in pairs], save_file)
    _write_small_files(source, twin, layer, 16, 64)
    return source, twin


# --- timing ---------------------------------------------------------------------------------------

def evict(*dirs: Path) -> None:
    """Drop these files from the page cache so every contender starts cold."""
    for model_dir in dirs:
        for path in model_dir.iterdir():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn, *dirs: Path) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of all threads, result) of one run from a cold page cache."""
    evict(*dirs)
    c0, t0 = _cpu(), time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, _cpu() - c0, value


def interleaved(contenders: dict, dirs: tuple[Path, ...], repeat: int) -> dict[str, tuple[float, float, object]]:
    """Run the contenders in turn ``repeat`` times (load changes hit all alike); median per contender."""
    runs: dict[str, list] = {name: [] for name in contenders}
    for _ in range(repeat):
        for name, fn in contenders.items():
            runs[name].append(timed(fn, *dirs))
    return {name: sorted(r, key=lambda x: x[0])[len(r) // 2] for name, r in runs.items()}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def read_ranges_once(ranges: list[tuple[Path, int, int]], block: int = 1024 * 1024) -> int:
    """``cat > /dev/null`` of exactly these byte ranges: one reader, sequential blocks."""
    buf = bytearray(block)
    total = 0
    for path, start, end in ranges:
        with open(path, "rb", buffering=0) as fh:
            fh.seek(start)
            left = end - start
            while left > 0:
                n = fh.readinto(memoryview(buf)[: min(block, left)])
                if not n:
                    break
                total += n
                left -= n
    return total


def load_quark_helper():
    spec = importlib.util.spec_from_file_location("quark_quant_validation_peer", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quiet(fn):
    """Run one of Quark's helpers with its per-tensor stderr log discarded (as a pipe would)."""
    def run():
        with contextlib.redirect_stderr(io.StringIO()):
            return fn()
    return run


def bench_md5(source: Path, twin: Path, workers: int | None, repeat: int) -> list[dict]:
    from quark_ptq_eval.base.safetensors_io import read_model_headers
    from quark_ptq_eval.validate.byte_identity import Sampling, compare_tensors, excluded_candidates

    qv = load_quark_helper()
    src_h, out_h = read_model_headers(source), read_model_headers(twin)
    names = excluded_candidates(src_h, UNCHANGED, False)
    nbytes = sum(src_h[n].nbytes for n in names)
    ranges = [(h[n].file, h[n].start, h[n].end) for n in names for h in (src_h, out_h)]
    res = interleaved({
        "ours": lambda: compare_tensors(src_h, out_h, names, sampling=Sampling(workers=workers)),
        "quark": quiet(lambda: qv.check_non_quantized_tensors_md5_unchanged(
            source, twin, {"exclude": UNCHANGED, "max_samples": len(names)})),
        "read": lambda: read_ranges_once(ranges),
    }, (source, twin), repeat)
    (ours_s, ours_cpu, ours), (peer_s, peer_cpu, peer), (read_s, read_cpu, read) = res["ours"], res["quark"], res["read"]
    assert ours.status == "pass", ours.findings[:3]
    assert peer["ok"] and peer["checked_count"] == len(names) and read == 2 * nbytes
    gb = 2 * nbytes / 1e9
    return [
        _row(f"byte check, every unchanged tensor ({len(names)} tensors, {gb:.2f} GB read)", ours_s,
             "quark check_non_quantized_tensors_md5_unchanged", peer_s, target="ratio >= 2", gb=gb,
             cpu=(ours_cpu, peer_cpu), ok=peer_s / ours_s >= 2),
        _row("byte check vs reading the same byte ranges once", ours_s, "single read (cat > /dev/null)", read_s,
             target="ratio >= 0.667 (within 1.5x)", gb=gb, cpu=(ours_cpu, read_cpu), ok=read_s / ours_s >= 1 / 1.5),
    ]


def bench_full(source: Path, twin: Path, workers: int | None) -> dict:
    from quark_ptq_eval.validate import validate_model

    qv = load_quark_helper()
    ours_s, _, report = timed(lambda: validate_model(source, twin, workers=workers), source, twin)
    assert report.status == "success", report.to_markdown()

    def quark_four():
        qv.get_fuzzy_tensor_names(source)
        qv.get_fuzzy_tensor_names(twin)
        qv.check_auxiliary_files_copied(source, twin)
        qv.check_config_json_equal_except_quantization(source / "config.json", twin / "config.json")
        return qv.check_non_quantized_tensors_md5_unchanged(source, twin, {"exclude": EXCLUDE, "max_samples": 10**9})

    peer_s, _, _ = timed(quiet(quark_four), source, twin)
    return _row("validate_model, every check but loading", ours_s, "quark's four helpers in sequence", peer_s)


def bench_headers(source: Path, twin: Path) -> dict:
    from quark_ptq_eval.base.safetensors_io import read_model_headers
    from quark_ptq_eval.validate.layout import LayoutInputs, check_layout

    qv = load_quark_helper()
    qconfig = json.loads((twin / "config.json").read_text())["quantization_config"]

    def ours():
        src_h, out_h = read_model_headers(source), read_model_headers(twin)
        return check_layout(LayoutInputs(src_h, out_h, qconfig, EXCLUDE, {}))

    res = interleaved({"ours": ours, "quark": quiet(lambda: (qv.get_fuzzy_tensor_names(source),
                                                              qv.get_fuzzy_tensor_names(twin)))},
                      (source, twin), repeat=3)
    (ours_s, _, layout), (peer_s, _, _) = res["ours"], res["quark"]
    assert layout.status == "pass", layout.findings[:3]
    tensors = layout.stats["source_tensors"] + layout.stats["output_tensors"]
    return _row(f"header checks, 100 shards x 2 ({tensors} tensors)", ours_s, "quark get_fuzzy_tensor_names x2",
                peer_s, target="ours < 1 s", ok=ours_s < 1.0)


def bench_import(repeat: int) -> dict:
    """A fresh interpreter importing the validator: median over ``repeat`` runs (was a test assertion)."""
    import subprocess

    code = ("import sys, time; t = time.perf_counter(); import quark_ptq_eval.validate; "
            "print(time.perf_counter() - t); "
            "print(sorted(m for m in ('torch', 'transformers', 'quark', 'numpy', 'tokenizers') if m in sys.modules))")
    runs, heavy = [], []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
        runs.append(float(out[0]))
        heavy = out[1]
    bare = min(_wall(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True)) for _ in range(3))
    ours = sorted(runs)[len(runs) // 2]
    return _row(f"import quark_ptq_eval.validate (median of {repeat}; heavy modules {heavy})", ours,
                "python -c pass (interpreter start, for scale)", bare, target="ours < 0.5 s, no heavy import",
                ok=ours < 0.5 and heavy == "[]")


def _wall(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _row(name: str, ours_s: float, peer: str, peer_s: float, target: str = "", gb: float | None = None,
         cpu: tuple[float, float] | None = None, ok: bool | None = None) -> dict:
    row = {"benchmark": name, "ours_s": round(ours_s, 3), "peer": peer, "peer_s": round(peer_s, 3),
           "ratio": round(peer_s / ours_s, 3), "target": target}
    if ok is not None:
        row["ok"] = ok
    if gb is not None:
        row["ours_gb_per_s"] = round(gb / ours_s, 3)
        row["peer_gb_per_s"] = round(gb / peer_s, 3)
    if cpu is not None:  # on a shared machine CPU seconds say more than wall time
        row["ours_cpu_s"], row["peer_cpu_s"] = round(cpu[0], 3), round(cpu[1], 3)
    return row


def run(quick: bool, size_gb: float | None = None, workers: int | None = None) -> list[dict]:
    size_gb = size_gb if size_gb is not None else (0.25 if quick else 2.0)
    with tempfile.TemporaryDirectory(prefix="qpe-bench-validate-") as tmp:
        root = Path(tmp)
        hidden = HIDDEN // 2 if quick else HIDDEN  # a quick model still has many excluded tensors
        source, twin = _write_model_pair(root, int(size_gb * 1e9), hidden, VOCAB, SHARD_BYTES)
        os.sync()
        rows = bench_md5(source, twin, workers, repeat=1 if quick else 3)
        rows.append(bench_full(source, twin, workers))
        shutil.rmtree(source)
        shutil.rmtree(twin)
        rows.append(bench_headers(*_write_many_shards(root, 100, 20)))
    rows.append(bench_import(3 if quick else 11))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=None, help="source model size (default 2; 0.25 with --quick)")
    p.add_argument("--workers", type=int, default=None, help="our MD5 threads (default: the validator's default)")
    p.add_argument("--quick", action="store_true", help="a small model, one repetition")
    args = p.parse_args(argv)
    rows = run(args.quick, args.size_gb, args.workers)
    print(f"cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}; cold page cache before every timed run; "
          "ratio = peer_s / ours_s")
    print(f"{'benchmark':<58} {'ours s':>8} {'peer s':>8} {'ratio':>7}  peer / target")
    for r in rows:
        rate = f" ({r['ours_gb_per_s']} vs {r['peer_gb_per_s']} GB/s)" if "ours_gb_per_s" in r else ""
        if "ours_cpu_s" in r:
            rate += f" [CPU s {r['ours_cpu_s']} vs {r['peer_cpu_s']}]"
        print(f"{r['benchmark']:<58} {r['ours_s']:>8.3f} {r['peer_s']:>8.3f} {r['ratio']:>6.2f}x  "
              f"{r['peer']}{rate}{'; target ' + r['target'] if r['target'] else ''}"
              f"{'' if 'ok' not in r else (' (met)' if r['ok'] else ' (MISSED)')}")


if __name__ == "__main__":
    main()
