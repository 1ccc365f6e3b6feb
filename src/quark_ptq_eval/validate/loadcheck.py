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
from typing import TYPE_CHECKING, Any

from quark_ptq_eval.base.errors import QpeError
from quark_ptq_eval.validate.registry import CheckInputs, read_config_or_empty
from quark_ptq_eval.validate.report import CheckResult, Finding

if TYPE_CHECKING:
    import torch

    from quark_ptq_eval.validate.folds import ReplayUnit
    from quark_ptq_eval.validate.load_judge import Judged
    from quark_ptq_eval.validate.replay import Capture

# Plain English and code (what the demo model was trained on), long enough for ~60 positions.
PROBE = ("Return the number of items in the container. If the argument is a string, the result is the "
         "length of the string. def length(obj):\n    return len(obj)\n")
MAX_PROBE_TOKENS = 64
AGREEMENT_THRESHOLD = 0.6  # share of probe positions whose greedy next token matches the source's
# Relative output error of one replay unit (a module; under AWQ/SmoothQuant the unit holding its
# folded scales) on the source's input: limited per weight format and algorithm (loadlimits.py).
MAX_LISTED = 5


def load_check_alone(source: Path, quantized: Path, plan: dict[str, Any] | None = None,
                     stream_blocks: bool | None = None) -> CheckResult:
    """The load check on its own, whatever the structural checks say (a loader diagnosis: since the
    decode check, a fault planted in a weight's file stops validation before the load check runs)."""
    ctx = CheckInputs(Path(source), Path(quantized), plan, load_check=True, stream_blocks=stream_blocks)
    ctx.src_config, ctx.out_config = read_config_or_empty(ctx.source), read_config_or_empty(ctx.quantized)
    ctx.read_headers()  # the emulation decodes the export's tensors through them
    return check_load(ctx)


def _error_limit(ctx: CheckInputs) -> tuple[float, str]:
    """(limit, why) of the module replay, set when the check starts."""
    assert ctx.shared.module_error_limit is not None
    return ctx.shared.module_error_limit


def check_load(ctx: CheckInputs) -> CheckResult:
    result = CheckResult("load")
    from quark_ptq_eval.validate.loadlimits import module_error_limit

    ctx.shared.module_error_limit = module_error_limit(ctx.qconfig, ctx.plan)
    if not ctx.load_check:
        result.skipped_reason = ("not requested (--no-load-check, or load_check=False in the API): the export was "
                                 "not loaded or run")
        return result
    if ctx.shared.structural_failed:
        result.skipped_reason = "a structural check failed: loading weights known to be wrong proves nothing"
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
        result.notes.append("streamed one part at a time: the whole model does not fit the RAM free"
                            if ctx.stream_blocks is None else "streamed one part at a time, as asked")
        probe_streamed(ctx, result, tokenizer, ids, trust)
        return
    _probe_whole(ctx, result, trust)


def _probe_whole(ctx: CheckInputs, result: CheckResult, trust: bool) -> None:
    from quark_ptq_eval.runtime.loading import TRANSFORMERS, load_model, missing_weights_message
    from quark_ptq_eval.validate import experts, replay
    from quark_ptq_eval.validate.emulate import emulate_outputs
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


def finish_probe(ctx: CheckInputs, result: CheckResult, logits: tuple[torch.Tensor, torch.Tensor], loader: str,
                 judged: Judged, owners: int) -> None:
    """The verdict once every unit was replayed: finite logits (the export's, then the source's), then the units'
    judgment and the greedy agreement (decisive only where no unit could be replayed)."""
    got, want = logits
    if _logits_finite(got, loader, result):
        judged.report(owners, loader, result, _error_limit(ctx))
        _judge_agreement(got, want, got.shape[-2], loader, result, decisive=not (judged.loader or judged.fallback))


def replay_units(ctx: CheckInputs, owners: list[str], captures: dict[str, Capture], exported: dict[str, Any],
           result: CheckResult) -> list[ReplayUnit]:
    """What to replay: each module; under AWQ/SmoothQuant the smallest unit holding its folded scales
    (folds.py); nothing where the algorithm rotated the residual stream (only the whole model is
    equivalent: greedy agreement judges)."""
    from quark_ptq_eval.validate import replay
    from quark_ptq_eval.validate.experts import coverage, every_expert_units
    from quark_ptq_eval.validate.folds import ReplayUnit, fold_groups, fold_units
    from quark_ptq_eval.validate.rewrites import ROTATING, SCALING, algorithms

    algos = set(algorithms(ctx.qconfig, ctx.plan))
    if algos & ROTATING:
        result.notes.append(f"{', '.join(sorted(algos & ROTATING))} rotates the residual stream: no module is "
                            "equivalent to the source's alone")
        return []
    targets = replay.replay_targets(owners, captures, exported)
    if not algos & SCALING:
        forced = every_expert_units(captures, exported, _error_limit(ctx)[0])
        if forced:
            routed, total = coverage(captures)
            result.stats.update(experts=total, experts_routed_by_probe=routed)
            result.notes.append(f"{len({u.module for u in forced})} experts module(s) replayed expert by expert "
                                f"(the probe's own routing reached {routed} of {total} experts)")
        return [ReplayUnit(t) for t in targets] + forced
    units = fold_units(targets, fold_groups(ctx.qconfig), set(owners),
                       lambda name: replay.replayable(captures.get(name), exported.get(name)))
    chained = sum(1 for u in units if u.norm)
    layers = sum(1 for u in units if u.residual)
    result.notes.append(f"{', '.join(sorted(algos & SCALING))} folds scales between modules: {chained} unit(s) "
                        f"replayed after their export's norm, {layers} decoder layer(s) replayed whole")
    return units


def _logits_finite(got: torch.Tensor, loader: str, result: CheckResult) -> bool:
    import torch

    finite = torch.isfinite(got)
    if bool(finite.all()):
        return True
    bad = int((~finite).sum())
    result.findings.append(Finding("logits", f"are not finite at {bad} of {got.numel()} values on the probe.",
                                   side="quark", evidence=f"expected: finite logits; found: {bad} NaN/inf "
                                                          f"(loader {loader})"))
    return False


def _judge_agreement(got: torch.Tensor, want: torch.Tensor, positions: int, loader: str, result: CheckResult,
                     decisive: bool) -> None:
    agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    result.stats["greedy_agreement"] = round(agreement, 4)
    role = f"threshold {AGREEMENT_THRESHOLD:.0%}" if decisive else "informational: the module replay judges"
    result.notes.append(f"greedy next tokens agree with the source's on {agreement:.1%} of {positions} probe "
                        f"positions ({role})")
    if decisive:
        result.stats["agreement_threshold"] = AGREEMENT_THRESHOLD
    if decisive and agreement < AGREEMENT_THRESHOLD:
        result.findings.append(Finding(
            "greedy next tokens", f"agree with the source's on {agreement:.1%} of {positions} probe positions, "
            f"below the {AGREEMENT_THRESHOLD:.0%} threshold.", side="quark",
            evidence=f"expected: at least {AGREEMENT_THRESHOLD:.0%} agreement; found {agreement:.1%} (loader {loader})"))

