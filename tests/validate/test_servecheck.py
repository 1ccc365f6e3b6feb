"""The serving check's scratch log: each start reads only what its own server wrote."""

from __future__ import annotations


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
