"""A vLLM named by its interpreter, without starting one: what is refused, in one sentence, and the
plan's up-front note for schemes vLLM's CPU backend refuses (measured in test_tier3_real_vllm.py)."""

from __future__ import annotations

import sys

import pytest

from quark_ptq_eval.base.errors import UsageError
from quark_ptq_eval.plan.targets import deployment_of, scheme_warnings
from quark_ptq_eval.runtime.vllm_host import ENV_VAR, find_host_vllm


def test_no_vllm_named_means_none_and_a_wrong_one_is_refused_in_one_sentence(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
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
