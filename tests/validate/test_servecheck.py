"""The serving check: each start reads only what its own server wrote, and a run from any directory finds the
checkout's own vLLM (runtime/vllm_host.vllm_python, as Tier 3 and the speed tier find it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quark_ptq_eval.runtime.vllm_host import ENV_VAR

ROOT = Path(__file__).resolve().parents[2]
CHECKOUT_VLLM = ROOT / ".venv-vllm" / "bin" / "python"


def test_a_start_never_reads_an_earlier_failed_starts_log_on_the_same_port():
    """A failed check keeps its log as evidence and the server appends to it; three checks at once
    (tests/evaluate/vllm/test_tier3_real_vllm.py) once got a port an earlier refusal had used and blamed
    the mxfp4 export for the fp8 export's error."""
    from quark_ptq_eval.runtime.vllm_host import failure_reason
    from quark_ptq_eval.validate.servecheck import _scratch_log

    earlier = _scratch_log(8000)
    earlier.write_text("ValueError: static_scaled_fp8_quant is not supported on CPU\n")
    later = _scratch_log(8000)
    try:
        assert later != earlier and later.read_bytes() == b"" and "8000" in later.name
        assert failure_reason(later) is None
    finally:
        earlier.unlink()
        later.unlink()


@pytest.mark.skipif(not (ROOT / ".venv-vllm" / ".installed").is_file(),
                    reason="no .venv-vllm: build the project's vLLM with `make vllm-env`")
def test_a_run_outside_the_checkout_serves_on_the_checkouts_vllm_with_no_variable_set(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """`run` from another directory said "no vLLM on this host" beside the checkout's `make vllm-env` (issue 65):
    the editable install finds it, --vllm-python still wins, and QUARK_PTQ_EVAL_VLLM_PYTHON=none turns it off.
    No server starts here: serving on that vLLM is test_tier3_real_vllm.py's."""
    from quark_ptq_eval.runtime.vllm_host import HostVllm, vllm_python
    from quark_ptq_eval.validate import servecheck
    from quark_ptq_eval.validate.registry import CheckInputs

    monkeypatch.delenv(ENV_VAR, raising=False)
    env = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, "PYTHONPATH")}
    probe = ("from quark_ptq_eval.runtime.vllm_host import find_host_vllm, vllm_python; "
             "print(vllm_python()[0]); print(find_host_vllm().python)")
    # A fresh interpreter started elsewhere: the package comes from the editable install, not from this cwd.
    found = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120, check=True).stdout.split()
    assert found == [str(CHECKOUT_VLLM), str(CHECKOUT_VLLM.absolute())]

    monkeypatch.chdir(tmp_path)
    served: list[HostVllm] = []
    monkeypatch.setattr(servecheck, "_serve", lambda model, host, result, *rest: served.append(host))
    result = servecheck.check_serving(CheckInputs(tmp_path, tmp_path, None))
    assert result.skipped_reason is None and not result.findings
    assert [h.python for h in served] == [str(CHECKOUT_VLLM)] and served[0].cpu

    assert vllm_python(tmp_path / "python") == (tmp_path / "python", "--vllm-python")  # the named one wins
    monkeypatch.setenv(ENV_VAR, "none")
    result = servecheck.check_serving(CheckInputs(tmp_path, tmp_path, None))
    assert result.skipped_reason and "no vLLM on this host" in result.skipped_reason and len(served) == 1
