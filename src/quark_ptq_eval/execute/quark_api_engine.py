"""Quark's public Python API as a command-line engine, for what `quark-cli` 0.13 cannot do.

`quark-cli torch-llm-ptq` loads with ``device_map="auto"`` (fails on hosts with no GPU) and
calibrates only from fixed Hub dataset ids (fails offline). This module takes the same flags
plus ``--calib_data PATH`` and drives the same public API the CLI uses (``LLMTemplate``,
``ModelQuantizer``, ``export_safetensors``, and ``preprocess_for_quantization`` for MoE experts), on any device, with local calibration text.
Non-weight files of the source are copied byte for byte, so the output has no tokenizer drift (all but
the base model's README.md: the export's card is written by the recipe's last step).
"""

from __future__ import annotations

import argparse
import fnmatch
import time
from pathlib import Path

from quark_ptq_eval.execute.quark_api_parts import (
    calibration_batches,
    loaded_exclusions,
    prepare_for_quantization,
    template_config,
)

# README.md is the base model's card: the export gets a card of its own (publish/), never the base's copy
NON_WEIGHT_SKIP = ("config.json", "model.safetensors.index.json", "README.md")
# Weights in any format: the export holds its own (a source pickle is never carried into it).
NOT_CARRIED = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.onnx", "*.msgpack", "*.index.json")


def child_parser(prog: str) -> argparse.ArgumentParser:
    """The quark-cli spellings every engine child takes (this one and engines/file2file.py)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--model_dir", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--quant_scheme", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--layer_quant_scheme", nargs=2, action="append", metavar=("PATTERN", "QUANT_SCHEME"))
    p.add_argument("--kv_cache_dtype", default=None)
    p.add_argument("--quant_algo", default=None)
    p.add_argument("--exclude_layers", nargs="*", default=None)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = child_parser("python -m quark_ptq_eval.execute.quark_api_engine")
    p.add_argument("--calib_data", required=True, help=".txt, .jsonl or .parquet")
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--num_calib_data", type=int, default=128)
    p.add_argument("--trust_remote_code", action="store_true")
    return p


def copy_non_weight_files(src: Path, dst: Path) -> None:
    """The source's top-level non-weight files, byte for byte, from the paths intake approved (links
    resolved and checked again now), written as regular files over whatever Quark put there."""
    from quark_ptq_eval.intake.model_files import approved_files, copy_approved

    for rel, target in approved_files(src).items():
        carried = not any(fnmatch.fnmatchcase(rel, p) for p in NOT_CARRIED) and rel not in NON_WEIGHT_SKIP
        if carried and "/" not in rel and not rel.startswith("."):
            copy_approved(target, dst / rel)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from quark_ptq_eval.base.first_use import announce_quark_import

    announce_quark_import("the Quark API engine")  # on a fresh machine this import compiles Quark's kernels
    import torch
    import transformers

    from quark_ptq_eval.base.quark_import import import_quark_torch

    import_quark_torch()  # Quark's scan of transformers answered from our cache (quark_import.py)
    from quark.torch import ModelQuantizer, export_safetensors
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quark_ptq_eval.base.textdata import load_texts
    from quark_ptq_eval.execute.quant_split import measured

    transformers.logging.set_verbosity_error()  # e.g. "sequence longer than max length": we window it
    if __name__ == "__main__":  # a process of its own (not compare's in-process engine): its start-up, which the
        from quark_ptq_eval.base.process_exit import say_ready  # remedies' estimate leaves out of a warm one

        say_ready()
    t0 = time.time()
    print(f"[quark-ptq-eval] loading {args.model_dir} on {args.device}", flush=True)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype="auto", trust_remote_code=args.trust_remote_code
    ).to(args.device)
    model.eval()
    prepare_for_quantization(model)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, trust_remote_code=args.trust_remote_code)
    batches = calibration_batches(
        tokenizer, load_texts(args.calib_data), args.seq_len, args.num_calib_data, args.batch_size, args.device
    )
    config = template_config(
        model.config.model_type, args.quant_scheme,
        algorithm=args.quant_algo.split(",") if args.quant_algo else None,
        kv_cache_scheme=args.kv_cache_dtype,
        layer_config=dict(args.layer_quant_scheme or []),
        exclude_layers=loaded_exclusions(model, args.model_dir, args.exclude_layers),
    )
    print("[quark-ptq-eval] quantizing", flush=True)
    quantizer = ModelQuantizer(config)
    with torch.no_grad():
        with measured(quantizer, model, sum(len(b) for b in batches)):  # its split, for the remedies' estimate
            model = quantizer.quantize_model(model, batches)
        model = quantizer.freeze(model)
        print("[quark-ptq-eval] exporting", flush=True)
        out = Path(args.output_dir)
        export_safetensors(model=model, output_dir=out, custom_mode="quark",
                           weight_format="real_quantized", pack_method="reorder")
    copy_non_weight_files(Path(args.model_dir), out)
    print(f"[quark-ptq-eval] done in {time.time() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    from quark_ptq_eval.base.process_exit import exit_now

    exit_now(main())  # the export is written and closed: skip the teardown of Quark and torch
