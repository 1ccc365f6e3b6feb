"""The fifth check: the export loads with the loader the evaluator would pick, and runs.

Headers and bytes can all be right while the model still cannot be used: a loader that
leaves scales uninitialised, a packing it reads differently. So the export is loaded (through
``evaluate/loading.py``: transformers' Quark integration, or Quark's importer for two-level
scales), a short probe runs through it and through the source, and the logits must be finite
and the greedy next tokens mostly agree with the source's. This is the only check that
imports torch and transformers; ``--no-load-check`` skips it for models too large for the host.
"""

from __future__ import annotations

import gc

from ..errors import QpeError
from .registry import ValidationContext
from .report import CheckResult, Finding

# Plain English and code (what the demo model was trained on), long enough for ~60 positions.
PROBE = ("Return the number of items in the container. If the argument is a string, the result is the "
         "length of the string. def length(obj):\n    return len(obj)\n")
MAX_PROBE_TOKENS = 64
AGREEMENT_THRESHOLD = 0.6  # share of probe positions whose greedy next token matches the source's


def check_load(ctx: ValidationContext) -> CheckResult:
    result = CheckResult("load")
    if not ctx.load_check:
        result.skipped_reason = ("not requested (--no-load-check, or load_check=False in the API): the export was "
                                 "not loaded or run")
        return result
    if ctx.shared.get("structural_failed"):
        result.skipped_reason = "a structural check failed: loading weights known to be wrong proves nothing"
        return result
    try:
        _probe(ctx, result)
    except QpeError as exc:
        result.findings.append(Finding("load", exc.message, side="environment",
                                       evidence=exc.hint or "the loader raised while reading the export"))
    except (ImportError, RuntimeError, ValueError, OSError) as exc:
        result.findings.append(Finding("load", f"the export could not be run: {exc}".rstrip(".") + ".",
                                       side="environment"))
    finally:
        gc.collect()
    return result


def _probe(ctx: ValidationContext, result: CheckResult) -> None:
    import torch

    from ..evaluate.loading import TRANSFORMERS, load_model

    trust = bool((ctx.plan or {}).get("trust_remote_code"))  # the user approved it in the plan, or not at all
    out = load_model(ctx.quantized, device="auto", trust_remote_code=trust)
    ids = out.tokenizer(PROBE, return_tensors="pt").input_ids[:, :MAX_PROBE_TOKENS]
    with torch.no_grad():
        got = out.model(ids.to(out.device)).logits.float().cpu()
    loader, reason, load_s = out.loader, out.loader_reason, out.load_s
    del out
    src = load_model(ctx.source, device="auto", trust_remote_code=trust, loader=TRANSFORMERS)
    with torch.no_grad():
        want = src.model(ids.to(src.device)).logits.float().cpu()
    del src
    result.stats.update(probe_tokens=int(ids.shape[1]))
    result.notes.append(f"loaded with {loader} ({reason}) in {load_s:.1f} s")
    finite = torch.isfinite(got)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        result.findings.append(Finding("logits", f"are not finite at {bad} of {got.numel()} values on the probe.",
                                       side="quark", evidence=f"expected: finite logits; found: {bad} NaN/inf "
                                                              f"(loader {loader})"))
        return
    agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    result.stats["greedy_agreement"] = round(agreement, 4)
    result.stats["agreement_threshold"] = AGREEMENT_THRESHOLD
    result.notes.append(f"greedy next tokens agree with the source's on {agreement:.1%} of {ids.shape[1]} probe "
                        f"positions (threshold {AGREEMENT_THRESHOLD:.0%})")
    if agreement < AGREEMENT_THRESHOLD:
        result.findings.append(Finding(
            "greedy next tokens", f"agree with the source's on {agreement:.1%} of {ids.shape[1]} probe positions, "
            f"below the {AGREEMENT_THRESHOLD:.0%} threshold.", side="quark",
            evidence=f"expected: at least {AGREEMENT_THRESHOLD:.0%} agreement; found {agreement:.1%} (loader {loader})"))
