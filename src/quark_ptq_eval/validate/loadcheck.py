"""The fifth check: the export loads with the loader the evaluator would pick, and reads as exported.

Headers and bytes can all be right while the model still cannot be used: a loader that leaves
scales uninitialised, reads a packing differently, or does not find weights under the names it
expects and initialises them at random. So the export is loaded (through ``runtime/loading.py``:
transformers' Quark integration, or Quark's importer for two-level scales and per-expert MoE
linears), and a short probe runs through the source. The verdict comes from replaying each module
on the source's own inputs (``replay.py``; MoE experts also one by one, each routed its own tokens,
``experts.py``) and holding the loader's output to what the export says the module computes
(``emulate.py``: its weights decoded from the files, its activations quantized as its
``quantization_config`` and scale tensors say) within floating-point rounding (``load_judge.py``).
The emulation's own distance from the source is the scheme's quantization error: reported per
module with its cause, evidence for Phase 3, never a failure. A unit the emulation cannot cover is
held to the source within its format's measured limit (``loadlimits.py``). Each static activation
scale is re-observed on the run's calibration text (``scale_ranges.py``). The loader must not
report weights it initialised; the logits must be finite. Greedy next-token agreement with the
source is reported, and judges only when no module could be replayed. This is the only check that
imports torch and transformers;
``--no-load-check`` skips it for models too large for the host.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.validate.registry import CheckInputs, read_config_or_empty
from quark_ptq_eval.validate.report import CheckResult, Finding

# Plain English and code (what the demo model was trained on), long enough for ~60 positions.
PROBE = ("Return the number of items in the container. If the argument is a string, the result is the "
         "length of the string. def length(obj):\n    return len(obj)\n")
MAX_PROBE_TOKENS = 64
# Relative output error of one replay unit (a module; under AWQ/SmoothQuant the unit holding its
# folded scales) on the source's input: limited per weight format and algorithm (loadlimits.py).
MAX_LISTED = 5


def load_check_alone(source: Path, quantized: Path, plan: dict[str, Any] | None = None,
                     stream_blocks: bool | None = None, load_budget_s: float | None = None) -> CheckResult:
    """The load check on its own, whatever the structural checks say (a loader diagnosis: since the
    decode check, a fault planted in a weight's file stops validation before the load check runs).
    ``load_budget_s``: the streamed check's time budget (load_sample.py; None: every block)."""
    ctx = CheckInputs(Path(source), Path(quantized), plan, load_check=True, stream_blocks=stream_blocks,
                      load_budget_s=load_budget_s)
    ctx.src_config, ctx.out_config = read_config_or_empty(ctx.source), read_config_or_empty(ctx.quantized)
    ctx.read_headers()  # the emulation decodes the export's tensors through them
    return check_load(ctx)


def check_load(ctx: CheckInputs) -> CheckResult:
    result = CheckResult("load")
    from quark_ptq_eval.validate.loadlimits import module_error_limit

    ctx.shared.module_error_limit = module_error_limit(ctx.qconfig, ctx.plan)
    if not ctx.load_check:
        result.skipped_reason = ("not requested (--no-load-check, or load_check=False in the API): the export was "
                                 "not loaded or run")
        return result
    if ctx.shared.unloadable:
        result.skipped_reason = "the layout or shard index check failed: the files are not what a loader reads"
        return result
    streamed, too_big = load_mode(ctx)
    if too_big:  # said before anything loads: the kernel's OOM killer would end validate with no report
        result.skipped_reason = too_big
        return result
    try:
        _probe(ctx, result, streamed)
    except QpeError as exc:
        result.findings.append(Finding("load", exc.message, side="environment",
                                       evidence=exc.hint or "the loader raised while reading the export"))
    except (ImportError, RuntimeError, ValueError, OSError, TypeError, AttributeError, KeyError) as exc:
        result.findings.append(Finding("load", f"the export could not be run: {exc}".rstrip(".") + ".",
                                       side="environment"))
    finally:
        gc.collect()
    return result


# The probe holds one whole model at a time (the source, then its emulation in place, then the export as loaded)
# with start-up and its captures: MODEL_OVERHEAD x the larger model's bytes + START_BYTES.
MODEL_OVERHEAD = 1.25
START_BYTES = int(1.4 * 2**30)


def memory_refusal(ctx: CheckInputs, available: int | None = None) -> str | None:
    """Why the load check cannot run within the RAM free now (with what it would need), else None."""
    from quark_ptq_eval.plan.host_memory import mem_available_bytes

    sizes = [sum(t.nbytes for t in tensors.values()) for tensors in (ctx.tensors("source"), ctx.tensors("output"))
             if tensors is not None]
    free = available if available is not None else mem_available_bytes()
    if not sizes or free is None:
        return None
    needed = int(max(sizes) * MODEL_OVERHEAD) + START_BYTES
    if needed <= free:
        return None
    return (f"not run: it loads the whole source and then the whole export (about {needed / 2**30:.1f} GiB of RAM at "
            f"its peak) and this host has {free / 2**30:.1f} GiB free; the other checks' results stand (run it "
            "on a host with that memory, or let it stream the model one part at a time: the default where the "
            "whole model does not fit)")


def load_mode(ctx: CheckInputs, available: int | None = None) -> tuple[bool, str | None]:
    """(streamed, why it cannot run at all): the whole model where it fits the RAM free (or as asked), else one
    part at a time where that fits; the reason names the memory the check would need."""
    from quark_ptq_eval.plan.host_memory import mem_available_bytes

    free = available if available is not None else mem_available_bytes()
    whole_refused = memory_refusal(ctx, free)
    if ctx.truncated:  # no loader reads the whole export: the blocks whose bytes are all there, one at a time
        from quark_ptq_eval.validate.load_stream import cut_ends

        if cut_ends(ctx):
            return True, ("not run: the embeddings or the model's head lie past a truncated shard's cut, so no block "
                          "can be run (the layout check names the shard)")
        return True, stream_refusal(ctx, free)
    streamed = ctx.stream_blocks if ctx.stream_blocks is not None else bool(whole_refused)
    if streamed:
        return True, stream_refusal(ctx, free)
    return False, whole_refused


def stream_refusal(ctx: CheckInputs, available: int | None = None) -> str | None:
    """Why even the streamed load check (one part at a time) cannot run within the RAM free now, else None."""
    from quark_ptq_eval.plan.host_memory import mem_available_bytes
    from quark_ptq_eval.validate.load_stream import stream_bytes

    free = available if available is not None else mem_available_bytes()
    needed = stream_bytes(ctx)
    if free is None or needed <= free:
        return None
    return (f"not run: even one decoder block at a time it needs about {needed / 2**30:.1f} GiB of RAM and this host "
            f"has {free / 2**30:.1f} GiB free; the other checks' results stand (run it on a host with that memory)")


def _probe(ctx: CheckInputs, result: CheckResult, streamed: bool = False) -> None:
    trust = bool((ctx.plan or {}).get("trust_remote_code"))  # the user approved it in the plan, or not at all
    if streamed:
        from transformers import AutoTokenizer

        from quark_ptq_eval.validate.load_stream import probe_streamed

        tokenizer = AutoTokenizer.from_pretrained(ctx.source, trust_remote_code=trust)
        ids = tokenizer(PROBE, return_tensors="pt").input_ids[:, :MAX_PROBE_TOKENS]
        result.notes.append("streamed one part at a time: a shard is truncated, so no loader reads the whole export"
                            if ctx.truncated else "streamed one part at a time: the whole model does not fit the RAM "
                            "free" if ctx.stream_blocks is None else "streamed one part at a time, as asked")
        probe_streamed(ctx, result, tokenizer, ids, trust)
        return
    _probe_whole(ctx, result, trust)


def _probe_whole(ctx: CheckInputs, result: CheckResult, trust: bool) -> None:
    from quark_ptq_eval.runtime.loading import TRANSFORMERS, load_model, missing_weights_message
    from quark_ptq_eval.validate import experts, replay
    from quark_ptq_eval.validate.emulate import emulate_outputs
    from quark_ptq_eval.validate.load_verdict import finish_probe, replay_units
    from quark_ptq_eval.validate.scale_ranges import check_static_scales

    # The source first, its module inputs kept; then it becomes the export's emulation (emulate.py) and
    # the emulated outputs are kept; then it is freed: one model in memory at a time.
    src = load_model(ctx.source, device="auto", trust_remote_code=trust, loader=TRANSFORMERS)
    ids = src.tokenizer(PROBE, return_tensors="pt").input_ids[:, :MAX_PROBE_TOKENS]
    captures, owners, want = replay.capture(src.model, ids)
    experts.route_every_expert(src.model, captures)  # the source computes them: it is freed next
    check_static_scales(ctx, src.model, src.tokenizer, result)  # on the source: what calibration ran
    emulated = emulate_outputs(ctx, src.model, owners, captures)
    emulated.emulation.close()
    del src
    gc.collect()
    out = load_model(ctx.quantized, device="auto", trust_remote_code=trust, allow_missing=True)
    loader = out.loader
    result.stats.update(probe_tokens=int(ids.shape[1]), loader=loader)
    result.notes.append(f"loaded with {loader} ({out.loader_reason}) in {out.load_s:.1f} s")
    if out.missing_weights:
        result.findings.append(Finding("weights", missing_weights_message(ctx.quantized, loader, out.missing_weights),
                                       side="quark", evidence=f"expected: every weight found; missing: "
                                                              f"{', '.join(out.missing_weights[:MAX_LISTED])}"))
    got = replay.run_probe(out.model, ids)
    exported = dict(out.model.named_modules())
    outputs = replay.unit_outputs(replay_units(ctx, owners, captures, exported, result), captures, exported)
    del out, exported
    from quark_ptq_eval.validate.load_judge import judge_units

    finish_probe(ctx, result, (got, want), loader, judge_units(outputs, captures, emulated), len(owners))
