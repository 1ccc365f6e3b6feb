"""A vLLM named by its interpreter, without starting one: what is refused, in one sentence, and the
plan's up-front note for schemes vLLM's CPU backend refuses (measured in test_tier3_real_vllm.py)."""

from __future__ import annotations

import signal
import sys

import pytest

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.plan.targets import deployment_of, scheme_warnings
from quark_ptq_eval.runtime.vllm_host import ENV_VAR, find_host_vllm


def test_no_vllm_named_means_none_and_a_wrong_one_is_refused_in_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "none")  # not even the checkout's own (tests/validate/test_servecheck.py)
    assert find_host_vllm(None) is None
    with pytest.raises(UsageError, match=r"^--vllm-python .* is not an executable Python interpreter; name"):
        find_host_vllm(tmp_path / "nothing")
    with pytest.raises(UsageError, match=r"cannot import vllm; install vLLM in that environment"):
        find_host_vllm(sys.executable)  # our own environment: no vLLM (it pins another torch)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nothing"))
    with pytest.raises(UsageError, match=f"^{ENV_VAR} "):
        find_host_vllm(None)


def test_plan_warns_up_front_where_vllm_cpu_refuses_the_scheme():
    cpu = deployment_of("cpu", "", {})
    for scheme, words in (("fp8", "static_scaled_fp8_quant"), ("mxfp4", "MXFP4 linear layer")):
        notes = [w for w in scheme_warnings(cpu, scheme, None) if "vLLM's CPU backend" in w]
        assert len(notes) == 1 and words in notes[0] and "choose int8" in notes[0]
    assert not [w for w in scheme_warnings(cpu, "int8", None) if "vLLM" in w]


# ---------------------------------------------------------------- servers on an AMX CPU, and servers that crash
_GET_PERM = ("import ctypes; v = ctypes.c_ulong(); ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(v)); "
             "print(v.value & (1 << 18) != 0)")  # ARCH_GET_XCOMP_PERM: is AMX tile data allowed?


@pytest.mark.skipif(not __import__("quark_ptq_eval.runtime.vllm_host", fromlist=["x"]).cpu_has_amx(),
                    reason="this CPU has no AMX: nothing to allow")
def test_a_server_on_an_amx_cpu_gets_amx_allowed_in_every_process_and_keeps_its_own_sitecustomize(tmp_path):
    """vllm-cpu 0.32's int4 kernel uses AMX tiles without asking Linux, which kills its engine with SIGILL on the
    first forward (seen on this host); every process a server of ours starts (vLLM spawns fresh interpreters,
    and the permission does not survive exec) asks first, and an environment's own sitecustomize still runs."""
    import subprocess

    from quark_ptq_eval.runtime.vllm_host import start_server

    assert subprocess.run([sys.executable, "-c", _GET_PERM], capture_output=True, text=True).stdout.strip() == "False"
    (own := tmp_path / "own").mkdir()
    (own / "sitecustomize.py").write_text("print('own sitecustomize ran')\n")
    child = f"import subprocess, sys; {_GET_PERM}; subprocess.run([sys.executable, '-c', {_GET_PERM!r}])"
    log = tmp_path / "server.log"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(own))
        proc = start_server([sys.executable, "-c", child], log)
    assert proc.wait(timeout=60) == 0
    lines = log.read_text().splitlines()
    assert lines[0].startswith("=== quark-ptq-eval: vLLM server started: ")  # each start's first line
    assert lines[1].startswith("=== quark-ptq-eval: AMX tile use allowed in every process of this server")
    assert lines[2:] == ["own sitecustomize ran", "True", "own sitecustomize ran", "True"]


def test_a_server_process_killed_by_a_signal_is_named_with_the_vllm_function_it_died_in(tmp_path):
    """faulthandler's real output (start_server sets PYTHONFAULTHANDLER) of a process that dies of SIGILL inside
    a function of a file under vllm/, as vllm-cpu's int4 kernel did here: the reason names both."""

    from quark_ptq_eval.runtime.vllm_host import failure_reason, start_server

    (pkg := tmp_path / "vllm").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_custom_ops.py").write_text("import os, signal\n\ndef cpu_gemm_wna16():\n"
                                        "    os.kill(os.getpid(), signal.SIGILL)\n")
    log = tmp_path / "server.log"
    log.write_text("RuntimeError: cancelled\n")  # a later symptom vLLM logs: not the cause
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(tmp_path))
        proc = start_server([sys.executable, "-c", "from vllm._custom_ops import cpu_gemm_wna16; cpu_gemm_wna16()"],
                            log)
    assert proc.wait(timeout=60) == -signal.SIGILL
    assert failure_reason(log) == "Fatal Python error: Illegal instruction in vLLM's cpu_gemm_wna16"
