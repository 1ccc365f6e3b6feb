"""Sensitivity scan cost: replay from the layer's block on cached inputs vs full forward passes.

Both contenders quantize once with Quark (fake-quant) and toggle one layer at a time; they differ
only in how a measurement runs the model. The naive alternative, one Quark quantization per
layer (exclude every other layer), costs L calibrations on top: it is stated, not run.
Run: ``python -m bench.benchmarks.bench_sensitivity [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _model(root: Path, layers: int) -> tuple[Path, Path]:
    from quark_ptq_eval.flows.demo import TinyShape, build_corpus, build_tiny_model

    corpus = build_corpus(root / "corpus.txt", max_chars=60_000)
    return build_tiny_model(root / "model", corpus, shape=TinyShape(layers=layers), train_steps=30), corpus


def _scan(model: Path, corpus: Path, replay: bool, samples: int) -> tuple[float, dict]:
    from quark_ptq_eval.sensitivity import ScanOptions
    from quark_ptq_eval.sensitivity.scan import scan

    opts = ScanOptions(model_dir=model, scheme="int4_wo_32", calib_data=corpus, num_samples=samples, seq_len=128,
                       use_cache=False, replay=replay)
    t0 = time.perf_counter()
    result, _ = scan(opts, progress=lambda _m: None)
    return time.perf_counter() - t0, result


def run(quick: bool = False) -> list[dict]:
    layers, samples = (4, 2) if quick else (8, 8)
    with tempfile.TemporaryDirectory() as tmp:
        model, corpus = _model(Path(tmp), layers)
        _scan(model, corpus, replay=True, samples=1)  # warm-up: imports, kernel loading, first quantization
        ours_s, ours = _scan(model, corpus, replay=True, samples=samples)
        peer_s, peer = _scan(model, corpus, replay=False, samples=samples)
    n = ours["cost"]["layers"]
    same = max(abs(a["kl"] - b["kl"]) for a, b in zip(ours["layers"], peer["layers"], strict=True))
    note = (f"{n} layers, {layers} blocks, {samples} x 128 tokens: measurement passes "
            f"{ours['cost']['measurement_passes']} (replay) vs {peer['cost']['measurement_passes']} (full); "
            f"max |KL difference| {same:.2g}; naive per-layer quantization: {n} calibrations + {n} passes")
    return [{"benchmark": "sensitivity scan (int4_wo_32)", "ours_s": ours_s, "peer": "full forward per layer",
             "peer_s": peer_s, "ratio": peer_s / ours_s if ours_s else None,
             "target": "fewer model passes than layers", "ok": ours["cost"]["measurement_passes"] < n,
             "note": note}]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    print(json.dumps(run(quick=p.parse_args().quick), indent=2))
