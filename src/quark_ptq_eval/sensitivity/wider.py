"""Keep the proposed layers at a wider Quark scheme instead of unquantized, where that is enough.

A layer kept at its source precision costs (source bits - scheme bits) per weight; at an 8-bit
scheme through Quark's ``layer_quant_config`` it costs (8 - scheme bits), a fraction of that.
The alternative is measured, not assumed: one more Quark quantization of the whole model with the
proposed layers at the wider scheme (``get_config(layer_config=...)``) and one pass for its KL.
It is chosen when it meets the budget the exclusions met (or, when they did not, is no worse than
them); the plan then records the layers in ``layer_quant_config`` instead of ``exclude_layers``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from quark_ptq_eval.sensitivity.proposal import Proposal
from quark_ptq_eval.sensitivity.scan import ScanOptions, measure_kl, open_session, scheme_bits

# The 8-bit scheme a narrow scheme's sensitive layers move up to: the same number family, so the
# deployment kernels stay alike (fp8 next to fp4/fp6 formats, int8 next to int4).
_FP_NARROW = ("mxfp4", "mxfp6", "nvfp4", "amdfp4", "fp4_", "mx6", "int4_fp8")
_INT_NARROW = ("int4_", "uint4_")


def wider_scheme(scheme: str) -> str | None:
    """The default wider scheme for ``scheme`` (None: it is 8-bit or wider already)."""
    if scheme.startswith(_FP_NARROW):
        return "fp8"
    if scheme.startswith(_INT_NARROW):
        return "int8"
    return None


def try_wider(opts: ScanOptions, proposal: Proposal, result: dict[str, Any], batches: Callable[[], list[Any]],
              wider: str | None, progress: Callable[[str], None]) -> dict[str, Any] | None:
    """Measure the proposal's layers at ``wider`` and record the outcome in ``proposal.wider``."""
    if not proposal.exclude or not wider or wider == opts.scheme:
        return None
    known = result.setdefault("combinations", {})
    key = f"wider:{wider}:" + "|".join(proposal.exclude)
    if key not in known:
        progress(f"sensitivity: measuring the {len(proposal.exclude)} proposed layer(s) at {wider} instead of "
                 "unquantized (one more calibration and one pass)")
        layer_config = {**(opts.layer_config or {}), **{n: wider for n in proposal.exclude}}
        session = open_session(dataclasses.replace(opts, layer_config=layer_config), batches())
        known[key] = {"kl": measure_kl(session, set(session.layers)),
                      "bits": scheme_bits(session, proposal.exclude[0])}
    kl, bits = known[key]["kl"], known[key]["bits"]
    extra = int(proposal.params_kept * (bits - result.get("scheme_bits", 4.0)) / 8)
    reference = proposal.measured_kl if proposal.measured_kl is not None else proposal.predicted_kl
    chosen = kl <= proposal.max_kl if proposal.met else kl <= reference
    scale = proposal.extra_pct / proposal.extra_bytes if proposal.extra_bytes else 0.0
    proposal.wider = {"scheme": wider, "measured_kl": kl, "bits": bits, "extra_bytes": extra,
                      "extra_pct": extra * scale, "chosen": bool(chosen and extra < proposal.extra_bytes)}
    return proposal.wider
