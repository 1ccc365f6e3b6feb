"""The sequential engine (execute/engines/sequential.py) against the whole-model engine (execute/quark_api_engine.py):
the same Quark, the same plan, the same calibration windows; one quantizes the model whole, the other one decoder
block at a time. On models that fit, their exports must be the same bytes, file by file: a trained 8-block tiny
Llama with the outlier channels real LLMs have (int8 static, fp8 with an FP8 KV cache, int4_wo_128 + GPTQ,
int8 + SmoothQuant) and a tiny qwen3_moe (int8, fp8 + FP8 KV cache). Killed mid-way and re-run, it resumes after the
last finished block and writes the same bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quark_ptq_eval.execute.engines import sequential
from tests.evaluate.ppl.test_stream_tier1 import export, llama8_traits  # noqa: F401 - the shared fixture

pytestmark = pytest.mark.slow

CALIBRATION = ("--num_calib_data", "8", "--seq_len", "128")  # the shared exports' windows (test_stream_tier1)


def sequential_export(model: Path, out: Path, corpus: Path, scheme: str, *extra: str) -> Path:
    argv = ["--model_dir", str(model), "--output_dir", str(out), "--quant_scheme", scheme, "--calib_data",
            str(corpus), *CALIBRATION, *extra]
    assert sequential.main(argv) == 0
    return out


def assert_same_files(whole: Path, seq: Path) -> None:
    names = sorted(p.name for p in whole.iterdir())
    assert sorted(p.name for p in seq.iterdir()) == names
    for name in names:
        assert (seq / name).read_bytes() == (whole / name).read_bytes(), f"{name} differs"


CASES = {
    "int8": ("int8",),
    "fp8+fp8_kv": ("fp8", "--kv_cache_dtype", "fp8"),
    "int4_wo_128+gptq": ("int4_wo_128", "--quant_algo", "gptq"),
    "int8+smoothquant": ("int8", "--quant_algo", "smoothquant"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_sequential_export_is_the_whole_model_engines_bytes_on_a_trained_llama(case, llama8_traits,  # noqa: F811
                                                                                   shared_assets, corpus, tmp_path):
    scheme, *extra = CASES[case]
    whole = export(shared_assets, corpus, llama8_traits, scheme, *extra)
    seq = sequential_export(llama8_traits, tmp_path / "seq", corpus, scheme, *extra)
    assert_same_files(whole, seq)
    assert not (seq / ".sequential").exists()  # its state is gone once the export is whole


@pytest.mark.parametrize("case", ["int8", "fp8+fp8_kv"])
def test_the_sequential_export_is_the_whole_model_engines_bytes_on_a_tiny_moe(case, tiny_model, shared_assets,
                                                                              corpus, tmp_path):
    """Experts prepared per block as quark-cli prepares them, routed by the model's own router; the router gates
    excluded by the template are named per block by Quark and merged in the model's order."""
    scheme, *extra = CASES[case]
    source = tiny_model("qwen3_moe")
    whole = export(shared_assets, corpus, source, scheme, *extra)
    seq = sequential_export(source, tmp_path / "seq", corpus, scheme, *extra)
    assert_same_files(whole, seq)


def test_killed_mid_way_it_resumes_after_the_last_finished_block_and_writes_the_same_bytes(
        llama8_traits, shared_assets, corpus, tmp_path):  # noqa: F811
    whole = export(shared_assets, corpus, llama8_traits, "int8")
    out = tmp_path / "seq"
    argv = [sys.executable, "-m", "quark_ptq_eval.execute.engines.sequential", "--model_dir", str(llama8_traits),
            "--output_dir", str(out), "--quant_scheme", "int8", "--calib_data", str(corpus), *CALIBRATION]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "first.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 300
        while "block 4/8 quantized" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # a crash: no handler runs
        proc.wait()
    assert "block 4/8 quantized" in log.read_text() and "done in" not in log.read_text()
    state = out / ".sequential"
    finished = sorted(p.name for p in state.glob("part-*.safetensors"))
    assert "part-3.safetensors" in finished and "part-exit.safetensors" not in finished
    again = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
    resumed = next(line for line in again.stdout.splitlines() if "resuming after block" in line)
    done = int(resumed.split("resuming after block ")[1].split(":")[0])
    assert done >= 3, resumed
    assert f"block {done + 1}/8 quantized" not in again.stdout  # no finished block ran twice
    assert_same_files(whole, out)
