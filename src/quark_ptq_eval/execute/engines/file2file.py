"""The file2file engine's child process (``python -m quark_ptq_eval.execute.engines.file2file``):
Quark's ``ModelQuantizer.direct_quantize_checkpoint``, shard by shard. The engine (what the plan
chooses, its constraints and its command line) is plan/engines/file2file.py."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from quark_ptq_eval.plan.engines.file2file import CHILD_MODULE


def build_parser() -> argparse.ArgumentParser:
    from quark_ptq_eval.execute.quark_api_engine import child_parser

    p = child_parser(f"python -m {CHILD_MODULE}")
    p.add_argument("--multi_device", action="store_true", help="one worker per GPU, shards spread over them")
    return p


def peak_memory() -> str:
    """This process's (and its multi-device workers') largest resident set, and its address space."""
    import re
    import resource

    rss = 1024 * max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                     resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)  # Linux reports KiB
    vm = re.search(r"^VmPeak:\s+(\d+) kB", Path("/proc/self/status").read_text(encoding="ascii"), re.M)
    return f"peak RSS {rss / 2**30:.2f} GiB" + (f", address space {int(vm[1]) / 2**20:.2f} GiB" if vm else "")


def keep_exclusions(out: Path, patterns: list[str]) -> list[str]:
    """Put back the plan's exclusions Quark dropped from the export's config; returns them.

    Quark 0.13 resolves exclusions against the tensors in the checkpoint, so a module with no tensor
    of its own (a tied lm_head) leaves ``exclude``; loaders then quantize it with no scale and the
    logits are NaN (found by our load check on a tied Llama-3.2-1B shape, docs/planning.md)."""
    from quark_ptq_eval.base.fsio import read_json, write_json

    path = out / "config.json"
    config = read_json(path, "the export's config.json")
    qc = config.get("quantization_config") or {}
    have = list(qc.get("exclude") or [])
    missing = [p for p in patterns if p not in have]
    if missing:
        qc["exclude"] = have + missing
        write_json(path, config)
    return missing


def _devices(device: str, multi: bool) -> str | list[str]:
    if not multi or device == "cpu":
        return device
    import torch

    count = torch.cuda.device_count()
    return [f"{device}:{i}" for i in range(count)] if count > 1 else device


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kv_cache_dtype or args.quant_algo:  # the plan refuses these; a hand-edited manifest might not
        print("error: file2file cannot calibrate KV-cache scales or run an algorithm", file=sys.stderr)
        return 2
    model_dir = Path(args.model_dir)
    shards = sorted(model_dir.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    largest = shards[-1].stat().st_size if shards else 0
    print(f"[quark-ptq-eval] file-to-file: {len(shards)} shard(s), the largest {largest / 2**20:.0f} MiB", flush=True)
    from quark_ptq_eval.base.first_use import announce_quark_import

    announce_quark_import("the file-to-file engine")
    import time

    from quark_ptq_eval.base.quark_import import import_quark_torch

    import_quark_torch()  # Quark's scan of transformers answered from our cache (quark_import.py)
    from quark.torch import LLMTemplate, ModelQuantizer

    from quark_ptq_eval.execute.quark_api_engine import copy_non_weight_files

    t0 = time.time()
    model_type = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["model_type"]
    config = LLMTemplate.get(model_type).get_config(
        scheme=args.quant_scheme, layer_config=dict(args.layer_quant_scheme or []), exclude_layers=args.exclude_layers)
    print(f"[quark-ptq-eval] quantizing shard by shard on {args.device}", flush=True)
    # Quark writes the shards, the index, config.json with its quantization_config, and copies the
    # source's other files (tokenizer, generation config) byte for byte.
    ModelQuantizer(config).direct_quantize_checkpoint(
        pretrained_model_path=str(model_dir), save_path=args.output_dir, device=_devices(args.device, args.multi_device))
    out = Path(args.output_dir)
    if (out / "config.json").is_file():  # Quark returns without output for inputs it skips (it logs why)
        copy_non_weight_files(model_dir, out)  # the source's other files, as quark-api carries them (no README.md)
        kept = keep_exclusions(out, list(config.exclude or []))
        if kept:
            print(f"[quark-ptq-eval] kept excluded (no tensor of their own, e.g. a tied lm_head): {', '.join(kept)}",
                  flush=True)
    print(f"[quark-ptq-eval] done in {time.time() - t0:.1f}s; {peak_memory()}", flush=True)
    return 0


if __name__ == "__main__":
    from quark_ptq_eval.base.process_exit import exit_now

    exit_now(main())  # the export is written and closed: skip the teardown of Quark and torch
