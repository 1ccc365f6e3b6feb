"""`make demo`: the whole recipe on the embedded tiny model, offline, approvals given by flags."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from quark_ptq_eval.base.ui import noise_to_log
from quark_ptq_eval.cli.main import main as cli_main
from quark_ptq_eval.evaluate.tiers import text_tier


def main(argv: list[str] | None = None) -> int:
    root = Path((argv or sys.argv[1:] or ["demo-work"])[0]).resolve()
    from quark_ptq_eval.flows.demo import build_corpus, build_tiny_model

    corpus, model = root / "corpus.txt", root / "tiny-llama"
    if not (model / "config.json").exists():
        t = time.monotonic()
        print(f"Building the embedded tiny model and corpus in {root} ...", file=sys.stderr, flush=True)
        with noise_to_log(root / "logs" / "build.log"):  # transformers' warnings and shard bars
            build_corpus(corpus)
            build_tiny_model(model, corpus)
        print(f"  built in {time.monotonic() - t:.0f} s (library output: {root / 'logs' / 'build.log'})",
              file=sys.stderr)
    args = demo_args(model, corpus, root / "tiny-llama-int8", root / "run")
    print("$ quark-ptq-eval " + " ".join(args), file=sys.stderr, flush=True)
    return cli_main(args)


def demo_args(model: Path, corpus: Path, output: Path, workdir: Path) -> list[str]:
    """The demo's `run` arguments (the crash campaign, bench/benchmarks/crash_campaign.py, runs exactly these)."""
    return ["run", str(model), "-o", str(output), "--workdir", str(workdir),
            "--scheme", "int8", "--calib-data", str(corpus), "--num-calib-samples", "32", "--calib-seq-len", "256",
            # No --eval-data: Tier 1 scores the part of the corpus the plan holds out from calibration.
            "--offline", "--yes", "--eval-tier", text_tier().name, "--seq-len", "256",
            "--baseline", "--overwrite", "--execution-mode", "batch_execute"]


if __name__ == "__main__":
    sys.exit(main())
