"""The sequential engine's child process (``python -m quark_ptq_eval.execute.engines.sequential``): Quark's
quantizer, algorithms and exporter run on one decoder block at a time, never on the whole model.

1. The source opens on meta (the block streamer, runtime/blocks.py); the calibration windows are the quark-api
   engine's own (execute/quark_api_parts.py); the embedding runs once and is freed.
2. For each block in order: its tensors are read, the model holds only it (execute/engines/block_host.py), Quark's
   ``ModelQuantizer`` quantizes it with the plan's config (its algorithm on the block's inputs, its static scales
   observed on them), ``export_safetensors`` writes it, and the hidden states Quark's whole-model run would hand the
   next block are kept. The block's file, then those hidden states, are written atomically: a crash resumes after
   the last finished block.
3. The exit (final norm, lm_head and the embedding's tensors) goes through the same steps on the final hidden states.
4. The parts become one export (execute/engines/assemble.py) with the exit's ``config.json``; the source's other
   files are carried as the quark-api engine carries them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from quark_ptq_eval.plan.engines.sequential import CHILD_MODULE, STATE_DIR

EXIT = "exit"


def build_parser() -> argparse.ArgumentParser:
    from quark_ptq_eval.execute.quark_api_engine import build_parser as api_parser

    p = api_parser()
    p.prog = f"python -m {CHILD_MODULE}"
    return p


def log(message: str) -> None:
    print(f"[quark-ptq-eval] {message}", flush=True)


class Run:
    """One sequential quantization: the streamed source, the windows, Quark's config, the state on disk."""

    def __init__(self, args: argparse.Namespace):
        from transformers import AutoTokenizer

        from quark_ptq_eval.base.textdata import load_texts
        from quark_ptq_eval.execute.engines.block_host import window_key
        from quark_ptq_eval.execute.quark_api_parts import (
            calibration_batches,
            loaded_exclusions,
            template_config,
        )
        from quark_ptq_eval.runtime.blocks import open_streamed

        self.args, self.source, self.out = args, Path(args.model_dir), Path(args.output_dir)
        self.state = self.out / STATE_DIR
        self.streamed = open_streamed(self.source, args.device, args.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(self.source, trust_remote_code=args.trust_remote_code)
        self.batches = calibration_batches(tokenizer, load_texts(args.calib_data), args.seq_len,
                                           args.num_calib_data, args.batch_size, args.device)
        self.keys = [window_key(b) for b in self.batches]
        self.algorithm = args.quant_algo or None
        self.config_args = dict(
            algorithm=self.algorithm.split(",") if self.algorithm else None, kv_cache_scheme=args.kv_cache_dtype,
            layer_config=dict(args.layer_quant_scheme or []),
            exclude_layers=loaded_exclusions(self.streamed.model, self.source, args.exclude_layers))
        self.model_type = self.streamed.model.config.model_type
        self.template_config = template_config

    def config(self, exit_part: bool = False) -> Any:
        """Quark's config for a part. The exit's has no algorithm: Quark's algorithms work inside the decoder
        blocks only (they walk ``model_decoder_layers``), so the whole-model run never applies one to lm_head."""
        options = {**self.config_args, "algorithm": None} if exit_part else self.config_args
        return self.template_config(self.model_type, self.args.quant_scheme, **options)

    # --- state on disk: a block is done when its feed file exists (written after its part file)
    def part_file(self, part: str) -> Path:
        return self.state / f"part-{part}.safetensors"

    def feed_file(self, index: int) -> Path:
        return self.state / f"feed-after-{index}.pt"

    def resume_point(self) -> int:
        """The first block not finished by an earlier run (0: none was). Only the hidden states after the last
        finished block are kept (their file is written after the block's part file, so it marks the block done)."""
        feeds = [int(p.name[len("feed-after-"):-len(".pt")]) for p in self.state.glob("feed-after-*.pt")]
        last = max(feeds, default=-1)
        if any(not self.part_file(str(i)).is_file() for i in range(last + 1)):
            return 0  # not a state this engine left: start over
        return last + 1


def _save_atomic(obj: Any, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def entry_feed(run: Run) -> list[Any]:
    """The hidden states entering block 0 for each calibration batch: the model's own embedding forward."""
    from quark_ptq_eval.runtime import block_pass, blocks

    blocks.load(run.streamed, blocks.ENTRY)
    hidden = [block_pass.entry(run.streamed, batch, inference=False)[0] for batch in run.batches]
    blocks.free(run.streamed, blocks.ENTRY)
    return hidden


def quantize_hosted(run: Run, part: str, phases: list[list[Any]], index: int | None) -> list[list[Any]]:
    """Quark's quantizer, freezer and exporter on the model holding one part; the part's tensors are kept under
    the state dir and the next part's feed is returned."""
    import torch
    from quark.torch import ModelQuantizer, export_safetensors

    from quark_ptq_eval.execute.engines.block_host import Feed, hosting
    from quark_ptq_eval.execute.quark_api_parts import prepare_for_quantization

    model, streamed = run.streamed.model, run.streamed
    feed = Feed(run.keys, phases)
    with hosting(model, streamed.layers_path, streamed.layers, index, feed, exit_feed=index is None) as calls:
        prepare_for_quantization(model)
        quantizer = ModelQuantizer(run.config(exit_part=index is None))
        with torch.no_grad():
            quantized = quantizer.quantize_model(model, run.batches)
            quantized = quantizer.freeze(quantized)
            scratch = run.state / f"export-{part}"
            shutil.rmtree(scratch, ignore_errors=True)
            export_safetensors(model=quantized, output_dir=scratch, custom_mode="quark",
                               weight_format="real_quantized", pack_method="reorder")
    for attr in ("quant_config", "quark_quantized"):  # the next part starts from a model Quark has not marked
        if hasattr(model, attr):
            delattr(model, attr)
    _keep_part(run, part, scratch, index)
    own = sum(1 for forward, _ in calls.outputs if not forward)
    log(f"part {part}: Quark ran it {own} time(s) itself and {len(calls.outputs) - own} in the model's forward")
    return calls.next_phases(len(run.batches), run.algorithm)


def _keep_part(run: Run, part: str, scratch: Path, index: int | None) -> None:
    """The part's tensors (only its own: a block's under its index, the exit's outside the blocks) into its file."""
    from quark_ptq_eval.execute.engines.assemble import part_tensors, write_safetensors

    prefix = f"{run.streamed.layers_path}."
    files = sorted(scratch.glob("*.safetensors"))
    tensors = [t for f in files for t in part_tensors(f)]
    if index is None:
        own = [t for t in tensors if not t.name.startswith(prefix)]
    else:
        own = [t for t in tensors if t.name.startswith(f"{prefix}{index}.")]
        # A block's config.json is the whole model's with the plan's full quantization_config (the exit's
        # config has no algorithm): the last block's is the export's, with the exclusions merged below.
        os.replace(scratch / "config.json", run.state / "config.json")
    _note_exclusions(run, part, scratch / "config.json" if index is None else run.state / "config.json")
    write_safetensors(run.part_file(part), own)
    shutil.rmtree(scratch)


def _note_exclusions(run: Run, part: str, config_json: Path) -> None:
    """The exclusions Quark wrote for this part. Quark 0.13 writes in the export's ``exclude`` the modules the
    plan's patterns matched in the model it exported (``*mlp.gate`` becomes ``model.layers.0.mlp.gate``, ...), so
    each part has its own (a block never has ``lm_head``); the whole model's list is theirs in the model's order."""
    config = json.loads(config_json.read_text(encoding="utf-8"))
    kept = {**_read_kept(run), part: config.get("quantization_config", {}).get("exclude") or []}
    _save_json_atomic(kept, run.state / "excluded.json")
    if index_of(part) is None:  # the exit holds the embedding: transformers writes the first parameter's dtype
        os.replace(config_json, run.state / "exit-config.json")


def index_of(part: str) -> int | None:
    return None if part == EXIT else int(part)


def _read_kept(run: Run) -> dict[str, list[str]]:
    path = run.state / "excluded.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _save_json_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj), encoding="utf-8")
    os.replace(tmp, path)


def merged_config(run: Run) -> dict[str, Any]:
    """The exit's config.json (the model's own fields as the whole model writes them) with a block's
    quantization_config (the exit runs no algorithm) and every part's exclusions, in the model's order."""
    config: dict[str, Any] = json.loads((run.state / "exit-config.json").read_text(encoding="utf-8"))
    block = json.loads((run.state / "config.json").read_text(encoding="utf-8"))
    kept = _read_kept(run)
    order = [*(str(i) for i in range(run.streamed.num_blocks)), EXIT]
    excluded = list(dict.fromkeys(name for part in order for name in kept.get(part, [])))
    config["quantization_config"] = {**block["quantization_config"], "exclude": excluded}
    return config


def run_blocks(run: Run) -> list[list[Any]]:
    """Every block in order from the resume point; returns the final hidden states' feed."""
    import torch

    from quark_ptq_eval.execute.engines.block_host import PassThrough
    from quark_ptq_eval.runtime import blocks

    start = run.resume_point()
    total = run.streamed.num_blocks
    if start:
        log(f"resuming after block {start - 1}: blocks 0-{start - 1} were finished by an earlier run")
        phases: list[list[Any]] = torch.load(run.feed_file(start - 1), weights_only=True)
    else:
        phases = [entry_feed(run)]
    for index in range(start, total):
        t0 = time.perf_counter()
        blocks.load(run.streamed, str(index))
        original = run.streamed.layers[index]
        phases = quantize_hosted(run, str(index), phases, index)
        _save_atomic(phases, run.feed_file(index))
        # The block is dropped whole (Quark replaced its linears: the loader's names no longer all exist in it)
        run.streamed.loaded.pop(str(index), None)
        run.streamed.layers[index] = PassThrough(original)
        if index:
            run.feed_file(index - 1).unlink(missing_ok=True)
        log(f"block {index + 1}/{total} quantized and exported in {time.perf_counter() - t0:.1f}s")
    return phases


def run_exit(run: Run, phases: list[list[Any]]) -> None:
    from quark_ptq_eval.runtime import blocks

    parts = [blocks.ENTRY, *[p for p in blocks.exit_parts(run.streamed) if p != blocks.ENTRY]]
    for part in parts:
        blocks.load(run.streamed, part)
    quantize_hosted(run, EXIT, phases, None)
    for part in parts:
        blocks.free(run.streamed, part)


def assemble(run: Run) -> None:
    """The parts as one export: shards in the model's order (entry, blocks, exit), config.json, the source's files."""
    from quark_ptq_eval.execute.engines.assemble import part_tensors, write_export
    from quark_ptq_eval.execute.quark_api_engine import copy_non_weight_files

    exit_tensors = part_tensors(run.part_file(EXIT))
    entry = [t for t in exit_tensors if "embed" in t.name]
    rest = [t for t in exit_tensors if "embed" not in t.name]
    ordered = [*entry, *(t for i in range(run.streamed.num_blocks) for t in part_tensors(run.part_file(str(i)))),
               *rest]
    write_export(run.out, ordered)
    _write_config(run.out / "config.json", merged_config(run))
    copy_non_weight_files(run.source, run.out)
    shutil.rmtree(run.state)


def _write_config(path: Path, config: dict[str, Any]) -> None:
    """As transformers writes config.json (``to_json_string``: indent 2, sorted keys, a newline)."""
    _atomic_text = path.with_name(path.name + ".tmp")
    _atomic_text.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(_atomic_text, path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from quark_ptq_eval.base.first_use import announce_quark_import

    announce_quark_import("the sequential engine")
    import transformers

    from quark_ptq_eval.base.quark_import import import_quark_torch
    from quark_ptq_eval.execute.engines.file2file import peak_memory

    import_quark_torch()
    transformers.logging.set_verbosity_error()
    if __name__ == "__main__":  # a process of its own (not compare's in-process engine): its start-up, which the
        from quark_ptq_eval.base.process_exit import say_ready  # remedies' estimate leaves out of a warm one

        say_ready()
    t0 = time.time()
    run = Run(args)
    run.state.mkdir(parents=True, exist_ok=True)
    log(f"sequential: {run.streamed.num_blocks} decoder blocks, one at a time, on {len(run.batches)} calibration "
        f"batch(es); the largest block {max(map(run.streamed.block_bytes, range(run.streamed.num_blocks))) / 2**20:.0f} MiB")
    phases = run_blocks(run)
    log("quantizing the exit (final norm, lm_head) as the plan says")
    run_exit(run, phases)
    assemble(run)
    log(f"done in {time.time() - t0:.1f}s; {peak_memory()}")
    return 0


if __name__ == "__main__":
    from quark_ptq_eval.base.process_exit import exit_now

    exit_now(main())
